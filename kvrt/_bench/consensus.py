"""`kvrt bench consensus`: TP-group agreement on 4 gloo ranks, beside `all_gather_object`.

Both agree on the same information per lookup (status and matched tokens), measured in the
same run on the same ranks:

* reference: `all_gather_object` of (status, matched) per lookup, then MIN on each rank,
  as the AIBrix code did before its PR (seed 000);
* bare: one `all_reduce(MIN)` of a 2-int tensor per lookup (the PR's approach, no kvrt):
  the floor for one lookup at a time;
* kvrt: `GroupConsensus.decide`, one lookup at a time, then 16 in flight per rank (lookups
  in flight together share a collective).

The figure is time per lookup on rank 0 (median over lookups one at a time; total over
count for lookups in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist

from kvrt._bench import _plot
from kvrt._bench._processes import free_port, join

WORLD: Final = 4
IN_FLIGHT: Final = 16
_WARMUP: Final = 10

spawn = multiprocessing.get_context("spawn")


def _outcome(index: int, rank: int) -> tuple[int, int]:
    """Synthetic per-rank outcome of lookup `index`: (status, matched tokens)."""
    return (0 if (index + rank) % 7 else 1), 100 + (index * 31 + rank * 17) % 900


def _time_all_gather_object(count: int) -> list[float]:
    rank = dist.get_rank()
    latencies = []
    for index in range(_WARMUP + count):
        started = time.perf_counter()
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, _outcome(index, rank))
        worst = max(status for status, _ in gathered)
        shortest = min(matched for _, matched in gathered)
        assert worst >= 0 and shortest >= 0
        if index >= _WARMUP:
            latencies.append(time.perf_counter() - started)
    return latencies


def _time_bare_all_reduce(count: int) -> list[float]:
    rank = dist.get_rank()
    latencies = []
    for index in range(_WARMUP + count):
        started = time.perf_counter()
        status, matched = _outcome(index, rank)
        tensor = torch.tensor([matched, -(status * WORLD + rank)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        tensor.tolist()
        if index >= _WARMUP:
            latencies.append(time.perf_counter() - started)
    return latencies


async def _time_kvrt(count: int, in_flight: int) -> tuple[list[float], float, int]:
    from kvrt._consensus import GroupConsensus, Outcome, Status

    rank = dist.get_rank()
    consensus = GroupConsensus(dist.group.WORLD)
    consensus.start()
    latencies: list[float] = []
    try:

        async def one(index: int) -> None:
            sequence = consensus.register()
            status, matched = _outcome(index, rank)
            started = time.perf_counter()
            await consensus.decide(sequence, Outcome(Status(status), matched))
            if index >= _WARMUP:
                latencies.append(time.perf_counter() - started)

        for index in range(_WARMUP):
            await one(index)
        rounds_before = consensus.rounds
        started = time.perf_counter()
        if in_flight == 1:
            for index in range(_WARMUP, _WARMUP + count):
                await one(index)
        else:
            for first in range(_WARMUP, _WARMUP + count, in_flight):
                await asyncio.gather(*(one(index) for index in range(first, min(_WARMUP + count, first + in_flight))))
        elapsed = time.perf_counter() - started
        return latencies, elapsed, consensus.rounds - rounds_before
    finally:
        await consensus.aclose()


def _rank(rank: int, port: int, count: int, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        reference = _time_all_gather_object(count)
        dist.barrier()
        bare = _time_bare_all_reduce(count)
        dist.barrier()
        one_latencies, _, one_rounds = asyncio.run(_time_kvrt(count, 1))
        dist.barrier()
        _, many_elapsed, many_rounds = asyncio.run(_time_kvrt(count, IN_FLIGHT))
        if rank == 0:
            results.put(
                {
                    "all_gather_object_s": statistics.median(reference),
                    "bare_all_reduce_s": statistics.median(bare),
                    "kvrt_one_s": statistics.median(one_latencies),
                    "kvrt_one_rounds": one_rounds,
                    "kvrt_in_flight_per_lookup_s": many_elapsed / count,
                    "kvrt_in_flight_rounds": many_rounds,
                    "lookups": count,
                }
            )
    finally:
        dist.destroy_process_group()


def main(args: argparse.Namespace) -> int:
    count = 100 if args.quick else 400
    print(f"kvrt bench consensus: {WORLD} gloo ranks, {count} lookups per variant ...", file=sys.stderr, flush=True)
    results = spawn.Queue()
    port = free_port()
    ranks = [spawn.Process(target=_rank, args=(rank, port, count, results)) for rank in range(WORLD)]
    for process in ranks:
        process.start()
    try:
        measured: dict[str, Any] | None = None
        while measured is None:
            try:
                measured = results.get(timeout=1.0)
            except queue.Empty:
                failed = [process.name for process in ranks if process.exitcode not in (None, 0)]
                if failed:
                    print(f"a rank failed ({', '.join(failed)}); see its traceback above", file=sys.stderr)
                    return 1
    finally:
        join(*ranks)
    reference = measured["all_gather_object_s"]
    rows = [
        ("all_gather_object, per lookup (reference)", reference, "1.0x", ""),
        ("bare all_reduce(MIN), per lookup", measured["bare_all_reduce_s"],
         f"{reference / measured['bare_all_reduce_s']:.1f}x", ""),
        ("kvrt, one lookup at a time", measured["kvrt_one_s"], f"{reference / measured['kvrt_one_s']:.1f}x", ">= 5x"),
        (f"kvrt, {IN_FLIGHT} in flight per rank", measured["kvrt_in_flight_per_lookup_s"],
         f"{reference / measured['kvrt_in_flight_per_lookup_s']:.1f}x", ">= 20x"),
    ]  # fmt: skip
    width = max(len(name) for name, *_ in rows)
    print(f"\nkvrt bench consensus — {WORLD} gloo ranks on this host, {count} lookups; time per lookup on rank 0")
    print(f"{'variant':<{width}} | {'per lookup':>10} | {'vs reference':>12} | goal")
    print("-" * (width + 36))
    for name, seconds, ratio, goal in rows:
        print(f"{name:<{width}} | {seconds * 1e3:>7.3f} ms | {ratio:>12} | {goal}")
    print(
        f"collectives: {measured['kvrt_one_rounds']} for {count} lookups one at a time, "
        f"{measured['kvrt_in_flight_rounds']} for {count} lookups {IN_FLIGHT} in flight"
    )
    if args.plot:
        path = _plot.bars(
            Path(args.plot) / "consensus.png",
            f"TP-group agreement, {WORLD} gloo ranks: time per lookup",
            "ms per lookup",
            {name: seconds * 1e3 for name, seconds, _, _ in rows},
        )
        print(f"plot: {path}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(measured, out, indent=2)
    return 0
