"""`kvrt bench checksum`: what `Producer(checksum=True)` costs an item, beside its transfer.

For each item size: XXH3-64 over the item's bytes in host memory (what each side adds: the
producer at insert, the consumer before the hand-over), and the p50 of `drop_select` over TCP
loopback with checksums off and on, the two measured alternately in one run. Producer and
consumer share one process and one event loop, so a lookup's time is both sides' work in
series: the checksum's share of it is what it adds to a request's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
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
    if args.json:
        Path(args.json).write_text(json.dumps({"bench": "checksum", "rows": rows}, indent=2))
    return 0
