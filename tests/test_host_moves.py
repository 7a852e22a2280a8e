"""On a host without Triton's GPU, a request moves between its K, V and paged pools block by
block where its slots run through blocks in order, as a serving engine's pages do
(`kernels/paged_kv._block_runs`): every such move equals its plain-torch reference bit for bit,
writes nothing else, and slots that run otherwise still move (through the reference)."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt._pools import Layout, PoolTable
from kvrt.kernels.paged_kv import (
    _block_runs,
    gather_into_any,
    gather_layer_into_any,
    gather_reference,
    scatter_from_any,
    scatter_layer_from_any,
    scatter_reference,
)
from tests._checks import same_bits
from tests.test_kernels import same_pools

DTYPES = [torch.float16, torch.float32, torch.uint8]


def pools_of(layout: Layout, layers: int, blocks: int, block_size: int, heads: int, dim: int, copies: int,
             dtype: torch.dtype, generator: torch.Generator) -> PoolTable:  # fmt: skip
    """One replica's pools of `layout` holding random bytes."""

    def pool() -> torch.Tensor:
        if layout is Layout.BLOCK:
            shape: tuple[int, ...] = (2, blocks, block_size, heads, dim)
        elif layout is Layout.BLOCK_HEAD_MAJOR:
            shape = (blocks, heads, 2, block_size, dim)
        elif layout is Layout.BHNC:
            shape = (blocks, heads, block_size, 2 * dim)
        else:  # MLA in blocks
            shape = (blocks, 1, block_size, dim)
        raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), dtype=torch.uint8,
                            generator=generator)  # fmt: skip
        return raw.view(dtype).view(shape)

    return PoolTable([[[pool() for _ in range(layers)] for _ in range(copies)]], layout)


def copied(table: PoolTable) -> PoolTable:
    return PoolTable([[[pool.clone() for pool in layers] for layers in copies] for copies in table.pools], table.layout)


@st.composite
def requests(draw: st.DrawFn) -> dict[str, object]:
    layout = draw(st.sampled_from([Layout.BLOCK, Layout.BLOCK_HEAD_MAJOR, Layout.BHNC, Layout.MLA]))
    heads = 1 if layout is Layout.MLA else draw(st.integers(1, 4))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    blocks = draw(st.integers(2, 12))
    first = draw(st.integers(0, heads - 1))
    return {
        "layout": layout, "heads": heads, "dim": draw(st.sampled_from([2, 8, 64])), "block_size": block_size,
        "blocks": blocks, "layers": draw(st.integers(1, 3)), "copies": draw(st.integers(1, 2)) if layout is Layout.MLA
        else 1, "dtype": draw(st.sampled_from(DTYPES)), "seed": draw(st.integers(0, 2**16)),
        # a request's tokens in shuffled blocks, from `skip` on (a prefix the pools hold already)
        "skip": draw(st.integers(0, block_size * blocks - 1)), "tokens": draw(st.integers(1, block_size * blocks)),
        "head_range": (first, draw(st.integers(first + 1, heads))),
        "irregular": draw(st.booleans()),
    }  # fmt: skip


