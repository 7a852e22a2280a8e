"""vLLM's paged KV cache as kvrt pools, read and written in place: no copy of the pages is
made for kvrt. This module does not import vLLM (the connector maps vLLM's cache spec onto a
`CacheSpec`), so every layout here is tested on hosts without vLLM.

What vLLM 0.32-0.33 allocates per attention layer (`vllm/v1/kv_cache_interface.py`,
`create_kv_cache_views`): a view `[blocks, heads, block_size, content]` of one raw buffer,
`content` being a token's key (head_size) then its value (head_size_v), in the physical order
vLLM's KV cache layout names (`VLLM_KV_CACHE_LAYOUT`): LBNHC ("NHD", the default), LBHNC
("HND"), LHBNC, and the cross-layer BLNHC, BLHNC, BHLNC. The content is always innermost.

    platform  attention backends                       kvrt's pools
    GPU       FLASH_ATTN, FLASHINFER, TRITON_ATTN,     `Layout.BHNC`, the views as vLLM made
              FLEX_ATTENTION; any layout, any block    them (each side addresses its own pages:
              size; dtypes of 1, 2 or 4 bytes, fp8     a producer and a consumer may differ in
              with per-tensor scales                   layout and block size)
    GPU       MLA backends (TRITON_MLA, FLASHMLA, ...) `Layout.MLA` in blocks [blocks, 1,
                                                       block_size, latent]
    CPU       CPU_ATTN (vec, vec16 kernels)            `Layout.BLOCK_HEAD_MAJOR`: per block and
                                                       head, the keys transposed, then the values

Refused at registration (`ConnectorConfigError`, naming what): keys and values of different
head sizes, quantization with scales stored in the pages (per token and head, packed 4-bit),
pages packed otherwise than one row per head and token, and vLLM's AMX CPU kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

import kvrt
from kvrt.integrations.vllm._config import ConnectorConfigError

READABLE_CPU_KERNELS: Final = ("vec", "vec16")
"""vLLM's CPU attention kernels whose pages kvrt reads and writes (`Layout.BLOCK_HEAD_MAJOR`);
its AMX kernel (bfloat16 on an AMX host) packs keys otherwise."""


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """What kvrt needs of vLLM's KV cache spec to see its pages as pools."""

    block_size: int
    kv_heads: int
    """KV heads per rank (vLLM's num_kv_heads of the rank)."""
    head_size: int
    head_size_v: int
    """The value's head size: head_size for attention, 0 for MLA's one latent per token."""
    dtype: torch.dtype
    cpu_kernel: str | None = None
    """vLLM's CPU attention kernel for these pages (its CPU backend only: how it lays keys
    out); None for the GPU backends' pages, wherever they are."""
    first_head: int = 0
    """The first of the model's KV heads this rank holds (tensor parallel)."""
    kv_quant_mode: str = "NONE"
    """vLLM's `KVQuantMode` by name: NONE and FP8_PER_TENSOR keep no scales in the pages."""
    packed: bool = False
    """The pages hold something else than one row per head and token (vLLM's
    `num_head_slots`, `state_content_bytes`, `tokens_per_state`)."""


MOVABLE_QUANT_MODES: Final = ("NONE", "FP8_PER_TENSOR")
"""Quantization whose pages hold only the K and V bytes (the scales are the model's, the same on
both sides)."""


