"""Kernel inputs as engines hold them: int32 or int64 replica and slot indexes (LightLLM and
vLLM keep int32), and MLA pools as LightLLM keeps them, token-major `[slots, 1, 576]`, each
against the torch reference, bit for bit (under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvrt
from kvrt._pools import INDEX_DTYPES, Layout, PoolTable, checked_indexes
from kvrt.kernels.paged_kv import (
    gather,
    gather_into,
    gather_layer_into_any,
    gather_layer_reference,
    gather_reference,
    scatter_from,
    scatter_layer_from,
    scatter_layer_reference,
    scatter_reference,
)
from kvrt.kernels.pool_to_pool import move_between, move_between_reference
from tests.conftest import KERNEL_DEVICE, TRITON_KERNEL_MARKS
from tests.test_kernels import (
    build,
    cases,
    gathered_as_the_reference,
    poisoned_key_and_value,
    random_key_and_value,
    random_pool,
    same_bits,
    same_pools,
)

DEVICE = KERNEL_DEVICE
Test = TypeVar("Test", bound=Callable[..., Any])
MLA_LATENT = 576
"""DeepSeek's latent per token: kv_lora_rank 512 + qk_rope_head_dim 64."""


def runs_kernels(test: Test) -> Test:
    """A test that launches Triton kernels: on a GPU, or on CPU under TRITON_INTERPRET=1."""
    for mark in TRITON_KERNEL_MARKS:
        test = mark(test)
    return test


def as_dtypes(
    replica: torch.Tensor, slots: torch.Tensor, dtypes: tuple[torch.dtype, torch.dtype]
) -> tuple[torch.Tensor, torch.Tensor]:
    return replica.to(dtypes[0]), slots.to(dtypes[1])


index_dtype_pairs = st.sampled_from([(a, b) for a in INDEX_DTYPES for b in INDEX_DTYPES])


def mla_pools(layout: Layout, *, replicas: int = 2, copies: int = 2, slots: int = 12, seed: int = 0) -> PoolTable:
    """MLA pools as LightLLM keeps them, `[slots, 1, 576]` bf16, registered as `layout`."""
    generator = torch.Generator().manual_seed(seed)
    return PoolTable(
        [[[random_pool((slots, 1, MLA_LATENT), torch.bfloat16, generator) for _ in range(2)] for _ in range(copies)]
         for _ in range(replicas)],
        layout,
    )  # fmt: skip


@pytest.mark.parametrize("dtypes", [(torch.int32, torch.int32), (torch.int32, torch.int64), (torch.int64, torch.int32)])
@pytest.mark.parametrize("where", [DEVICE, "cpu"], ids=["on-the-pools-device", "on-the-host"])
def test_int32_indexes_are_checked_and_placed_like_int64_ones(
    dtypes: tuple[torch.dtype, torch.dtype], where: str
) -> None:
    table, replica, slots = build(
        {"layout": Layout.TOKEN_MAJOR, "heads": 2, "head_dim": 4, "block_size": 2, "slots": 8, "replicas": 2,
         "copies": 1, "layers": 1, "tokens": 4, "dtype": torch.float16, "seed": 1}
    )  # fmt: skip
    replica, slots = as_dtypes(replica.to(where), slots.to(where), dtypes)
    placed_replica, placed_slots = checked_indexes(table, replica, slots)
    assert placed_replica.device == table.device and placed_replica.dtype == dtypes[0]
    assert placed_slots.tolist() == slots.tolist()
    with pytest.raises(kvrt.InvalidInputError, match="slot index 8 is out of range"):
        checked_indexes(table, replica, torch.tensor([0, 1, 2, 8], dtype=dtypes[1], device=where))


def test_indexes_of_another_dtype_are_refused_saying_which_are_taken() -> None:
    table, replica, slots = build(
        {"layout": Layout.MLA, "heads": 1, "head_dim": 4, "block_size": 2, "slots": 8, "replicas": 1,
         "copies": 1, "layers": 1, "tokens": 2, "dtype": torch.float16, "seed": 1}
    )  # fmt: skip
    with pytest.raises(kvrt.InvalidInputError, match="1-D int32 or int64 tensor"):
        checked_indexes(table, replica, slots.to(torch.int16))


@runs_kernels
@settings(max_examples=20, deadline=None)
@given(case=cases(), dtypes=index_dtype_pairs)
def test_gather_with_int32_or_int64_indexes_equals_its_reference(
    case: dict[str, object], dtypes: tuple[torch.dtype, torch.dtype]
) -> None:
    table, replica, slots = build(case)
    heads = case["head_range"]
    got = gather(table, *as_dtypes(replica, slots, dtypes), heads=heads, tuning=case["tuning"])  # type: ignore[arg-type]
    assert same_bits(got, gather_reference(table, replica, slots, heads=heads))  # type: ignore[arg-type]


