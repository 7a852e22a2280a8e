"""`kvrt bench kernels`: the paged-KV gather and scatter beside a device copy of the same bytes.

One GPU. A request of 4096 tokens x 32 layers, 8 KV heads of 128 in bf16 (token-major pools
[slots, 16, 128], 8192 slots a replica): 512 MiB of KV. Its tokens are spread at random over
4 replicas (dp=4) or sit in one (dp=1). References, in the same run: `dst.copy_(src)` of
512 MiB (the ceiling), and torch's `index_select` / `index_copy_` per layer (dp=1: torch has
no pointer-table form). GB/s count bytes read plus bytes written. Median of
`triton.testing.do_bench`.

Then `put_layer`'s copy: one layer's K and V of an 8B model at 8k tokens (32 MiB) out of the
columns of a wider projection output, as a prefill hands them over, by torch (two `copy_`)
and by `kvrt.kernels.layer_copy` (one launch), beside a device copy of 32 MiB.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch

from kvrt._bench import _plot

LAYERS: Final = 32
TOKENS: Final = 4096
HEADS: Final = 8
HEAD_DIM: Final = 128
SLOTS: Final = 8192
REPLICAS: Final = 4


def _gbps(moved_bytes: int, milliseconds: float) -> float:
    return moved_bytes / (milliseconds * 1e-3) / 1e9


def main(args: argparse.Namespace) -> int:
    import triton.testing

    from kvrt.kernels.paged_kv import Layout, PoolTable, Tuning, check_indices, gather, scatter

    if not torch.cuda.is_available():
        print("kvrt bench kernels needs a CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    generator = torch.Generator(device=device).manual_seed(0)

    def pool() -> torch.Tensor:
        return torch.randn((SLOTS, 2 * HEADS, HEAD_DIM), generator=generator, device=device).to(torch.bfloat16)

    pools = [[[pool() for _ in range(LAYERS)]] for _ in range(REPLICAS)]
    table = PoolTable(pools, Layout.TOKEN_MAJOR)
    one = PoolTable(pools[:1], Layout.TOKEN_MAJOR)
    replica = torch.randint(0, REPLICAS, (TOKENS,), device=device)
    slots = torch.randperm(SLOTS, device=device)[:TOKENS]
    local = torch.zeros(TOKENS, dtype=torch.int64, device=device)
    staging = torch.empty(table.staging_shape(TOKENS, (0, HEADS)), dtype=torch.bfloat16, device=device)
    moved = 2 * staging.nbytes  # read once, written once
    source = torch.empty_like(staging)

    def index_select() -> None:
        for layer in range(LAYERS):
            torch.index_select(pools[0][0][layer], 0, slots, out=staging[layer].view(TOKENS, 2 * HEADS, HEAD_DIM))

    def index_copy() -> None:
        for layer in range(LAYERS):
            pools[0][0][layer].index_copy_(0, slots, staging[layer].view(TOKENS, 2 * HEADS, HEAD_DIM))

    # The kernels are timed with the indexes checked once beforehand (`check=False`), as the
    # runtime launches them: the check reads a flag back from the GPU, so a timed loop that
    # checks on every call measures that round trip too (shown in its own rows).
    check_indices(table, replica, slots)
    check_indices(one, local, slots)
    variants: list[tuple[str, Callable[[], object], str]] = [
        ("device copy of the same bytes (ceiling)", lambda: staging.copy_(source), ""),
        ("torch index_select per layer, dp=1", index_select, ""),
        ("kvrt gather, dp=1", lambda: gather(one, local, slots, out=staging, check=False), ">= 95% of copy"),
        ("kvrt gather, dp=4", lambda: gather(table, replica, slots, out=staging, check=False), ">= 95% of copy"),
        ("torch index_copy_ per layer, dp=1", index_copy, ""),
        ("kvrt scatter, dp=1", lambda: scatter(one, staging, local, slots, check=False), ">= 95% of copy"),
        ("kvrt scatter, dp=4", lambda: scatter(table, staging, replica, slots, check=False), ">= 95% of copy"),
        ("kvrt gather, dp=4, indexes checked per call", lambda: gather(table, replica, slots, out=staging), ""),
        ("kvrt scatter, dp=4, indexes checked per call", lambda: scatter(table, staging, replica, slots), ""),
    ]
    results = []
    for name, run, goal in variants:
        milliseconds = triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median")
        results.append({"variant": name, "ms": milliseconds, "gbps": _gbps(moved, milliseconds), "goal": goal})
    ceiling = results[0]["gbps"]
    print(f"\nkvrt bench kernels — {torch.cuda.get_device_name(device)}, {staging.nbytes >> 20} MiB of KV "
          f"({TOKENS} tokens x {LAYERS} layers x {HEADS} heads x {HEAD_DIM}, bf16), read + write")  # fmt: skip
    width = max(len(str(row["variant"])) for row in results)
    print(f"{'variant':<{width}} | {'ms':>7} | {'GB/s':>7} | {'of copy':>7} | goal")
    for row in results:
        share = 100 * float(row["gbps"]) / float(ceiling)
        print(f"{row['variant']!s:<{width}} | {row['ms']:7.3f} | {row['gbps']:7.0f} | {share:6.1f}% | {row['goal']}")
    sweep: list[dict[str, Any]] = []
    for block_words in (256, 2048):
        for warps in (2, 4, 8):
            tuning = Tuning(block_words, warps)
            gather_ms = triton.testing.do_bench(
                lambda tuning=tuning: gather(table, replica, slots, out=staging, check=False, tuning=tuning),
                warmup=25, rep=100, return_mode="median",
            )  # fmt: skip
            scatter_ms = triton.testing.do_bench(
                lambda tuning=tuning: scatter(table, staging, replica, slots, check=False, tuning=tuning),
                warmup=25, rep=100, return_mode="median",
            )  # fmt: skip
            sweep.append({"tuning": [block_words, warps], "gather_gbps": _gbps(moved, gather_ms),
                          "scatter_gbps": _gbps(moved, scatter_ms)})  # fmt: skip
    sweep.sort(key=lambda row: -(float(row["gather_gbps"]) + float(row["scatter_gbps"])))
    print("launch shapes, dp=4 (words per step, warps per program), best first:")
    for row in sweep:
        print(f"  {row['tuning']}: gather {100 * float(row['gather_gbps']) / float(ceiling):5.1f}%, "
              f"scatter {100 * float(row['scatter_gbps']) / float(ceiling):5.1f}% of copy")  # fmt: skip
    layer_copy = _layer_copy_rows(device)
    print("put_layer's copy, one layer's K and V (32 MiB) out of a [8192 x 53248] bf16 output:")
    for row in layer_copy:
        print(f"  {row['variant']:<34} {row['ms'] * 1e3:7.1f} us  {row['gbps']:6.0f} GB/s")
    if args.plot:
        path = _plot.bars(
            Path(args.plot) / "kernels.png", "Paged-KV gather/scatter, 512 MiB (read + write)", "GB/s",
            {str(row["variant"]): float(row["gbps"]) for row in results},
        )  # fmt: skip
        print(f"plot: {path}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"rows": results, "sweep": sweep, "staging_bytes": staging.nbytes, "layer_copy": layer_copy}, out,
                indent=2,
            )  # fmt: skip
    return 0


def _layer_copy_rows(device: torch.device) -> list[dict[str, Any]]:
    import triton.testing

    from kvrt.kernels.layer_copy import copy_layer

    tokens, row = 8192, HEADS * HEAD_DIM
    out = torch.randn((tokens, 53248), device=device).to(torch.bfloat16)
    key = out[:, :row].view(tokens, HEADS, HEAD_DIM)
    value = out[:, row : 2 * row].view(tokens, HEADS, HEAD_DIM)
    block = torch.empty((2, tokens, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)
    source = torch.empty_like(block)

    def torch_copies() -> None:
        block[0].copy_(key)
        block[1].copy_(value)

    rows = []
    for name, run in (
        ("device copy of 32 MiB (ceiling)", lambda: block.copy_(source)),
        ("torch copy_ of K, then of V", torch_copies),
        ("kvrt copy_layer (one launch)", lambda: copy_layer(block, key, value)),
    ):
        milliseconds = triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median")
        rows.append({"variant": name, "ms": milliseconds, "gbps": _gbps(2 * block.nbytes, milliseconds)})
    return rows
