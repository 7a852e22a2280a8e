"""`kvrt bench buffer`: kvrt's lookup buffer beside vLLM's `SimpleBuffer`, in the same run.

Workload: items of 256 tokens with key and value of 2 layers,
4 heads, head_dim 64 in fp16, hidden [256, 96] fp16 (562 KiB an item); producer and
consumer in two processes on loopback. `SimpleBuffer` runs as written, on gloo pipes between
two ranks; kvrt runs its Producer and Consumer. Scenarios:

1. 1000 buffered items queried newest-first, one request at a time;
2. 1000 items queried in insertion order: `SimpleBuffer` one at a time (it cannot do more),
   kvrt with 16 requests in flight; beside the ZeroMQ PUSH/PULL ceiling for such items;
3. p50 latency of newest-first queries as the buffer grows 10 → 10,000 items.

Every process uses one torch thread, so that neither side gets more of the two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from kvrt._bench import _plot
from kvrt._bench._processes import free_port, join
from kvrt._progress import Progress

TOKENS: Final = 256
LAYERS: Final = 2
HEADS: Final = 4
HEAD_DIM: Final = 64
HIDDEN: Final = 96
VOCAB: Final = 32000
IN_FLIGHT: Final = 16
WARMUP_QUERIES: Final = 3
"""Misses sent before timing, on both sides, so connection set-up is not measured."""
_POOL_ELEMENTS: Final = 1 << 22
_STARTUP_TIMEOUT_S: Final = 300.0

spawn = multiprocessing.get_context("spawn")


# -- the items both sides insert and query ------------------------------------------------

_pool: torch.Tensor | None = None


def item_tensors(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, roi, key, value, hidden of item `index`: distinct tokens, KV sliced from one pool."""
    global _pool
    if _pool is None:
        _pool = torch.randn(_POOL_ELEMENTS, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    tokens = query_tokens(index)
    kv_elements = LAYERS * TOKENS * HEADS * HEAD_DIM
    start = (index * 7919) % (_POOL_ELEMENTS - 3 * kv_elements)
    key = _pool[start : start + kv_elements].view(LAYERS, TOKENS, HEADS, HEAD_DIM)
    value = _pool[start + kv_elements : start + 2 * kv_elements].view(LAYERS, TOKENS, HEADS, HEAD_DIM)
    hidden = _pool[start + 2 * kv_elements : start + 2 * kv_elements + TOKENS * HIDDEN].view(TOKENS, HIDDEN)
    return tokens, torch.ones(TOKENS, dtype=torch.bool), key, value, hidden


def miss_tokens() -> torch.Tensor:
    """Tokens no item starts with (ids are never negative)."""
    return torch.full((TOKENS,), -1, dtype=torch.int64)


def query_tokens(index: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(1000 + index))


def item_bytes() -> int:
    return sum(tensor.nbytes for tensor in item_tensors(0))


# -- results ------------------------------------------------------------------------------


@dataclass
class Run:
    """One side's measurement of one scenario."""

    requests: int
    in_flight: int
    elapsed_s: float
    latencies_s: list[float] = field(repr=False)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s

    def percentile_ms(self, fraction: float) -> float:
        ordered = sorted(self.latencies_s)
        return 1e3 * ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]

    def summary(self) -> dict[str, float]:
        return {
            "requests": self.requests,
            "in_flight": self.in_flight,
            "requests_per_s": self.requests_per_s,
            "p50_ms": self.percentile_ms(0.5),
            "p99_ms": self.percentile_ms(0.99),
        }


def _wait_for_stop(control: multiprocessing.connection.Connection) -> None:
    with contextlib.suppress(EOFError):
        control.recv()


# -- kvrt ---------------------------------------------------------------------------------


def _kvrt_producer(items: int, control: multiprocessing.connection.Connection) -> None:
    from kvrt._producer import Producer

    torch.set_num_threads(1)

    async def main() -> None:
        async with Producer(buffer_bytes=1 << 40) as producer:
            for index in range(items):
                await producer.insert(*item_tensors(index))
            control.send(producer.endpoint)
            await asyncio.to_thread(_wait_for_stop, control)

    asyncio.run(main())


async def _kvrt_queries(endpoint: str, order: list[int], in_flight: int) -> Run:
    from kvrt._consumer import Consumer

    queries = {index: query_tokens(index) for index in order}
    latencies: list[float] = []
    async with Consumer(connect=endpoint) as consumer:
        for _ in range(WARMUP_QUERIES):
            if await consumer.drop_select(miss_tokens()) is not None:
                raise RuntimeError("a warm-up query matched an item")
        slots = asyncio.Semaphore(in_flight)

        async def one(index: int) -> None:
            async with slots:
                started = time.perf_counter()
                item = await consumer.drop_select(queries[index])
                latencies.append(time.perf_counter() - started)
            if item is None or item.matched != TOKENS:
                raise RuntimeError(f"item {index} did not come back")

        started = time.perf_counter()
        if in_flight == 1:
            for index in order:
                await one(index)
        else:
            async with asyncio.TaskGroup() as group:
                for index in order:
                    group.create_task(one(index))
        elapsed = time.perf_counter() - started
    return Run(len(order), in_flight, elapsed, latencies)


