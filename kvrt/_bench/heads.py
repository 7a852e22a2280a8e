"""`kvrt bench heads`: prefill TP=1, decode TP=4 (CPU, TCP, 4 gloo ranks), each decode rank
pulling its quarter of the KV heads (`heads=`), beside four whole-item transfers.

One producer (this process) holds a request of 8 KV heads; four decode ranks (spawned, one
gloo group) pull it into their paged pools, in two ways measured in the same run, in turns:

* reference: each rank pulls a whole copy of the request (four items inserted, one a rank:
  what a decode rank could do before `heads=`), into a pool holding every head;
* heads: each rank pulls `heads=slice(2r, 2r + 2)` of one item into a pool of its 2 heads;
  the producer keeps the item until the fourth piece is confirmed.

Per request: the time from the ranks' start until all four are done (median over rounds),
and the bytes the producer sent per rank (its `delivered_bytes`), against the item's size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any, Final

import torch
import torch.distributed as dist

from kvrt._bench._processes import free_port, join

WORLD: Final = 4
KV_HEADS: Final = 8
HEAD_DIM: Final = 128
BLOCKS: Final = 4
"""The two ways take turns, a block of rounds each, so that the host's drift touches both."""

spawn = multiprocessing.get_context("spawn")


def _shape(quick: bool) -> tuple[int, int]:
    """(layers, tokens) of the request: 16 MiB of bf16 K and V (1 MiB quick)."""
    return (8, 512) if not quick else (4, 64)


def _tokens(tokens: int, index: int) -> torch.Tensor:
    return torch.arange(index * 100_000, index * 100_000 + tokens, dtype=torch.int64)


def _rank(rank: int, port: int, endpoint: str, quick: bool, rounds: int, start: Any, done: Any) -> None:
    import asyncio

    import kvrt
    from kvrt import Layout, PoolTable

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    layers, tokens = _shape(quick)
    per_rank = KV_HEADS // WORLD
    whole = PoolTable([[[torch.zeros((tokens, 2 * KV_HEADS, HEAD_DIM), dtype=torch.bfloat16)
                         for _ in range(layers)]]], Layout.TOKEN_MAJOR)  # fmt: skip
    mine = PoolTable([[[torch.zeros((tokens, 2 * per_rank, HEAD_DIM), dtype=torch.bfloat16)
                        for _ in range(layers)]]], Layout.TOKEN_MAJOR)  # fmt: skip
    slots = torch.arange(tokens)

    async def run() -> None:
        async with kvrt.Consumer(connect=endpoint, group=dist.group.WORLD, reply_timeout_s=30) as consumer:
            for index in range(2 * rounds * BLOCKS):
                heads = index % (2 * rounds) >= rounds  # each block: the reference's rounds, then the heads'
                await asyncio.to_thread(start.wait)
                own = slice(rank * per_rank, (rank + 1) * per_rank)
                if heads:
                    item = await consumer.pull(_tokens(tokens, index), into=mine, slots=slots, heads=own)
                else:
                    item = await consumer.pull(_tokens(tokens, index), into=whole, slots=slots)
                assert item is not None, f"rank {rank} missed request {index}"
                await asyncio.to_thread(done.wait)

    try:
        asyncio.run(run())
    finally:
        dist.destroy_process_group()


def main(args: argparse.Namespace) -> int:
    import kvrt.blocking

    quick = bool(args.quick)
    rounds = 3 if quick else 10
    layers, tokens = _shape(quick)
    start, done = spawn.Barrier(WORLD + 1, timeout=120), spawn.Barrier(WORLD + 1, timeout=120)
    generator = torch.Generator().manual_seed(0)
    key = torch.randn((layers, tokens, KV_HEADS, HEAD_DIM), generator=generator).to(torch.bfloat16)
    value = torch.randn(key.shape, generator=generator).to(torch.bfloat16)
    item_kv = key.nbytes + value.nbytes
    print(f"kvrt bench heads: TP=1 -> TP={WORLD}, {item_kv >> 20} MiB of K and V a request ...", file=sys.stderr)
    measured: dict[str, list[float]] = {"whole_s": [], "heads_s": [], "whole_bytes": [], "heads_bytes": []}
    with kvrt.blocking.Producer(buffer_bytes=8 * item_kv) as producer:
        port = free_port()
        ranks = [
            spawn.Process(target=_rank, args=(rank, port, producer.endpoint, quick, rounds, start, done))
            for rank in range(WORLD)
        ]
        for process in ranks:
            process.start()
        try:
            for index in range(2 * rounds * BLOCKS):
                heads = index % (2 * rounds) >= rounds
                for _ in range(1 if heads else WORLD):
                    producer.insert(_tokens(tokens, index), None, key, value)
                sent = producer.stats().totals.delivered_bytes
                start.wait()
                started = time.perf_counter()
                done.wait()
                elapsed = time.perf_counter() - started
                way = "heads" if heads else "whole"
                measured[f"{way}_s"].append(elapsed)
                measured[f"{way}_bytes"].append((producer.stats().totals.delivered_bytes - sent) / WORLD)
        except BaseException:
            for barrier in (start, done):
                barrier.abort()
            raise
        finally:
            join(*ranks)
    whole_s, heads_s = statistics.median(measured["whole_s"]), statistics.median(measured["heads_s"])
    whole_bytes, heads_bytes = statistics.median(measured["whole_bytes"]), statistics.median(measured["heads_bytes"])
    print(f"\nkvrt bench heads — TP=1 -> TP={WORLD} on this host, {item_kv / 2**20:.0f} MiB of K and V a request, "
          f"{rounds * BLOCKS} requests each way; per request (all {WORLD} ranks done)")  # fmt: skip
    print(f"{'way':<44} | {'per request':>11} | {'sent per rank':>13} | {'of the item':>11} | goal")
    print("-" * 100)
    rows = [
        ("four whole-item transfers (reference)", whole_s, whole_bytes, ""),
        (f"heads= pull, {KV_HEADS // WORLD} of {KV_HEADS} heads a rank", heads_s, heads_bytes, "≈ 1/4 of the item"),
    ]
    for name, seconds, sent_each, goal in rows:
        share = sent_each / item_kv
        print(f"{name:<44} | {seconds * 1e3:>8.2f} ms | {sent_each / 2**20:>9.2f} MiB | {share:>10.1%} | {goal}")
    print(f"heads= per request: {whole_s / heads_s:.2f}x faster than the reference; bytes per rank "
          f"{heads_bytes / whole_bytes:.1%} of it")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"item_kv_bytes": item_kv, "world": WORLD, **measured}, out, indent=2)
    return 0