def request_of(case: dict[str, object]) -> tuple[PoolTable, torch.Tensor, torch.Tensor]:
    """The pools, and a request's replica and slot indexes as an engine lays a request out in
    its pages (or, `irregular`, shuffled token by token)."""
    generator = torch.Generator().manual_seed(case["seed"])  # type: ignore[arg-type]
    names = ("layers", "blocks", "block_size", "heads", "dim", "copies")
    layers, blocks, block_size, heads, dim, copies = (int(case[name]) for name in names)  # type: ignore[call-overload]
    table = pools_of(case["layout"], layers, blocks, block_size, heads, dim, copies, case["dtype"], generator)  # type: ignore[arg-type]
    order = random.Random(case["seed"]).sample(range(blocks), blocks)  # type: ignore[arg-type]
    skip, tokens = int(case["skip"]), int(case["tokens"])  # type: ignore[call-overload]
    end = min(skip + tokens, blocks * block_size)
    slots = [order[token // block_size] * block_size + token % block_size for token in range(skip, end)]
    if case["irregular"]:
        random.Random(case["seed"]).shuffle(slots)
    slot_tensor = torch.tensor(slots, dtype=torch.int64)
    return table, torch.zeros_like(slot_tensor), slot_tensor


def random_request(
    table: PoolTable, tokens: int, seed: int, heads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's K and V [layers, tokens, heads, head_dim] (the pools' heads, or `heads`)."""
    generator = torch.Generator().manual_seed(seed)
    g = table.geometry
    shape = (table.layers, tokens, g.heads if heads is None else heads, g.head_dim)
    raw = torch.randint(0, 256, (2, torch.Size(shape).numel() * table.dtype.itemsize), dtype=torch.uint8,
                        generator=generator)  # fmt: skip
    return raw[0].view(table.dtype).view(shape), raw[1].view(table.dtype).view(shape)


@settings(max_examples=120, deadline=None)
@given(case=requests())
def test_a_request_scattered_on_the_host_equals_the_reference_and_writes_nothing_else(case: dict[str, object]) -> None:
    table, replica, slots = request_of(case)
    expected = copied(table)
    first, end = case["head_range"]  # type: ignore[misc]
    heads = None if table.geometry.kv == 1 else (first, end)
    key, value = random_request(table, slots.numel(), case["seed"], None if heads is None else end - first)  # type: ignore[arg-type]
    scatter_from_any(table, key, value, replica, slots, heads=heads)
    parts = [key, value][: table.geometry.kv]
    scatter_reference(expected, torch.stack(parts, dim=2), replica, slots, heads=heads)
    assert same_pools(table, expected)


@settings(max_examples=120, deadline=None)
@given(case=requests())
def test_a_request_gathered_on_the_host_equals_the_reference(case: dict[str, object]) -> None:
    table, replica, slots = request_of(case)
    tokens = slots.numel()
    key, value = (torch.full_like(part, 0) for part in random_request(table, tokens + 2, 0))
    gather_into_any(table, replica, slots, key, value)
    reference = gather_reference(table, replica, slots)
    assert same_bits(key[:, :tokens], reference[:, :, 0])
    assert table.geometry.kv == 1 or same_bits(value[:, :tokens], reference[:, :, 1])


@settings(max_examples=80, deadline=None)
@given(case=requests(), pick=st.integers(0, 2))
def test_one_layer_moved_on_the_host_equals_that_layer_of_the_references(case: dict[str, object], pick: int) -> None:
    table, replica, slots = request_of(case)
    expected = copied(table)
    layer, tokens = pick % table.layers, slots.numel()
    key, value = random_request(table, tokens, case["seed"])  # type: ignore[arg-type]
    scatter_layer_from_any(table, key[layer], value[layer], replica, slots, layer)
    that_layer = PoolTable([[[layers[layer]] for layers in copies] for copies in expected.pools], expected.layout)
    parts = [key[layer : layer + 1], value[layer : layer + 1]][: table.geometry.kv]
    scatter_reference(that_layer, torch.stack(parts, dim=2), replica, slots)
    assert same_pools(table, expected)
    gathered_key, gathered_value = (torch.zeros_like(part[0]) for part in (key, value))
    gather_layer_into_any(table, replica, slots, layer, gathered_key, gathered_value)
    assert same_bits(gathered_key, key[layer])
    assert table.geometry.kv == 1 or same_bits(gathered_value, value[layer])


def test_a_serving_engines_request_moves_block_by_block_and_a_shuffled_one_does_not() -> None:
    table = pools_of(Layout.BHNC, 1, 8, 4, 2, 8, 1, torch.float16, torch.Generator().manual_seed(0))
    in_pages = torch.tensor([20, 21, 22, 23, 4, 5, 6, 7, 12, 13], dtype=torch.int64)
    runs = _block_runs(table, torch.zeros_like(in_pages), in_pages)
    assert runs is not None and runs.full.tolist() == [5, 1] and runs.partial == [(8, 3, 0, 2)] and runs.in_order
    shuffled = torch.tensor(random.Random(0).sample(range(32), 20), dtype=torch.int64)
    assert _block_runs(table, torch.zeros_like(shuffled), shuffled) is None


def test_a_request_in_pages_with_an_index_outside_the_pools_is_refused_and_moves_nothing() -> None:
    # A move by runs checks no index apart (its runs are made of indexes in range only): a
    # serving engine's pages with one slot past the pools, or a replica the pools do not
    # have, are refused as the reference path refuses them, before anything is written.
    import pytest

    import kvrt

    table = pools_of(Layout.BLOCK_HEAD_MAJOR, 2, 8, 4, 2, 8, 1, torch.float32, torch.Generator().manual_seed(1))
    before = copied(table)
    key, value = torch.zeros(2, 10, 2, 8), torch.zeros(2, 10, 2, 8)
    in_pages = torch.tensor([20, 21, 22, 23, 4, 5, 6, 7, 12, 13], dtype=torch.int64)
    zeros = torch.zeros_like(in_pages)
    for slots, replica in ((in_pages.clone().index_fill_(0, torch.tensor([9]), 32), zeros),
                           (in_pages.clone().index_fill_(0, torch.tensor([0]), -1), zeros),
                           (in_pages, zeros.clone().index_fill_(0, torch.tensor([3]), 1))):  # fmt: skip
        with pytest.raises(kvrt.InvalidInputError, match="out of range"):
            gather_into_any(table, replica, slots, key, value)
        with pytest.raises(kvrt.InvalidInputError, match="out of range"):
            scatter_from_any(table, key, value, replica, slots)
    assert not key.any() and not value.any()
    assert same_pools(table, before)
