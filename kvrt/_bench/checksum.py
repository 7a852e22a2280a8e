"""`kvrt bench checksum`: what `Producer(checksum=True)` costs an item, beside its transfer.

For each item size: XXH3-64 over the item's bytes in host memory (what each side adds: the
producer at insert, the consumer before the hand-over), and the p50 of `drop_select` over TCP
loopback with checksums off and on, the two measured alternately in one run. Producer and
consumer share one process and one event loop, so a lookup's time is both sides' work in
series: the checksum's share of it is what it adds to a request's CPU.

Where a CUDA device is visible, then the GPU checksum (`kvrt.kernels.checksum`) of 16 MiB,
256 MiB and 1 GiB on the device: the kernel's GB/s beside `torch.sum` of the same bytes viewed
as int64 (the same bytes read, one reduction), and their ratio against the goal; `checksum()`
with its read-back too; then a sweep of launch shapes at the largest size. Median of
`triton.testing.do_bench` (which empties the L2 cache before each run).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch

from kvrt._checksum import payload_checksum
from kvrt._tensors import tensor_bytes

SIZES_MIB: Final = (1, 16, 64)
QUICK_SIZES_MIB: Final = (1, 16)
REQUESTS: Final = 20
"""Timed lookups per size and setting (after one untimed)."""
ROUNDS: Final = 3
"""Off and on alternate this many times per size; the p50 is over every round's lookups."""
GPU_SIZES_MIB: Final = (16, 256, 1024)
QUICK_GPU_SIZES_MIB: Final = (16, 256)
GPU_GOAL: Final = 0.90
"""The kernel's GB/s over `torch.sum`'s of the same bytes, at 1 GiB on an H200."""
SWEEP_BLOCK_WORDS: Final = (1024, 2048, 4096)
SWEEP_TILES: Final = (4, 8, 16)
SWEEP_WARPS: Final = (4, 8)


