"""kvrt reads and writes vLLM's CPU KV cache as vLLM's own kernel writes it
(`Layout.BLOCK_HEAD_MAJOR`), for every dtype and head size whose kernel lays keys out so."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvrt import Layout, PoolTable
from kvrt.integrations.vllm import ConnectorConfigError
from kvrt.integrations.vllm.layouts import CacheSpec, kv_cache_pools
from kvrt.kernels.paged_kv import gather_layer_reference, scatter_layer_reference
from tests._checks import same_bits

BLOCKS, HEADS, BLOCK_SIZE, TOKENS = 3, 2, 32, 40


def vllm_cache(dtype: torch.dtype, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """One layer of vLLM's CPU cache with TOKENS random tokens written by vLLM's kernel at random
    slots: the cache, the keys, the values, the slots and the kernel's ISA."""
    generator = torch.Generator().manual_seed(head_dim)
    isa = _get_attn_isa(dtype, BLOCK_SIZE, head_dim)
    cache = torch.zeros((BLOCKS, HEADS, BLOCK_SIZE, 2 * head_dim), dtype=dtype)
    key_cache, value_cache = cache.view(BLOCKS, HEADS, 2 * BLOCK_SIZE, head_dim).chunk(2, dim=2)
    key, value = (torch.randn((TOKENS, HEADS, head_dim), generator=generator).to(dtype) for _ in range(2))
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=generator)[:TOKENS]
    ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    return cache, key, value, slots, isa


CASES = [(dtype, head_dim) for dtype in (torch.float32, torch.float16, torch.bfloat16) for head_dim in (64, 80, 128)]


@pytest.mark.parametrize(("dtype", "head_dim"), CASES, ids=lambda case: str(case).replace("torch.", ""))
def test_kvrt_reads_each_slot_of_vllms_cpu_cache_as_vllms_kernel_wrote_it(dtype: torch.dtype, head_dim: int) -> None:
    cache, key, value, slots, isa = vllm_cache(dtype, head_dim)
    if isa not in ("vec", "vec16"):
        pytest.skip(f"vLLM's {isa} kernel packs keys otherwise: KvrtConnector refuses it")
    table = PoolTable([[[cache.view(BLOCKS, HEADS, 2, BLOCK_SIZE, head_dim)]]], Layout.BLOCK_HEAD_MAJOR)
    read_key, read_value = gather_layer_reference(table, torch.zeros_like(slots), slots, 0)
    assert same_bits(read_key, key) and same_bits(read_value, value)


@pytest.mark.parametrize(("dtype", "head_dim"), CASES, ids=lambda case: str(case).replace("torch.", ""))
def test_pages_kvrt_writes_are_the_pages_vllms_kernel_writes(dtype: torch.dtype, head_dim: int) -> None:
    cache, key, value, slots, isa = vllm_cache(dtype, head_dim)
    if isa not in ("vec", "vec16"):
        pytest.skip(f"vLLM's {isa} kernel packs keys otherwise: KvrtConnector refuses it")
    written = torch.zeros_like(cache)
    table = PoolTable([[[written.view(BLOCKS, HEADS, 2, BLOCK_SIZE, head_dim)]]], Layout.BLOCK_HEAD_MAJOR)
    scatter_layer_reference(table, key, value, torch.zeros_like(slots), slots, 0)
    assert same_bits(written, cache)


def spec(dtype: torch.dtype, head_dim: int, isa: str) -> CacheSpec:
    return CacheSpec(
        block_size=BLOCK_SIZE, kv_heads=HEADS, head_size=head_dim, head_size_v=head_dim, dtype=dtype, cpu_kernel=isa
    )


def test_the_connector_refuses_pages_that_vllms_amx_kernel_lays_out() -> None:
    cache = torch.zeros((BLOCKS, HEADS, BLOCK_SIZE, 2 * 64), dtype=torch.bfloat16)
    with pytest.raises(ConnectorConfigError, match=r"'amx'.*float32 or float16"):
        kv_cache_pools([cache], spec(torch.bfloat16, 64, "amx"))


def test_the_connector_takes_the_pages_of_vllms_vec_kernel_as_kvrts_head_major_blocks() -> None:
    cache, key, value, slots, isa = vllm_cache(torch.float32, 64)
    table = kv_cache_pools([cache], spec(torch.float32, 64, isa))
    assert table.layout is Layout.BLOCK_HEAD_MAJOR
    read_key, read_value = gather_layer_reference(table, torch.zeros_like(slots), slots, 0)
    assert same_bits(read_key, key) and same_bits(read_value, value)