def run_kvrt(items: int, order: list[int], in_flight: int) -> Run:
    control, child_control = spawn.Pipe()
    producer = spawn.Process(target=_kvrt_producer, args=(items, child_control), name="kvrt-bench-producer")
    producer.start()
    try:
        if not control.poll(_STARTUP_TIMEOUT_S):
            raise RuntimeError("kvrt producer did not start")
        endpoint = control.recv()
        return asyncio.run(_kvrt_queries(endpoint, order, in_flight))
    finally:
        with contextlib.suppress(OSError):
            control.send("stop")
        join(producer)


# -- vLLM's SimpleBuffer --------------------------------------------------------------------


def _simple_buffer_rank(
    rank: int, port: int, items: int, order: list[int], control: multiprocessing.connection.Connection
) -> None:
    import torch.distributed as dist

    from kvrt._bench.vllm_pipe import GlooPipe
    from kvrt._bench.vllm_simple_buffer import SimpleBuffer

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    buffer = SimpleBuffer(GlooPipe(peer, tag=0), GlooPipe(peer, tag=1), 1e13)
    if rank == 0:
        for index in range(items):
            tokens, roi, key, value, hidden = item_tensors(index)
            buffer.insert(tokens, roi, key, value, hidden)
        control.send("ready")
        _wait_for_stop(control)
        buffer.close()
    else:
        queries = {index: query_tokens(index) for index in order}
        roi = torch.ones(TOKENS, dtype=torch.bool)
        control.recv()  # go
        for _ in range(WARMUP_QUERIES):
            buffer.drop_select(miss_tokens(), roi)
        latencies = []
        started = time.perf_counter()
        for index in order:
            begun = time.perf_counter()
            returned = buffer.drop_select(queries[index], roi)
            latencies.append(time.perf_counter() - begun)
            if returned[0] is None:
                raise RuntimeError(f"SimpleBuffer lost item {index}")
        control.send((time.perf_counter() - started, latencies))
        buffer.close()
    dist.destroy_process_group()


def run_simple_buffer(items: int, order: list[int]) -> Run:
    port = free_port()
    producer_control, producer_child = spawn.Pipe()
    consumer_control, consumer_child = spawn.Pipe()
    ranks = [
        spawn.Process(
            target=_simple_buffer_rank, args=(rank, port, items, order, child), name=f"simple-buffer-rank-{rank}"
        )
        for rank, child in ((0, producer_child), (1, consumer_child))
    ]
    for rank in ranks:
        rank.start()
    try:
        if not producer_control.poll(_STARTUP_TIMEOUT_S):
            raise RuntimeError("SimpleBuffer's producer did not start")
        producer_control.recv()
        consumer_control.send("go")
        if not consumer_control.poll(_STARTUP_TIMEOUT_S):
            raise RuntimeError("SimpleBuffer's consumer did not finish")
        elapsed, latencies = consumer_control.recv()
        return Run(len(order), 1, elapsed, latencies)
    finally:
        with contextlib.suppress(OSError):
            producer_control.send("stop")
        join(*ranks)


# -- the ZeroMQ ceiling -----------------------------------------------------------------------


def _zmq_pusher(port: int, messages: int, size: int) -> None:
    import zmq

    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    payload = memoryview(bytearray(os.urandom(size)))
    for _ in range(messages):
        push.send(payload, copy=False)
    push.close(linger=-1)
    context.term()


def run_zmq_ceiling(messages: int, size: int) -> float:
    """Bytes per second of zero-copy PUSH/PULL between two processes, for messages of `size`."""
    import zmq

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    pusher = spawn.Process(target=_zmq_pusher, args=(port, messages, size), name="zmq-push")
    pusher.start()
    try:
        pull.recv(copy=False)
        started = time.perf_counter()
        for _ in range(messages - 1):
            pull.recv(copy=False)
        return (messages - 1) * size / (time.perf_counter() - started)
    finally:
        join(pusher)
        pull.close()
        context.term()


# -- the run --------------------------------------------------------------------------------


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _row(cells: list[str], widths: list[int]) -> str:
    return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)) + " |"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    rule = "+" + "+".join("-" * (width + 2) for width in widths) + "+"
    return "\n".join([rule, _row(header, widths), rule, *(_row(row, widths) for row in rows), rule])


def _describe(run: Run) -> str:
    return f"{run.requests_per_s:,.0f} req/s, p50 {run.percentile_ms(0.5):.2f} ms, p99 {run.percentile_ms(0.99):.2f} ms"