@runs_kernels
@settings(max_examples=20, deadline=None)
@given(case=cases(), dtypes=index_dtype_pairs)
def test_scatter_from_with_int32_or_int64_indexes_equals_its_reference(
    case: dict[str, object], dtypes: tuple[torch.dtype, torch.dtype]
) -> None:
    table, replica, slots = build(case)
    expected, _, _ = build(case)
    key, value = random_key_and_value(table, slots.numel(), seed=7)
    scatter_from(table, key, value, *as_dtypes(replica, slots, dtypes), tuning=case["tuning"])  # type: ignore[arg-type]
    parts = [key] if table.geometry.kv == 1 else [key, value]
    scatter_reference(expected, torch.stack(parts, dim=2), replica, slots)
    assert same_pools(table, expected)


@runs_kernels
@pytest.mark.parametrize("dtypes", [(torch.int32, torch.int32), (torch.int64, torch.int32)])
def test_one_layer_with_int32_indexes_equals_its_reference(dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    table, replica, slots = build(
        {"layout": Layout.BLOCK, "heads": 3, "head_dim": 8, "block_size": 2, "slots": 8, "replicas": 3,
         "copies": 1, "layers": 2, "tokens": 5, "dtype": torch.bfloat16, "seed": 4}
    )  # fmt: skip
    narrow_replica, narrow_slots = as_dtypes(replica, slots, dtypes)
    g = table.geometry
    key = torch.empty((5, g.heads, g.head_dim), dtype=table.dtype, device=DEVICE)
    value = torch.empty_like(key)
    gather_layer_into_any(table, narrow_replica, narrow_slots, 1, key, value)
    want_key, want_value = gather_layer_reference(table, replica, slots, 1)
    assert same_bits(key, want_key) and same_bits(value, want_value)
    expected, _, _ = build(
        {"layout": Layout.BLOCK, "heads": 3, "head_dim": 8, "block_size": 2, "slots": 8, "replicas": 3,
         "copies": 1, "layers": 2, "tokens": 5, "dtype": torch.bfloat16, "seed": 4}
    )  # fmt: skip
    scatter_layer_from(table, value, key, narrow_replica, narrow_slots, 0)
    scatter_layer_reference(expected, value, key, replica, slots, 0)
    assert same_pools(table, expected)


@runs_kernels
@pytest.mark.parametrize("layout", [Layout.TOKEN_MAJOR, Layout.MLA], ids=lambda layout: layout.value)
def test_an_mla_pool_of_one_latent_row_per_slot_gathers_and_scatters_like_its_reference(layout: Layout) -> None:
    table = mla_pools(layout)
    assert (table.geometry.kv, table.geometry.heads, table.geometry.head_dim) == (1, 1, MLA_LATENT)
    replica = torch.tensor([1, 0, 1, 1], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([11, 0, 5, 3], dtype=torch.int32, device=DEVICE)
    key, value = poisoned_key_and_value(table, 4)
    gather_into(table, replica, slots, key, value)
    assert gathered_as_the_reference(table, replica.long(), slots.long(), key, value)
    expected = mla_pools(layout)
    written, _ = random_key_and_value(table, 4, seed=9)
    scatter_from(table, written, written, replica, slots)
    scatter_reference(expected, written.unsqueeze(2), replica.long(), slots.long())
    assert same_pools(table, expected)  # every copy of the replica (every card of its group)


@runs_kernels
def test_a_move_between_pools_takes_int32_indexes() -> None:
    source, target = mla_pools(Layout.TOKEN_MAJOR, seed=1), mla_pools(Layout.MLA, seed=2)
    expected = mla_pools(Layout.MLA, seed=2)
    src_slots = torch.tensor([2, 7, 1], dtype=torch.int32, device=DEVICE)
    dst_slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    move_between(source, 1, src_slots, target, 0, dst_slots)
    move_between_reference(source, 1, src_slots.long(), expected, 0, dst_slots.long())
    assert same_pools(target, expected)


def test_a_token_major_pool_with_an_odd_number_of_rows_above_one_is_refused_saying_what_fits() -> None:
    pool = torch.zeros((4, 3, 8), dtype=torch.float16, device=DEVICE)
    with pytest.raises(kvrt.InvalidInputError, match=r"\[slots, 2\*heads, head_dim\].*or \[slots, 1, latent_dim\]"):
        PoolTable([[[pool]]], Layout.TOKEN_MAJOR)


async def test_publish_and_pull_take_int32_slots_and_mla_pools_as_lightllm_keeps_them() -> None:
    source, target = mla_pools(Layout.TOKEN_MAJOR, seed=3), mla_pools(Layout.TOKEN_MAJOR, seed=4)
    if source.device.type != "cpu":
        pytest.skip("the CPU path of publish and pull (the references); GPU runs are in test_gpu_ipc")
    tokens = torch.arange(300, 304)
    from_slots = torch.tensor([9, 2, 4, 6], dtype=torch.int32)
    into_slots = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        producer.register_pools(source)
        await producer.publish(tokens, from_slots, torch.tensor([1, 0, 1, 0], dtype=torch.int32))
        item = await consumer.pull(tokens, into=target, slots=into_slots, replica=1)
    assert item is not None and item.matched == 4
    for layer in range(2):
        for token, (replica, slot) in enumerate(((1, 9), (0, 2), (1, 4), (0, 6))):
            for copy in range(target.copies):
                assert same_bits(target.pools[1][copy][layer][token], source.pools[replica][0][layer][slot])
