"""Where a consensus round's time goes, with 16 callers per rank on gloo ranks: kvrt's
`GroupConsensus` beside the least an event loop can do with the same rounds. A diagnostic
for `docs/bench/consensus-cpu.md`, not a record.

    python tools/diagnostics/consensus_round_costs.py [--rounds 150] [--world 4] [--turns 3]

Three ways of running ROUNDS rounds of 16 values, taking turns (TURNS times each), on every rank:

* sync: one synchronous `all_reduce(MIN)` per round, no event loop (the benchmark's floor);
* minimal loop: 16 tasks per rank await futures that a loop callback resolves when the round's
  collective ends (issued from the loop with `async_op`, its end heard through the work's
  future), the next round issued once the woken tasks have run: no windows, no values, no
  decisions, the least an asyncio consensus can do;
* kvrt: 16 callers of `GroupConsensus.decide`, as `kvrt bench consensus` times them; the
  round's issue and end come from kvrt's trace events (`kvrt.tracing`).

Per way: ms a round (mean over the run), and for the loop ways the medians of the round's
issue to its end heard on the loop (`collective`, the ring and the wake-up) and of that end to
the next issue (`loop`: the decisions, the woken callers, the next round's values). Rank 0's
figures; the others' read alike.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import gc
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import torch
import torch.distributed as dist

import kvrt
from kvrt._bench._processes import free_port, join
from kvrt._consensus import GroupConsensus, Outcome, Status

CALLERS = 16
WARM_ROUNDS = 10
"""Rounds left out of the medians: the window's first rounds, before it has its steady size."""


async def kvrt_rounds(rounds: int, stamps: list[list[float]]) -> None:
    def note(event: kvrt.TraceEvent) -> None:
        if event.name == "consensus.round_issued":
            stamps.append([event.at_s, 0.0])
        elif event.name == "consensus.round_ended":
            stamps[-1][1] = event.at_s

    consensus = GroupConsensus(dist.group.WORLD)
    consensus.start()

    async def caller(index: int) -> None:
        for lookup in range(rounds):
            await consensus.decide(consensus.register(), Outcome(Status.OK, 100 + (lookup * 31 + index) % 900))

    try:
        with kvrt.tracing(note):
            await asyncio.gather(*(caller(index) for index in range(CALLERS)))
    finally:
        await consensus.aclose()


async def minimal_rounds(rounds: int, stamps: list[list[float]]) -> None:
    loop = asyncio.get_running_loop()
    group: Any = dist.group.WORLD
    minimum = dist.AllreduceOptions()
    minimum.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
    waiting: list[asyncio.Future[None]] = []
    state = {"soon": False, "in_round": False}

    def end(deciding: list[asyncio.Future[None]], tensor: torch.Tensor) -> None:
        stamps[-1][1] = time.perf_counter()
        state["in_round"] = False
        tensor.tolist()
        for future in deciding:
            future.set_result(None)
        issue_soon()

    def issue() -> None:
        state["soon"] = False
        if state["in_round"] or not waiting:
            return
        deciding = waiting[:]
        waiting.clear()
        state["in_round"] = True
        stamps.append([time.perf_counter(), 0.0])
        tensor = torch.frombuffer(array.array("q", range(100, 100 + len(deciding))), dtype=torch.int64)
        work = group.allreduce([tensor], minimum)
        work.get_future().add_done_callback(lambda _: loop.call_soon_threadsafe(end, deciding, tensor))

    def issue_soon() -> None:
        if not state["soon"]:
            state["soon"] = True
            loop.call_soon(issue)

    async def caller() -> None:
        for _ in range(rounds):
            future = loop.create_future()
            waiting.append(future)
            issue_soon()
            await future

    await asyncio.gather(*(caller() for _ in range(CALLERS)))


def sync_rounds(rounds: int) -> None:
    for round_index in range(rounds):
        tensor = torch.tensor([100 + round_index + row for row in range(CALLERS)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        tensor.tolist()


def run_rank(rank: int, world: int, port: int, rounds: int, turns: int, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    loop_ways: dict[str, Callable[[int, list[list[float]]], Coroutine[Any, Any, None]]] = {
        "minimal loop": minimal_rounds,
        "kvrt": kvrt_rounds,
    }
    figures: dict[str, list[tuple[float, ...]]] = {"sync": [], "minimal loop": [], "kvrt": []}
    try:
        for _ in range(turns):
            # A full collection here, not inside a turn: one (~80 ms, torch's 170k objects)
            # landing inside a turn stalls the whole group.
            gc.collect()
            dist.barrier()
            started = time.perf_counter()
            sync_rounds(rounds)
            figures["sync"].append(((time.perf_counter() - started) / rounds * 1e3,))
            for name, way in loop_ways.items():
                stamps: list[list[float]] = []
                gc.collect()
                dist.barrier()
                started = time.perf_counter()
                asyncio.run(way(rounds, stamps))
                per_round = (time.perf_counter() - started) / rounds * 1e3
                steady = stamps[WARM_ROUNDS:]
                if len(steady) < 2:
                    raise RuntimeError(f"{name}: {len(stamps)} rounds noted, too few past the first {WARM_ROUNDS}")
                collective = statistics.median(end - issued for issued, end in steady) * 1e3
                between = statistics.median(steady[i + 1][0] - steady[i][1] for i in range(len(steady) - 1)) * 1e3
                figures[name].append((per_round, collective, between))
        if rank == 0:
            results.put(figures)
    except BaseException as error:
        results.put(f"rank {rank}: {error!r}")
        raise
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=150, help="rounds of 16 callers a way and turn")
    parser.add_argument("--world", type=int, default=4, help="gloo ranks (processes)")
    parser.add_argument("--turns", type=int, default=3, help="times each way runs, taking turns")
    args = parser.parse_args()
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    port = free_port()
    ranks = [
        spawn.Process(target=run_rank, args=(rank, args.world, port, args.rounds, args.turns, results))
        for rank in range(args.world)
    ]
    for process in ranks:
        process.start()
    try:
        figures = results.get(timeout=600)
    finally:
        join(*ranks)
    if isinstance(figures, str):
        print(f"failed: {figures}", file=sys.stderr)
        return 1
    print(f"{args.world} gloo ranks, {CALLERS} callers a rank, {args.rounds} rounds, {args.turns} turns; rank 0, ms")
    print(f"{'way':<13} | {'a round (each turn)':<24} | {'collective (median)':<22} | loop (median)")
    for name, turns in figures.items():
        per_round = " ".join(f"{turn[0]:.2f}" for turn in turns)
        collective = " ".join(f"{turn[1]:.3f}" for turn in turns) if len(turns[0]) > 1 else "-"
        between = " ".join(f"{turn[2]:.3f}" for turn in turns) if len(turns[0]) > 1 else "-"
        print(f"{name:<13} | {per_round:<24} | {collective:<22} | {between}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
