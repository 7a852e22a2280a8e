"""`kvrt bench consensus`: TP-group agreement on 4 gloo ranks, beside `all_gather_object`.

Both agree on the same information per lookup (status and matched tokens), measured in the
same run on the same ranks:

* reference: `all_gather_object` of (status, matched) per lookup, then MIN on each rank,
  as the AIBrix code did before its PR (seed 000);
* bare: one `all_reduce(MIN)` of a 2-int tensor per lookup (the PR's approach, no kvrt):
  the floor for one lookup at a time;
* kvrt: `GroupConsensus.decide`, one lookup at a time, then 16 in flight per rank (lookups
  in flight together share a collective), in bursts of 16: each burst starts when the
  previous one is decided, and a block times whole bursts only;
* bare rounds: one synchronous `all_reduce(MIN)` of 16 values per 16 lookups, no event loop:
  what a round of the in-flight case costs the group itself, the floor for that row;
* kvrt per call: the same bursts, each burst's 16 lookups in one `decide_many` (what
  `drop_select_many` does in a TP group): no task per lookup.

The variants take turns in blocks (4 blocks of count / 4 lookups each), so that drift in
the host's load touches them alike. The figure is time per lookup on rank 0 (median over
lookups one at a time; total over count for lookups in flight).
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
BLOCKS: Final = 4
"""The variants run in turns of count / BLOCKS lookups each."""
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


def _time_bare_rounds(count: int, in_flight: int) -> float:
    """The floor for lookups in flight: one synchronous `all_reduce(MIN)` of `in_flight`
    values per `in_flight` lookups (what a round of kvrt carries), no event loop; seconds per
    lookup."""
    rank = dist.get_rank()
    rounds = count // in_flight
    started = 0.0
    for index in range(_WARMUP + rounds):
        if index == _WARMUP:
            started = time.perf_counter()
        values = [_outcome(index * in_flight + row, rank)[1] for row in range(in_flight)]
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        tensor.tolist()
    return (time.perf_counter() - started) / (rounds * in_flight)


async def _time_kvrt(count: int, in_flight: int, *, per_call: bool = False) -> tuple[list[float], float, int]:
    """kvrt's agreement on `count` lookups, `in_flight` at a time: each its own `decide` (as
    concurrent drop_selects), or with `per_call` the burst's lookups in one `decide_many` (as
    one drop_select_many in a TP group)."""
    from kvrt._consensus import GroupConsensus, Outcome, Status

    rank = dist.get_rank()
    consensus = GroupConsensus(dist.group.WORLD)
    consensus.start()
    latencies: list[float] = []
    try:
        # Warm-up in the pattern that is timed: bursts size the window as in steady state.
        warmup = _WARMUP if in_flight == 1 else 2 * in_flight

        async def one(index: int) -> None:
            sequence = consensus.register()
            status, matched = _outcome(index, rank)
            started = time.perf_counter()
            await consensus.decide(sequence, Outcome(Status(status), matched))
            if index >= warmup:
                latencies.append(time.perf_counter() - started)

        async def one_call(burst: range) -> None:
            sequences = [consensus.register() for _ in burst]
            outcomes = [Outcome(Status(status), matched) for status, matched in (_outcome(i, rank) for i in burst)]
            await consensus.decide_many(sequences, outcomes)

        async def lookups(indices: range) -> None:
            for first in range(indices.start, indices.stop, in_flight):
                burst = range(first, min(indices.stop, first + in_flight))
                if per_call:
                    await one_call(burst)
                else:
                    await asyncio.gather(*(one(index) for index in burst))

        await lookups(range(warmup))
        rounds_before = consensus.rounds
        started = time.perf_counter()
        await lookups(range(warmup, warmup + count))
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
        # The variants take turns, a block each, so that a change in the host's load during
        # the run weighs on all of them alike (4 ranks share 2 cores here).
        reference: list[float] = []
        bare: list[float] = []
        one_latencies: list[float] = []
        one_rounds = many_rounds = 0
        many_elapsed = 0.0
        floor_per_lookup: list[float] = []
        per_call_elapsed = 0.0
        per_call_rounds = 0
        block = count // BLOCKS
        # Whole bursts only: a block's last burst of fewer than IN_FLIGHT lookups would time
        # lookups with fewer in flight than the row says (and cost a round of its own).
        many_block = block // IN_FLIGHT * IN_FLIGHT
        for _ in range(BLOCKS):
            reference += _time_all_gather_object(block)
            dist.barrier()
            bare += _time_bare_all_reduce(block)
            dist.barrier()
            latencies, _, rounds = asyncio.run(_time_kvrt(block, 1))
            one_latencies += latencies
            one_rounds += rounds
            dist.barrier()
            _, elapsed, rounds = asyncio.run(_time_kvrt(many_block, IN_FLIGHT))
            many_elapsed += elapsed
            many_rounds += rounds
            dist.barrier()
            floor_per_lookup.append(_time_bare_rounds(many_block, IN_FLIGHT))
            dist.barrier()
            _, elapsed, rounds = asyncio.run(_time_kvrt(many_block, IN_FLIGHT, per_call=True))
            per_call_elapsed += elapsed
            per_call_rounds += rounds
            dist.barrier()
        count = block * BLOCKS
        if rank == 0:
            results.put(
                {
                    "all_gather_object_s": statistics.median(reference),
                    "bare_all_reduce_s": statistics.median(bare),
                    "kvrt_one_s": statistics.median(one_latencies),
                    "kvrt_one_rounds": one_rounds,
                    "kvrt_in_flight_per_lookup_s": many_elapsed / (many_block * BLOCKS),
                    "bare_rounds_per_lookup_s": statistics.fmean(floor_per_lookup),
                    "kvrt_per_call_per_lookup_s": per_call_elapsed / (many_block * BLOCKS),
                    "kvrt_per_call_rounds": per_call_rounds,
                    "kvrt_in_flight_rounds": many_rounds,
                    "kvrt_in_flight_lookups": many_block * BLOCKS,
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
        (f"bare all_reduce(MIN) of {IN_FLIGHT} values per {IN_FLIGHT} lookups", measured["bare_rounds_per_lookup_s"],
         f"{reference / measured['bare_rounds_per_lookup_s']:.1f}x", ""),
        (f"kvrt, {IN_FLIGHT} in flight per rank", measured["kvrt_in_flight_per_lookup_s"],
         f"{reference / measured['kvrt_in_flight_per_lookup_s']:.1f}x", ">= 20x"),
        (f"kvrt, {IN_FLIGHT} per call (decide_many)", measured["kvrt_per_call_per_lookup_s"],
         f"{reference / measured['kvrt_per_call_per_lookup_s']:.1f}x", ""),
    ]  # fmt: skip
    width = max(len(name) for name, *_ in rows)
    print(f"\nkvrt bench consensus — {WORLD} gloo ranks on this host, {count} lookups; time per lookup on rank 0")
    print(f"{'variant':<{width}} | {'per lookup':>10} | {'vs reference':>12} | goal")
    print("-" * (width + 36))
    for name, seconds, ratio, goal in rows:
        print(f"{name:<{width}} | {seconds * 1e3:>7.3f} ms | {ratio:>12} | {goal}")
    print(
        f"collectives: {measured['kvrt_one_rounds']} for {count} lookups one at a time, "
        f"{measured['kvrt_in_flight_rounds']} for {measured['kvrt_in_flight_lookups']} lookups {IN_FLIGHT} in flight, "
        f"{measured['kvrt_per_call_rounds']} for as many {IN_FLIGHT} per call"
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