def kv_cache_pools(caches: Sequence[torch.Tensor], spec: CacheSpec) -> kvrt.PoolTable:
    """One pool per layer of vLLM's KV cache, in layer order, viewed in place; a layout kvrt
    does not read is refused with `ConnectorConfigError` naming it."""
    if not caches:
        raise ConnectorConfigError("vLLM registered no KV cache layers")
    if spec.kv_quant_mode not in MOVABLE_QUANT_MODES:
        raise ConnectorConfigError(
            f"vLLM's {spec.kv_quant_mode} KV cache keeps scales in its pages: KvrtConnector moves caches of "
            f"{' or '.join(MOVABLE_QUANT_MODES)} quantization (kv_cache_dtype auto, fp8, fp8_e4m3, fp8_e5m2)"
        )
    if spec.packed:
        raise ConnectorConfigError(
            "vLLM packs these KV pages otherwise than one row per head and token (num_head_slots, "
            "state_content_bytes or tokens_per_state): KvrtConnector does not move them"
        )
    if spec.cpu_kernel is not None:  # vLLM's CPU backend: its kernels lay keys out their own way
        pools = [_cpu_pool(cache, spec) for cache in caches]
        return kvrt.PoolTable([[pools]], kvrt.Layout.BLOCK_HEAD_MAJOR, heads=_heads(spec))
    if spec.head_size_v == 0:
        for cache in caches:
            _check_rows(cache, spec, heads=1, content=spec.head_size, what="MLA cache [blocks, 1, block_size, latent]")
        return kvrt.PoolTable([[list(caches)]], kvrt.Layout.MLA)
    if spec.head_size_v != spec.head_size:
        raise ConnectorConfigError(
            f"keys of head size {spec.head_size} and values of {spec.head_size_v}: KvrtConnector moves caches whose "
            "keys and values have one head size"
        )
    for cache in caches:
        _check_rows(
            cache, spec, heads=spec.kv_heads, content=2 * spec.head_size,
            what="KV cache [blocks, kv_heads, block_size, 2*head_size]",
        )  # fmt: skip
    return kvrt.PoolTable([[list(caches)]], kvrt.Layout.BHNC, heads=_heads(spec))


def _check_rows(cache: torch.Tensor, spec: CacheSpec, *, heads: int, content: int, what: str) -> None:
    """One layer of vLLM's GPU cache as vLLM >= 0.32 views it: [blocks, heads, block_size,
    content], the content contiguous (any strides besides). Where a backend splits each block
    into kernel blocks the view has as many more blocks of fewer tokens: a slot (block id *
    block_size + offset) names the same token in either."""
    if (
        cache.dim() != 4
        or cache.shape[1] != heads
        or spec.block_size % cache.shape[2]
        or cache.shape[3] != content
        or cache.stride(3) != 1
        or cache.dtype != spec.dtype
    ):
        raise ConnectorConfigError(
            f"KvrtConnector reads vLLM's {what} = [*, {heads}, {spec.block_size} (or a divisor), {content}] of "
            f"{spec.dtype}, each "
            f"row contiguous; got {tuple(cache.shape)} strides {cache.stride()} of {cache.dtype} on {cache.device}"
        )


def _heads(spec: CacheSpec) -> slice:
    return slice(spec.first_head, spec.first_head + spec.kv_heads)


def _cpu_pool(cache: torch.Tensor, spec: CacheSpec) -> torch.Tensor:
    """One layer of vLLM's CPU KV cache as kvrt's head-major block pool. vLLM's CPU backend
    (`vllm/v1/attention/backends/cpu_attn.py`) allocates [blocks, heads, block_size,
    2 * head_dim] and cuts each block and head in two halves: the keys, which its vec and
    vec16 kernels keep transposed ([head_dim, block_size]), then the values ([block_size,
    head_dim]). kvrt's view is [blocks, heads, 2, block_size, head_dim], the same memory."""
    if (
        cache.dim() != 4
        or cache.shape[1] != spec.kv_heads
        or cache.shape[2] != spec.block_size
        or cache.shape[3] != 2 * spec.head_size
        or spec.head_size_v != spec.head_size
        or not cache.is_contiguous()
    ):
        raise ConnectorConfigError(
            f"KvrtConnector reads vLLM's CPU KV cache [blocks, heads={spec.kv_heads}, block_size={spec.block_size}, "
            f"2*head_dim={2 * spec.head_size}]; got {tuple(cache.shape)} on {cache.device}"
        )
    if spec.cpu_kernel not in READABLE_CPU_KERNELS:
        raise ConnectorConfigError(
            f"vLLM's {spec.cpu_kernel!r} CPU attention kernel lays out {cache.dtype} pages in a way kvrt does not "
            f"read: KvrtConnector reads those of its {' and '.join(READABLE_CPU_KERNELS)} kernels (dtype float32 or "
            "float16)"
        )
    blocks, heads, block_size, two_dims = cache.shape
    return cache.view(blocks, heads, 2, block_size, two_dims // 2)