def _hash_us(nbytes: int, repeats: int) -> float:
    payload = tensor_bytes(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
    payload_checksum(payload)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        payload_checksum(payload)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


async def _lookups_ms(nbytes: int, checksum: bool, requests: int) -> list[float]:
    import kvrt

    key = torch.randn(1, 64, 1, nbytes // 2 // 4 // 64)
    times = []
    async with kvrt.Producer(checksum=checksum, buffer_bytes=4 * nbytes + (64 << 20)) as producer:
        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            for index in range(requests + 1):
                tokens = torch.arange(64) + index * 1000
                await producer.insert(tokens, None, key, key)
                started = time.perf_counter()
                item = await consumer.drop_select(tokens)
                took = time.perf_counter() - started
                assert item is not None
                if index:
                    times.append(took * 1e3)
    return times


def main(args: argparse.Namespace) -> int:
    sizes = QUICK_SIZES_MIB if args.quick else SIZES_MIB
    requests = REQUESTS // 2 if args.quick else REQUESTS
    rows: list[dict[str, Any]] = []
    print("item | XXH3-64 of its bytes | drop_select p50, checksum off | on | on vs off")
    for mib in sizes:
        nbytes = mib << 20
        hashed_us = _hash_us(nbytes, repeats=max(5, 64 // mib))
        off: list[float] = []
        on: list[float] = []
        for _ in range(ROUNDS):
            off += asyncio.run(_lookups_ms(nbytes, False, requests))
            on += asyncio.run(_lookups_ms(nbytes, True, requests))
        off_ms, on_ms = statistics.median(off), statistics.median(on)
        row = {
            "item_bytes": nbytes, "hash_us": hashed_us, "hash_gb_s": nbytes / hashed_us / 1e3,
            "lookup_off_ms": off_ms, "lookup_on_ms": on_ms, "on_vs_off": on_ms / off_ms,
        }  # fmt: skip
        rows.append(row)
        print(
            f"{mib} MiB | {hashed_us:,.0f} µs ({row['hash_gb_s']:.1f} GB/s) a side | {off_ms:.2f} ms | "
            f"{on_ms:.2f} ms | {row['on_vs_off']:.2f}x (the checksum: {hashed_us / 1e3 / off_ms:.0%} of the "
            "lookup a side)"
        )
    report: dict[str, Any] = {"bench": "checksum", "rows": rows}
    if torch.cuda.is_available():
        report["gpu"] = _gpu_report(QUICK_GPU_SIZES_MIB if args.quick else GPU_SIZES_MIB)
    else:
        print("no CUDA device: the GPU checksum kernel is not measured")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _gbps(nbytes: int, milliseconds: float) -> float:
    return nbytes / (milliseconds * 1e-3) / 1e9


def _gpu_report(sizes_mib: tuple[int, ...]) -> dict[str, Any]:
    import triton.testing

    from kvrt.kernels.checksum import DEFAULT_TUNING, Tuning, checksum, checksum_reference, queue_checksum

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device)

    def median_ms(run: Callable[[], object]) -> float:
        milliseconds: float = triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median")
        return milliseconds

    print(f"\nGPU checksum kernel — {name}: GB/s of the bytes read, beside torch.sum of them as int64")
    print(f"size | kernel | torch.sum | kernel / torch.sum (goal >= {GPU_GOAL:.2f}) | checksum() with its read-back")
    rows: list[dict[str, Any]] = []
    data = torch.empty(0, device=device)
    for mib in sizes_mib:
        nbytes = mib << 20
        data = torch.randint(-(2**63), 2**63 - 1, (nbytes // 8,), dtype=torch.int64, device=device)
        if checksum(data, 1) != checksum_reference(data, 1):
            raise AssertionError(f"the kernel and its reference disagree on {mib} MiB")
        kernel_ms = median_ms(functools.partial(queue_checksum, data))
        sum_ms = median_ms(functools.partial(torch.sum, data))
        read_back_ms = median_ms(functools.partial(checksum, data))
        row = {
            "bytes": nbytes, "kernel_gb_s": _gbps(nbytes, kernel_ms), "torch_sum_gb_s": _gbps(nbytes, sum_ms),
            "with_read_back_gb_s": _gbps(nbytes, read_back_ms), "goal": GPU_GOAL,
        }  # fmt: skip
        row["ratio"] = row["kernel_gb_s"] / row["torch_sum_gb_s"]
        rows.append(row)
        print(
            f"{mib} MiB | {row['kernel_gb_s']:,.0f} GB/s | {row['torch_sum_gb_s']:,.0f} GB/s | {row['ratio']:.3f} "
            f"({'met' if row['ratio'] >= GPU_GOAL else 'missed'}) | {row['with_read_back_gb_s']:,.0f} GB/s"
        )
    largest = data
    expected = checksum(largest)
    sweep: list[dict[str, Any]] = []
    for block_words in SWEEP_BLOCK_WORDS:
        for tiles in SWEEP_TILES:
            for warps in SWEEP_WARPS:
                tuning = Tuning(block_words, tiles, warps, DEFAULT_TUNING.programs_per_sm)
                if checksum(largest, tuning=tuning) != expected:
                    raise AssertionError(f"{tuning} gives another checksum")
                milliseconds = median_ms(functools.partial(queue_checksum, largest, tuning=tuning))
                sweep.append({"tuning": [block_words, tiles, warps], "gb_s": _gbps(largest.nbytes, milliseconds)})
    sweep.sort(key=lambda row: -float(row["gb_s"]))
    print(f"launch shapes at {largest.nbytes >> 20} MiB (words per tile, tiles per program, warps), best first:")
    for entry in sweep[:6]:
        print(f"  {entry['tuning']}: {entry['gb_s']:,.0f} GB/s")
    return {"device": name, "rows": rows, "sweep": sweep, "default_tuning": dataclasses.asdict(DEFAULT_TUNING)}
