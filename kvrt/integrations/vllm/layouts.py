"""vLLM's paged KV cache as kvrt pools, read and written in place: no copy of the pages is
made for kvrt. This module does not import vLLM (the connector maps vLLM's cache spec onto a
`CacheSpec`), so every layout here is tested on hosts without vLLM.

What vLLM 0.32-0.33 allocates per attention layer (`vllm/v1/kv_cache_interface.py`,
`create_kv_cache_views`): a view `[blocks, heads, block_size, content]` of one raw buffer,
`content` being a token's key (head_size) then its value (head_size_v), in the physical order
vLLM's KV cache layout names (`VLLM_KV_CACHE_LAYOUT`): LBNHC ("NHD", the default), LBHNC
("HND"), LHBNC, and the cross-layer BLNHC, BLHNC, BHLNC. The content is always innermost.

    platform  attention backends                       kvrt's pools
    CPU       CPU_ATTN (vec, vec16 kernels)            `Layout.BLOCK_HEAD_MAJOR`: per block and
                                                       head, the keys transposed, then the values
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
    """vLLM's CPU attention kernel for these pages (CPU only): how it lays keys out."""
    first_head: int = 0
    """The first of the model's KV heads this rank holds (tensor parallel)."""


def kv_cache_pools(caches: Sequence[torch.Tensor], spec: CacheSpec) -> kvrt.PoolTable:
    """One pool per layer of vLLM's KV cache, in layer order, viewed in place; a layout kvrt
    does not read is refused with `ConnectorConfigError` naming it."""
    if not caches:
        raise ConnectorConfigError("vLLM registered no KV cache layers")
    first = caches[0]
    if first.device.type == "cpu":
        pools = [_cpu_pool(cache, spec) for cache in caches]
        return kvrt.PoolTable([[pools]], kvrt.Layout.BLOCK_HEAD_MAJOR, heads=_heads(spec))
    raise ConnectorConfigError(
        f"KvrtConnector does not read vLLM's KV cache on {first.device} ({tuple(first.shape)}, {first.dtype})"
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
