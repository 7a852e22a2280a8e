"""Which form of the paged-KV gather/scatter is fastest on this GPU: a one-off experiment.

`python tools/kernel_variants.py [OUT.json]` on one CUDA device. Token-major bf16 pools
(8192 slots x [16, 128], 32 layers, dp=4), 4096 tokens (512 MiB of K and V), three slot
patterns: random (any slot of any replica), runs of 16 consecutive slots (what a paged
allocator hands out in blocks), and one contiguous range. For each: a device copy of the
same bytes, torch `index_select` per layer (dp=1), the library's kernel, and candidate
kernels. Every candidate's output is compared with the reference first: a wrong kernel
prints no number.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import triton
import triton.language as tl
import triton.testing

from kvrt.kernels.paged_kv import Layout, PoolTable, Tuning, gather, gather_reference, scatter

LAYERS, TOKENS, HEADS, DIM, SLOTS, REPLICAS = 32, 4096, 8, 128, 8192, 4


@triton.jit(do_not_specialize=["tokens"])  # type: ignore[untyped-decorator]
def _row_kernel(  # type: ignore[no-untyped-def]
    addresses, replica, slots, stage, tokens, layers, token_stride, v_offset,
    stage_layer_stride, stage_token_stride,
    ROW: tl.constexpr, HINT: tl.constexpr, EVICT: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    """One program per (token, layer): K and V rows of one token, both loaded before either
    is stored. HINT: tell Triton the pool rows are 16-byte aligned (vector loads)."""
    token = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    r = tl.load(replica + token)
    slot = tl.load(slots + token)
    base = tl.load(addresses + r * layers + layer)
    row = slot * token_stride
    if HINT:
        base = tl.multiple_of(base, 16)
        row = tl.multiple_of(row, 16)
    pool = base.to(tl.pointer_type(stage.dtype.element_ty)) + row
    stage_row = stage + layer * stage_layer_stride + token.to(tl.int64) * stage_token_stride
    offsets = tl.arange(0, ROW)
    if GATHER:
        if EVICT:
            k = tl.load(pool + offsets, eviction_policy="evict_first")
            v = tl.load(pool + v_offset + offsets, eviction_policy="evict_first")
        else:
            k = tl.load(pool + offsets)
            v = tl.load(pool + v_offset + offsets)
        tl.store(stage_row + offsets, k)
        tl.store(stage_row + ROW + offsets, v)
    else:
        k = tl.load(stage_row + offsets)
        v = tl.load(stage_row + ROW + offsets)
        tl.store(pool + offsets, k)
        tl.store(pool + v_offset + offsets, v)


def _row_launch(table: PoolTable, staging: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor, *,
                word: torch.dtype, hint: bool, evict: bool, gather: bool, warps: int) -> None:  # fmt: skip
    size = word.itemsize // 2  # bf16 elements per word
    g = table.geometry
    stage = staging.view(-1).view(word)
    _row_kernel[(slots.numel(), table.layers)](
        table.addresses, replica, slots, stage, slots.numel(), table.layers,
        g.token_stride // size, g.v_offset // size,
        slots.numel() * 2 * g.heads * g.head_dim // size, 2 * g.heads * g.head_dim // size,
        ROW=g.heads * g.head_dim // size, HINT=hint, EVICT=evict, GATHER=gather, num_warps=warps,
    )  # fmt: skip


def _gbps(nbytes: int, ms: float) -> float:
    return 2 * nbytes / (ms * 1e-3) / 1e9


def main() -> int:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    pools = [
        [[torch.randn((SLOTS, 2 * HEADS, DIM), generator=generator, device=device).to(torch.bfloat16)
          for _ in range(LAYERS)]] for _ in range(REPLICAS)
    ]  # fmt: skip
    table = PoolTable(pools, Layout.TOKEN_MAJOR)
    staging = torch.empty(table.staging_shape(TOKENS, (0, HEADS)), dtype=torch.bfloat16, device=device)
    source = torch.empty_like(staging)
    blocks = torch.randperm(SLOTS // 16, device=device)[: TOKENS // 16]
    patterns = {
        "random": (torch.randint(0, REPLICAS, (TOKENS,), device=device), torch.randperm(SLOTS, device=device)[:TOKENS]),
        "runs of 16": (
            torch.randint(0, REPLICAS, (TOKENS // 16,), device=device).repeat_interleave(16),
            (blocks[:, None] * 16 + torch.arange(16, device=device)).flatten(),
        ),
        "contiguous": (torch.zeros(TOKENS, dtype=torch.int64, device=device), torch.arange(TOKENS, device=device)),
    }
    results: list[dict[str, Any]] = []

    def bench(pattern: str, name: str, run: Any, check: Any = None) -> None:
        if check is not None and not check():
            print(f"{pattern:>10} | {name:<44} | WRONG OUTPUT", flush=True)
            results.append({"pattern": pattern, "variant": name, "wrong": True})
            return
        ms = triton.testing.do_bench(run, warmup=25, rep=150, return_mode="median")
        gbps = _gbps(staging.nbytes, ms)
        results.append({"pattern": pattern, "variant": name, "ms": ms, "gbps": gbps})
        print(f"{pattern:>10} | {name:<44} | {ms:7.3f} ms | {gbps:6.0f} GB/s", flush=True)

    print(f"{torch.cuda.get_device_name(device)}, {staging.nbytes >> 20} MiB, triton {triton.__version__}")

    def one_pattern(pattern: str, replica: torch.Tensor, slots: torch.Tensor) -> None:
        expected = gather_reference(table, replica, slots)

        def gathered_right() -> bool:
            return bool(torch.equal(staging, expected))

        def index_select() -> None:
            for layer in range(LAYERS):
                torch.index_select(pools[0][0][layer], 0, slots, out=staging[layer].view(TOKENS, 2 * HEADS, DIM))

        bench(pattern, "device copy (ceiling)", lambda: staging.copy_(source))
        bench(pattern, "torch index_select per layer, dp=1", index_select)
        for tuning in (Tuning(), Tuning(256, 4), Tuning(2048, 8)):
            staging.zero_()
            gather(table, replica, slots, out=staging, tuning=tuning)
            name = f"library gather {tuning.block_words}/{tuning.warps}"
            bench(pattern, name, lambda t=tuning: gather(table, replica, slots, out=staging, tuning=t), gathered_right)
        bench(pattern, "library scatter", lambda: scatter(table, staging, replica, slots))
        for word in (torch.int64, torch.int32):
            for hint in (False, True):
                for evict in (False, True):
                    for warps in (2, 4, 8):
                        options: dict[str, Any] = dict(word=word, hint=hint, evict=evict, warps=warps)
                        name = f"row {str(word)[6:]} hint={int(hint)} evict={int(evict)} warps={warps}"
                        staging.zero_()
                        _row_launch(table, staging, replica, slots, gather=True, **options)
                        bench(pattern, "gather " + name,
                              lambda o=options: _row_launch(table, staging, replica, slots, gather=True, **o),
                              gathered_right)  # fmt: skip
                        if not evict:
                            bench(
                                pattern,
                                "scatter " + name,
                                lambda o=options: _row_launch(table, staging, replica, slots, gather=False, **o),
                            )

    for pattern, (replica, slots) in patterns.items():
        one_pattern(pattern, replica, slots)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
