"""`kvrt bench consensus`: TP-group agreement on 4 gloo ranks, beside `all_gather_object`.

Both agree on the same information per lookup (status and matched tokens), measured in the
same run on the same ranks:

* reference: `all_gather_object` of (status, matched) per lookup, then MIN on each rank,
  as AIBrix's group-aware cache manager did before it moved to `all_reduce`;
* bare: one `all_reduce(MIN)` of a 2-int tensor per lookup (AIBrix's approach, no kvrt):
  the floor for one lookup at a time;
* kvrt: `GroupConsensus.decide`, one lookup at a time, then 16 in flight per rank (lookups
  in flight together share a collective): 16 concurrent callers, each starting its next
  lookup once its last is decided, so 16 are in flight at every moment (the goal's row);
* bare rounds: one synchronous `all_reduce(MIN)` of 16 values per 16 lookups, no event loop:
  what a round of the in-flight case costs the group itself, the floor for that row;
* kvrt bursts: bursts of 16 lookups, a task each, the next burst once the last is decided
  (up to 16 in flight);
* kvrt per call: the same bursts, each burst's 16 lookups in one `decide_many` (what
  `drop_select_many` does in a TP group): no task per lookup.

The variants take turns in blocks (4 blocks: count / 4 lookups one at a time, 96 rounds of
16 in flight), so that drift in the host's load touches them alike. The figure is time per
lookup on rank 0 (median over lookups one at a time; total over the lookups timed for lookups
in flight).
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
IN_FLIGHT_ROUNDS_PER_BLOCK: Final = 96
"""Rounds of 16 lookups each in-flight variant times per block (1,536 lookups). A round here
takes 1.6 to 11 ms, depending on which rank the 2 cores serve, and blocks of 24 rounds read
up to ±15% apart within one run (the same variant, 0.307 to 0.396 ms a lookup): this many
keep a block's time near the reference's (100 lookups of ~8 ms) and its mean on enough rounds."""
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


async def _time_kvrt_one_at_a_time(count: int) -> tuple[list[float], int]:
    """kvrt's agreement on `count` lookups, each started when the last is decided: the
    latency of each, and the rounds they took."""
    from kvrt._consensus import GroupConsensus, Outcome, Status

    rank = dist.get_rank()
    consensus = GroupConsensus(dist.group.WORLD)
    consensus.start()
    latencies: list[float] = []
    rounds_before = 0
    try:
        for index in range(_WARMUP + count):
            if index == _WARMUP:
                rounds_before = consensus.rounds
            sequence = consensus.register()
            status, matched = _outcome(index, rank)
            started = time.perf_counter()
            await consensus.decide(sequence, Outcome(Status(status), matched))
            if index >= _WARMUP:
                latencies.append(time.perf_counter() - started)
        return latencies, consensus.rounds - rounds_before
    finally:
        await consensus.aclose()


async def _time_kvrt_in_flight(count: int, in_flight: int, *, pattern: str) -> tuple[float, int]:
    """kvrt's agreement on `count` lookups with `in_flight` of them in flight per rank:
    seconds for all of them, and the rounds they took. The patterns:

    * "callers": `in_flight` concurrent callers (tasks), each starting its next lookup as
      soon as its last one is decided, so that `in_flight` are always in flight: a serving
      loop with that many requests at a time;
    * "bursts": bursts of `in_flight` lookups, a new task each, the next burst once the whole
      burst is decided (in flight: `in_flight`, then none while the next burst starts);
    * "per call": the same bursts, each burst's lookups in one `decide_many` (as one
      drop_select_many in a TP group): no task per lookup.
    """
    from kvrt._consensus import GroupConsensus, Outcome, Status

    rank = dist.get_rank()
    consensus = GroupConsensus(dist.group.WORLD)
    consensus.start()

    def outcome(index: int) -> Outcome:
        status, matched = _outcome(index, rank)
        return Outcome(Status(status), matched)

    async def lookup(index: int) -> None:
        sequence = consensus.register()
        await consensus.decide(sequence, outcome(index))

    async def caller(indices: range) -> None:
        for index in indices:
            await lookup(index)

    async def lookups(indices: range) -> None:
        if pattern == "callers":
            step = in_flight
            await asyncio.gather(*(caller(indices[first::step]) for first in range(min(step, len(indices)))))
            return
        for first in range(indices.start, indices.stop, in_flight):
            burst = range(first, min(indices.stop, first + in_flight))
            if pattern == "per call":
                sequences = [consensus.register() for _ in burst]
                await consensus.decide_many(sequences, [outcome(index) for index in burst])
            else:
                await asyncio.gather(*(lookup(index) for index in burst))

    try:
        # Warm-up in the pattern that is timed, so that the window starts at its steady size.
        warmup = 2 * in_flight
        await lookups(range(warmup))
        rounds_before = consensus.rounds
        started = time.perf_counter()
        await lookups(range(warmup, warmup + count))
        return time.perf_counter() - started, consensus.rounds - rounds_before
    finally:
        await consensus.aclose()


IN_FLIGHT_PATTERNS: Final = ("callers", "bursts", "per call")


def _rank(rank: int, port: int, count: int, in_flight_rounds: int, results: Any) -> None:
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
        one_rounds = 0
        floor_per_lookup: list[float] = []
        elapsed = dict.fromkeys(IN_FLIGHT_PATTERNS, 0.0)
        rounds = dict.fromkeys(IN_FLIGHT_PATTERNS, 0)
        block = count // BLOCKS
        # Whole bursts only: a block's last burst of fewer than IN_FLIGHT lookups would time
        # lookups with fewer in flight than the row says (and cost a round of its own).
        many_block = max(block // IN_FLIGHT, in_flight_rounds) * IN_FLIGHT
        for _ in range(BLOCKS):
            reference += _time_all_gather_object(block)
            dist.barrier()
            bare += _time_bare_all_reduce(block)
            dist.barrier()
            latencies, block_rounds = asyncio.run(_time_kvrt_one_at_a_time(block))
            one_latencies += latencies
            one_rounds += block_rounds
            dist.barrier()
            floor_per_lookup.append(_time_bare_rounds(many_block, IN_FLIGHT))
            dist.barrier()
            for pattern in IN_FLIGHT_PATTERNS:
                seconds, block_rounds = asyncio.run(_time_kvrt_in_flight(many_block, IN_FLIGHT, pattern=pattern))
                elapsed[pattern] += seconds
                rounds[pattern] += block_rounds
                dist.barrier()
        in_flight_lookups = many_block * BLOCKS
        if rank == 0:
            results.put(
                {
                    "all_gather_object_s": statistics.median(reference),
                    "bare_all_reduce_s": statistics.median(bare),
                    "kvrt_one_s": statistics.median(one_latencies),
                    "kvrt_one_rounds": one_rounds,
                    "bare_rounds_per_lookup_s": statistics.fmean(floor_per_lookup),
                    "kvrt_in_flight_per_lookup_s": elapsed["callers"] / in_flight_lookups,
                    "kvrt_in_flight_rounds": rounds["callers"],
                    "kvrt_bursts_per_lookup_s": elapsed["bursts"] / in_flight_lookups,
                    "kvrt_bursts_rounds": rounds["bursts"],
                    "kvrt_per_call_per_lookup_s": elapsed["per call"] / in_flight_lookups,
                    "kvrt_per_call_rounds": rounds["per call"],
                    "kvrt_in_flight_lookups": in_flight_lookups,
                    "lookups": block * BLOCKS,
                }
            )
    finally:
        dist.destroy_process_group()


def main(args: argparse.Namespace) -> int:
    count, in_flight_rounds = (100, 24) if args.quick else (400, IN_FLIGHT_ROUNDS_PER_BLOCK)
    print(f"kvrt bench consensus: {WORLD} gloo ranks, {count} lookups per variant ...", file=sys.stderr, flush=True)
    results = spawn.Queue()
    port = free_port()
    ranks = [spawn.Process(target=_rank, args=(rank, port, count, in_flight_rounds, results)) for rank in range(WORLD)]
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
        (f"kvrt, {IN_FLIGHT} in flight per rank ({IN_FLIGHT} callers)", measured["kvrt_in_flight_per_lookup_s"],
         f"{reference / measured['kvrt_in_flight_per_lookup_s']:.1f}x", ">= 20x"),
        (f"kvrt, bursts of {IN_FLIGHT} (a task per lookup)", measured["kvrt_bursts_per_lookup_s"],
         f"{reference / measured['kvrt_bursts_per_lookup_s']:.1f}x", ""),
        (f"kvrt, bursts of {IN_FLIGHT} per call (decide_many)", measured["kvrt_per_call_per_lookup_s"],
         f"{reference / measured['kvrt_per_call_per_lookup_s']:.1f}x", ""),
    ]  # fmt: skip
    width = max(len(name) for name, *_ in rows)
    print(f"\nkvrt bench consensus — {WORLD} gloo ranks on this host, {count} lookups; time per lookup on rank 0")
    print(f"{'variant':<{width}} | {'per lookup':>10} | {'vs reference':>12} | goal")
    print("-" * (width + 36))
    for name, seconds, ratio, goal in rows:
        print(f"{name:<{width}} | {seconds * 1e3:>7.3f} ms | {ratio:>12} | {goal}")
    print(
        f"collectives: {measured['kvrt_one_rounds']} for {measured['lookups']} lookups one at a time; "
        f"for {measured['kvrt_in_flight_lookups']} lookups {IN_FLIGHT} in flight: {measured['kvrt_in_flight_rounds']} "
        f"(callers), {measured['kvrt_bursts_rounds']} (bursts), {measured['kvrt_per_call_rounds']} (per call)"
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
