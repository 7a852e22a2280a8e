"""vLLM's KV caches as vLLM builds them, without vLLM: the tensors of `tests/data/vllm_kv_cache_layouts.json`
(made by vLLM's own code, `tests/vllm/layout_table.py`) on any device, and the connector's worker
side moving a request between two of them, layer by layer, as vLLM's workers drive it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvrt.integrations.vllm._config import DEFAULT_ITEM_TTL_S
from kvrt.integrations.vllm._scheduler import Load, Save, slots_of
from kvrt.integrations.vllm._tp import heads_of
from kvrt.integrations.vllm._worker import WorkerSettings, WorkerSide
from kvrt.integrations.vllm.layouts import CacheSpec, kv_cache_pools

TABLE = json.loads((Path(__file__).parent / "data" / "vllm_kv_cache_layouts.json").read_text())
CACHES: list[dict[str, Any]] = TABLE["caches"]


def cache_named(
    backend: str, layout: str, *, block_size: int = 16, dtype: str = "bfloat16", kv_heads: int | None = None
) -> dict[str, Any]:
    """The table's entry of that backend, layout, block size, dtype (and KV heads a rank)."""
    wanted = (backend, layout, block_size, dtype)
    for entry in CACHES:
        found = (entry["backend"], entry["layout"], entry["block_size"], entry["dtype"])
        if found == wanted and (kv_heads is None or entry["kv_heads"] == kv_heads):
            return entry
    raise KeyError((backend, layout, block_size, dtype, kv_heads))


def cache_id(entry: dict[str, Any]) -> str:
    return f"{entry['backend']}-{entry['layout']}-{entry['dtype']}-{entry['block_size']}-{entry['kv_heads']}h"


def build_cache(entry: dict[str, Any], device: torch.device | str, *, seed: int) -> list[torch.Tensor]:
    """Per layer, the view vLLM's worker makes of its cache (shape, strides and offset from the
    table) over one allocation of random bytes."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (entry["buffer_bytes"],), dtype=torch.uint8, generator=generator).to(device)
    dtype = getattr(torch, entry["dtype"])
    elements = raw.view(dtype)
    return [torch.as_strided(elements, shape, stride, offset) for shape, stride, offset in entry["views"]]


def spec_of(entry: dict[str, Any], *, first_head: int = 0) -> CacheSpec:
    return CacheSpec(
        block_size=entry["block_size"], kv_heads=entry["kv_heads"], head_size=entry["head_size"],
        head_size_v=entry["head_size_v"], dtype=getattr(torch, entry["dtype"]), first_head=first_head,
        kv_quant_mode=entry["kv_quant_mode"],
    )  # fmt: skip


def token_rows(entry: dict[str, Any], caches: Sequence[torch.Tensor], slots: Sequence[int]) -> torch.Tensor:
    """What the caches hold for these slots, read as vLLM reads them: [layers, tokens, heads,
    content] (content: K then V, or the latent), as bytes."""
    size = entry["block_size"]
    rows = [torch.stack([cache[slot // size, :, slot % size, :] for slot in slots]) for cache in caches]
    return torch.stack(rows).cpu().contiguous().view(torch.uint8)


def settings(
    *, produces: bool, rank: int = 0, tp: int = 1, total_heads: int, mla: bool, bind: str | None = None,
    transport: str | None = None, layers_as_computed: bool | None = None, buffer_bytes: int = 1 << 34,
) -> WorkerSettings:  # fmt: skip
    return WorkerSettings(
        produces=produces, consumes=not produces, bind=bind, buffer_bytes=buffer_bytes, item_ttl_s=DEFAULT_ITEM_TTL_S,
        connect_timeout_s=10.0, rank=rank, tp=tp, total_heads=total_heads, mla=mla, transport=transport,
        layers_as_computed=layers_as_computed,
    )  # fmt: skip


def worker(
    entry: dict[str, Any], device: torch.device | str, *, produces: bool, rank: int = 0, tp: int = 1,
    total_heads: int | None = None, seed: int, transport: str | None = None, layers_as_computed: bool | None = None,
    buffer_bytes: int = 1 << 34,
) -> tuple[WorkerSide, list[torch.Tensor]]:  # fmt: skip
    """A worker side of one rank over a cache of `entry` (its heads being rank `rank`'s of `tp`
    when `total_heads` says the model has more than the entry's), registered
    (`layers_as_computed`, `buffer_bytes`: as `WorkerSettings`)."""
    mla = bool(entry["mla"])
    heads = total_heads or entry["kv_heads"]
    side = WorkerSide(settings(produces=produces, rank=rank, tp=tp, total_heads=heads, mla=mla,
                               bind="tcp://127.0.0.1:0" if produces else None, transport=transport,
                               layers_as_computed=layers_as_computed, buffer_bytes=buffer_bytes))  # fmt: skip
    caches = build_cache(entry, device, seed=seed)
    first = 0 if mla else heads_of(rank, tp, heads).start
    side.register(kv_cache_pools(caches, spec_of(entry, first_head=first)))
    return side, caches


def publish(
    prefills: Sequence[WorkerSide], tokens: list[int], block_ids: list[int], block_size: int, layers: int
) -> None:
    """What the prefill ranks do in the step that completes the prompt: each layer published
    from the pages as the forward pass writes it, then the step ends."""
    save = Save("request", tokens, slots_of(block_ids, block_size, 0, len(tokens)))
    for layer in range(layers):
        for side in prefills:
            side.save_layer([save], layer)
    for side in prefills:
        side.end_step()


def load(
    decodes: Sequence[WorkerSide], endpoints: list[str], tokens: list[int], block_ids: list[int], block_size: int,
    layers: int, *, skip: int = 0, published: bool = False,
) -> list[set[str]]:  # fmt: skip
    """What the decode ranks do in the step that loads the prompt: every rank opens its load
    (fetched, when the prefill's word planned it: `published`; else a stream), each attention
    layer waits for its own layer, the step ends. Each rank's failed loads."""
    first_block, end_block = skip // block_size, -(-len(tokens) // block_size)
    request = Load(
        "request", tuple(endpoints), tokens, skip, slots_of(block_ids, block_size, skip, len(tokens)),
        block_ids[first_block:end_block], published=published,
    )
    for side in decodes:
        side.start_loads([request])
    for layer in range(layers):
        for side in decodes:
            side.wait_layer(layer)
    return [side.end_step().failed for side in decodes]


def endpoints_of(prefills: Sequence[WorkerSide]) -> list[str]:
    return [side.endpoint or "tcp://127.0.0.1:1" for side in prefills]


def with_settings(side: WorkerSide, **changes: Any) -> WorkerSettings:
    return replace(side.settings, **changes)