def main(args: argparse.Namespace) -> int:
    quick = bool(args.quick)
    items = 200 if quick else 1000
    sizes = [10, 100, 1000] if quick else [10, 100, 1000, 10_000]
    growth_queries = 50 if quick else 200
    simple_growth_queries = 20 if quick else 50
    size = item_bytes()

    log(f"kvrt bench buffer: {items} items of {size / 1024:.0f} KiB, two processes on loopback")
    newest_first = list(reversed(range(items)))
    in_order = list(range(items))
    progress = Progress(5 + 2 * len(sizes), "bench buffer")
    simple_newest = run_simple_buffer(items, newest_first)
    progress.advance(note="SimpleBuffer, newest-first")
    kvrt_newest = run_kvrt(items, newest_first, 1)
    progress.advance(note="kvrt, newest-first")
    simple_ordered = run_simple_buffer(items, in_order)
    progress.advance(note="SimpleBuffer, in order")
    kvrt_ordered = run_kvrt(items, in_order, IN_FLIGHT)
    progress.advance(note=f"kvrt, in order, {IN_FLIGHT} in flight")
    ceiling = run_zmq_ceiling(2000 if not quick else 500, size)
    progress.advance(note="ZeroMQ ceiling")
    growth: dict[int, tuple[float, float]] = {}
    for count in sizes:
        queried = list(reversed(range(count)))
        kvrt_run = run_kvrt(count, queried[:growth_queries], 1)
        progress.advance(note=f"kvrt, {count} items")
        simple_run = run_simple_buffer(count, queried[:simple_growth_queries])
        progress.advance(note=f"SimpleBuffer, {count} items")
        growth[count] = (simple_run.percentile_ms(0.5), kvrt_run.percentile_ms(0.5))

    newest_ratio = kvrt_newest.requests_per_s / simple_newest.requests_per_s
    ordered_ratio = kvrt_ordered.requests_per_s / simple_ordered.requests_per_s
    kvrt_bytes_per_s = kvrt_ordered.requests_per_s * size
    ceiling_ratio = kvrt_bytes_per_s / ceiling
    kvrt_p50s = [p50 for _, p50 in growth.values()]
    flatness = max(kvrt_p50s) / min(kvrt_p50s)

    print(f"\nkvrt bench buffer — {items} items of {size / 1024:.0f} KiB (256 tokens; 2x4x64 fp16 KV; hidden 96)")
    print(
        _table(
            ["scenario", "vLLM SimpleBuffer", "kvrt", "kvrt / SimpleBuffer", "goal"],
            [
                [
                    f"{items} newest-first, 1 in flight",
                    _describe(simple_newest),
                    _describe(kvrt_newest),
                    f"{newest_ratio:.1f}x req/s",
                    "≥ 10x",
                ],
                [
                    f"{items} in insertion order",
                    _describe(simple_ordered) + " (1 in flight)",
                    _describe(kvrt_ordered) + f" ({IN_FLIGHT} in flight)",
                    f"{ordered_ratio:.1f}x req/s",
                    "≥ 3x",
                ],
            ],
        )
    )
    print(
        _table(
            ["transfer", "ZeroMQ PUSH/PULL zero-copy", "kvrt, in order, 16 in flight", "kvrt / ceiling", "goal"],
            [
                [
                    f"{size / 1024:.0f} KiB items",
                    f"{ceiling / 1e9:.2f} GB/s",
                    f"{kvrt_bytes_per_s / 1e9:.2f} GB/s",
                    f"{100 * ceiling_ratio:.0f}%",
                    "≥ 80%",
                ]
            ],
        )
    )
    print(
        _table(
            ["buffered items", "SimpleBuffer p50 (newest-first)", "kvrt p50 (newest-first)"],
            [[f"{count:,}", f"{simple:.2f} ms", f"{kvrt:.2f} ms"] for count, (simple, kvrt) in growth.items()],
        )
    )
    print(f"kvrt p50 largest / smallest over {sizes[0]:,} → {sizes[-1]:,} items: {flatness:.2f}x (goal: flat)")

    if args.plot:
        counts = [float(count) for count in growth]
        path = _plot.lines(
            Path(args.plot) / "buffer-growth.png",
            "p50 of a newest-first drop_select as the buffer grows",
            "buffered items", "p50 latency (ms)",
            {"vLLM SimpleBuffer": (counts, [simple for simple, _ in growth.values()]),
             "kvrt": (counts, [kvrt for _, kvrt in growth.values()])},
            log_x=True, log_y=True,
        )  # fmt: skip
        log(f"plot: {path}")
    if args.json:
        results: dict[str, Any] = {
            "item_bytes": size,
            "newest_first": {
                "simple_buffer": simple_newest.summary(), "kvrt": kvrt_newest.summary(), "ratio": newest_ratio
            },
            "insertion_order": {
                "simple_buffer": simple_ordered.summary(), "kvrt": kvrt_ordered.summary(), "ratio": ordered_ratio
            },
            "ceiling": {"zmq_bytes_per_s": ceiling, "kvrt_bytes_per_s": kvrt_bytes_per_s, "ratio": ceiling_ratio},
            "growth_p50_ms": {
                str(count): {"simple_buffer": simple, "kvrt": kvrt} for count, (simple, kvrt) in growth.items()
            },
            "kvrt_growth_flatness": flatness,
            "quick": quick,
        }
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0
