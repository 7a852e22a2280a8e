"""`kvrt bench nccl`: kvrt's NCCL transport beside raw torch NCCL send/recv, same pair, same run.

Two processes, the producer on cuda:0 and the consumer on cuda:1. For each size, first the
reference: a 2-rank NCCL group made the same way kvrt makes its pairs, and `count` back-to-
back send/recv of that many bytes, timed on the receiver from a barrier to the last
completion. Then kvrt: the producer buffers `count` items of that size, shaped like a real
model's KV (key and value [32 layers, tokens, 8 heads, 128] bf16: 128 KiB a token, so a
1 GiB item is 8192 tokens), and the consumer drop-selects them all with `in_flight` requests
outstanding, timed the same way (the queries' token tensors are made before the clock
starts, as an engine holds its requests' tokens before it asks for their KV). Then the same
items again through `drop_select_many`: BATCH (or --batch) items per request,
BATCHES_IN_FLIGHT requests outstanding, as an engine takes the KV of a scheduler step's
requests. Each variant runs once untimed (it warms the consumer's allocator up, as the
reference allocates before timing), then REPEATS timed passes, as does the reference; a row
gives the medians. Each kvrt clock starts right after the consumer took one small starter
item over the same pair, as the reference's starts right after a barrier on its pair: both
sides' loops, threads and the pair's NCCL path are awake, not back from the pause between
passes. GB/s counts payload bytes once. A last row moves 1 GiB items of one layer (262144
tokens each): a drop-select names its tokens, so there the 2 MiB query of each request
shows.
Small-item latency: sequential drop-selects of 64 KiB items, p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing
import multiprocessing.connection
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Final

import torch

from kvrt._bench import _plot

MIB: Final = 1 << 20
CASES: Final = ((1, 32), (4, 32), (16, 32), (64, 32), (256, 32), (1024, 32), (1024, 1))
"""(item MiB, layers): items of 8 KV heads x 128, bf16, K and V (4 KiB a token and layer)."""
LAYER_BYTES_PER_TOKEN: Final = 4096
SMALL_TOKENS: Final = 16
LATENCY_REQUESTS: Final = 300
PRODUCER_DEVICE: Final = "cuda:0"
CONSUMER_DEVICE: Final = "cuda:1"
_TIMEOUT = datetime.timedelta(seconds=120)
REPEATS: Final = 3
"""Timed runs of each variant at each size (the reference's too); a row gives their median: a
run of small items lasts ~15 ms, and one stall of the host moves a single run by points."""
PHASES: Final = ("warm-up", *["timed"] * REPEATS, "batched warm-up", *["batched timed"] * REPEATS)
BATCH: Final = 16
"""Items per drop_select_many in the batched passes."""
BATCHES_IN_FLIGHT: Final = 4
WATCHDOG_S: Final = 0.3
"""kvrt moves each size twice and the second pass is timed: the reference's buffers are
allocated before its clock starts, so the consumer's receive buffers (the caching allocator's
first cudaMalloc of each size) are allocated before kvrt's clock too."""

spawn = multiprocessing.get_context("spawn")


def _count(size_mib: int) -> int:
    return max(8, min(256, (4096 // size_mib)))


def _tokens(size_mib: int, layers: int) -> int:
    return size_mib * MIB // (layers * LAYER_BYTES_PER_TOKEN)


def _item(
    index: int, tokens: int, layers: int, device: str
) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, None]:
    input_tokens = torch.arange(tokens, device=device) + (index << 32)
    key = torch.full((layers, tokens, 8, 128), float(index % 7), dtype=torch.bfloat16, device=device)
    return input_tokens, None, key, key.clone(), None


def _query(index: int) -> torch.Tensor:
    return torch.arange(4) + (index << 32)


STARTER: Final = 1 << 20
"""The index of the small item the consumer takes right before each timed pass starts."""


def _raw_group(store_address: str, rank: int, device: str) -> Any:
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    from kvrt.transports.paired import _process_group

    torch.cuda.set_device(device)
    host, port = store_address.rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=_TIMEOUT)  # the consumer's process hosts it
    return store, _process_group("nccl", PrefixStore("raw", store), rank, _TIMEOUT)


def _barrier(group: Any, device: str) -> None:
    flag = torch.ones(1, device=device)
    group.allreduce([flag]).wait()
    torch.cuda.synchronize(device)


def _warm_p2p(group: Any, rank: int, device: str) -> None:
    """NCCL makes a separate communicator for the first point-to-point operation; keep its
    set-up out of the timings."""
    probe = torch.ones(1, device=device)
    work = group.send([probe], 1, 0) if rank == 0 else group.recv([probe], 0, 0)
    work.wait()
    torch.cuda.synchronize(device)


def _raw_sends(group: Any) -> None:
    _warm_p2p(group, 0, PRODUCER_DEVICE)
    for size_mib, _ in CASES:
        count, nbytes = _count(size_mib), size_mib * MIB
        buffers = [torch.ones(nbytes, dtype=torch.uint8, device=PRODUCER_DEVICE) for _ in range(count)]
        for _ in range(REPEATS):
            _barrier(group, PRODUCER_DEVICE)
            works = [group.send([buffer], 1, 0) for buffer in buffers]
            for work in works:
                work.wait()
            torch.cuda.synchronize(PRODUCER_DEVICE)


def _raw_receives(group: Any) -> list[float]:
    """The median of REPEATS timed runs per size."""
    _warm_p2p(group, 1, CONSUMER_DEVICE)
    seconds = []
    for size_mib, _ in CASES:
        count, nbytes = _count(size_mib), size_mib * MIB
        buffers = [torch.empty(nbytes, dtype=torch.uint8, device=CONSUMER_DEVICE) for _ in range(count)]
        runs = []
        for _ in range(REPEATS):
            _barrier(group, CONSUMER_DEVICE)
            started = time.perf_counter()
            works = [group.recv([buffer], 0, 0) for buffer in buffers]
            for work in works:
                work.wait()
            torch.cuda.synchronize(CONSUMER_DEVICE)
            runs.append(time.perf_counter() - started)
        seconds.append(statistics.median(runs))
    return seconds


def _peer_copies() -> list[float]:
    """The plain peer copy of the same bytes (cuda:0 -> cuda:1, `copy_` in one process: the
    copy engines over NVLink), timed as the reference receives: the median of REPEATS runs of
    `count` copies per size."""
    seconds = []
    for size_mib, _ in CASES:
        count, nbytes = _count(size_mib), size_mib * MIB
        sources = [torch.ones(nbytes, dtype=torch.uint8, device=PRODUCER_DEVICE) for _ in range(count)]
        targets = [torch.empty(nbytes, dtype=torch.uint8, device=CONSUMER_DEVICE) for _ in range(count)]
        runs = []
        for _ in range(REPEATS + 1):  # the first warms the peer mapping up
            torch.cuda.synchronize(PRODUCER_DEVICE)
            torch.cuda.synchronize(CONSUMER_DEVICE)
            started = time.perf_counter()
            for source, target in zip(sources, targets, strict=True):
                target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(PRODUCER_DEVICE)
            torch.cuda.synchronize(CONSUMER_DEVICE)
            runs.append(time.perf_counter() - started)
        seconds.append(statistics.median(runs[1:]))
        del sources, targets
    return seconds


def _producer(store_port: int, control: multiprocessing.connection.Connection) -> None:
    """The reference first (plain code, no event loop), then kvrt's producer."""
    from kvrt._producer import Producer

    _, group = _raw_group(f"127.0.0.1:{store_port}", 0, PRODUCER_DEVICE)
    _raw_sends(group)

    async def main() -> None:
        async with Producer(device=PRODUCER_DEVICE, buffer_bytes=1 << 40) as producer:
            control.send(producer.endpoint)
            for size_mib, layers in CASES:
                for phase in PHASES:
                    for index in range(_count(size_mib)):
                        await producer.insert(*_item(index, _tokens(size_mib, layers), layers, PRODUCER_DEVICE))
                    await producer.insert(*_item(STARTER, SMALL_TOKENS, 1, PRODUCER_DEVICE))
                    torch.cuda.synchronize(PRODUCER_DEVICE)
                    control.send(("ready", size_mib, phase))
                    await asyncio.to_thread(control.recv)  # consumer took them
            for index in range(LATENCY_REQUESTS):
                await producer.insert(*_item(index, SMALL_TOKENS, 1, PRODUCER_DEVICE))
            control.send(("ready", 0))
            await asyncio.to_thread(control.recv)

    asyncio.run(main())


async def _consume(consumer: Any, count: int, in_flight: int) -> float:
    slots = asyncio.Semaphore(in_flight)
    queries = [_query(index) for index in range(count)]  # an engine holds its requests' tokens already

    async def one(index: int) -> None:
        async with slots:
            item = await consumer.drop_select(queries[index])
            if item is None:
                raise RuntimeError(f"item {index} missing")

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for index in range(count):
            group.create_task(one(index))
    torch.cuda.synchronize(CONSUMER_DEVICE)
    return time.perf_counter() - started


async def _consume_batched(consumer: Any, count: int, batch: int) -> float:
    slots = asyncio.Semaphore(BATCHES_IN_FLIGHT)
    queries = [_query(index) for index in range(count)]  # an engine holds its requests' tokens already

    async def one(first: int) -> None:
        async with slots:
            items = await consumer.drop_select_many(queries[first : first + batch])
            if any(item is None for item in items):
                raise RuntimeError(f"an item of the batch from {first} is missing")

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for first in range(0, count, batch):
            group.create_task(one(first))
    torch.cuda.synchronize(CONSUMER_DEVICE)
    return time.perf_counter() - started


def main(args: argparse.Namespace) -> int:
    from torch._C._distributed_c10d import TCPStore

    from kvrt._consumer import Consumer

    if torch.cuda.device_count() < 2:
        print("kvrt bench nccl needs two CUDA devices", file=sys.stderr)
        return 1
    transport = getattr(args, "transport", None) or "nccl"
    name = "ipc" if transport == "cuda_ipc" else "nccl"
    in_flight = int(getattr(args, "in_flight", None) or 8)
    batch = int(getattr(args, "batch", None) or BATCH)
    torch.cuda.set_device(CONSUMER_DEVICE)
    host_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_TIMEOUT)
    control, child = spawn.Pipe()
    producer = spawn.Process(target=_producer, args=(host_store.port, child), name="kvrt-bench-producer")
    producer.start()
    rows: list[dict[str, float]] = []
    latency: dict[str, float] = {}
    try:
        _, group = _raw_group(f"127.0.0.1:{host_store.port}", 1, CONSUMER_DEVICE)
        raw_seconds = _raw_receives(group)
        peer_seconds = _peer_copies() if transport == "cuda_ipc" else None
        endpoint = control.recv()

        async def run() -> None:
            async with Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer:
                assert consumer.transports == {endpoint: transport}, consumer.transports
                for case, (size_mib, layers) in enumerate(CASES):
                    count, nbytes = _count(size_mib), size_mib * MIB
                    timings: dict[str, list[float]] = {phase: [] for phase in PHASES}
                    for phase in PHASES:
                        message = await asyncio.to_thread(control.recv)
                        assert message == ("ready", size_mib, phase)
                        if phase.endswith("timed"):
                            # NCCL's watchdog thread drops its references to finished receives'
                            # buffers on its own schedule (about every 100 ms); until then the
                            # allocator cannot hand them out again.
                            await asyncio.sleep(WATCHDOG_S)
                        # As the reference's barrier: the clock starts on a pair that just moved bytes.
                        if await consumer.drop_select(_query(STARTER)) is None:
                            raise RuntimeError("the starter item is missing")
                        if phase.startswith("batched"):
                            timings[phase].append(await _consume_batched(consumer, count, batch))
                        else:
                            timings[phase].append(await _consume(consumer, count, in_flight))
                        control.send("next")
                    tokens = _tokens(size_mib, layers)
                    item_bytes = tokens * (layers * LAYER_BYTES_PER_TOKEN + 8)
                    row = {
                        "size_mib": size_mib,
                        "layers": layers,
                        "tokens": tokens,
                        "count": count,
                        "raw_gbps": count * nbytes / raw_seconds[case] / 1e9,
                        "kvrt_gbps": count * item_bytes / statistics.median(timings["timed"]) / 1e9,
                        "batched_gbps": count * item_bytes / statistics.median(timings["batched timed"]) / 1e9,
                    }
                    if peer_seconds is not None:  # cuda_ipc: its goal is against the peer copy
                        row["peer_gbps"] = count * nbytes / peer_seconds[case] / 1e9
                    reference = row.get("peer_gbps", row["raw_gbps"])
                    row["ratio"] = row["kvrt_gbps"] / reference
                    row["batched_ratio"] = row["batched_gbps"] / reference
                    rows.append(row)
                    print(f"  {size_mib:5d} MiB ({layers} layers) x {count:3d}: raw {row['raw_gbps']:7.1f} GB/s, "
                          f"kvrt {row['kvrt_gbps']:7.1f} GB/s ({100 * row['ratio']:.0f}%), "
                          f"batched {row['batched_gbps']:7.1f} GB/s ({100 * row['batched_ratio']:.0f}%)",
                          file=sys.stderr, flush=True)  # fmt: skip
                assert await asyncio.to_thread(control.recv) == ("ready", 0)
                latencies = []
                for index in range(LATENCY_REQUESTS):
                    started = time.perf_counter()
                    item = await consumer.drop_select(_query(index))
                    latencies.append(time.perf_counter() - started)
                    assert item is not None
                control.send("done")
                ordered = sorted(latencies[20:])
                latency["p50_ms"] = 1e3 * statistics.median(ordered)
                latency["p99_ms"] = 1e3 * ordered[int(0.99 * (len(ordered) - 1))]

        asyncio.run(run())
    finally:
        with contextlib.suppress(OSError):
            control.send("stop")
        producer.join(60)
        if producer.is_alive():
            producer.kill()
    _print_rows(name, transport, rows, in_flight, batch)
    p50, p99 = latency["p50_ms"], latency["p99_ms"]
    print(f"small items ({SMALL_TOKENS} tokens, 64 KiB): p50 {p50:.3f} ms, p99 {p99:.3f} ms")
    if args.plot:
        shaped = [row for row in rows if row["layers"] == CASES[0][1]]
        sizes = [row["size_mib"] for row in shaped]
        path = _plot.lines(
            Path(args.plot) / f"{name}.png", f"{transport} transport, cuda:0 -> cuda:1", "item size (MiB)", "GB/s",
            {"raw torch NCCL": (sizes, [row["raw_gbps"] for row in shaped]),
             **({"peer copy": (sizes, [row["peer_gbps"] for row in shaped])} if "peer_gbps" in shaped[0] else {}),
             "kvrt": (sizes, [row["kvrt_gbps"] for row in shaped]),
             f"kvrt, drop_select_many of {batch}": (sizes, [row["batched_gbps"] for row in shaped])},
            log_x=True,
        )  # fmt: skip
        print(f"plot: {path}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "latency": latency, "in_flight": in_flight, "batch": batch}, out, indent=2)
    return 0


def _print_rows(name: str, transport: str, rows: list[dict[str, float]], in_flight: int, batch: int) -> None:
    peer = any("peer_gbps" in row for row in rows)
    against = "peer" if peer else "raw"
    print(f"\nkvrt bench {name} — {transport}, producer {PRODUCER_DEVICE}, consumer {CONSUMER_DEVICE}; "
          f"kvrt: drop_select, {in_flight} in flight; batched: drop_select_many of {batch}, "
          f"{BATCHES_IN_FLIGHT} in flight")  # fmt: skip
    print(f"{'size':>9} | {'layers':>6} | {'tokens':>6} | {'items':>5} | {'raw NCCL':>10} | "
          + (f"{'peer copy':>10} | " if peer else "")
          + f"{'kvrt':>10} | {'kvrt/' + against:>9} | {'batched':>10} | {'batched/' + against:>12} | goal")  # fmt: skip
    print("-" * (124 if peer else 110))
    goals = {(16, 32): ">= 90%", (1024, 32): ">= 95%"} if not peer else {(1024, 32): ">= 95%"}
    for row in rows:
        size, layers = int(row["size_mib"]), int(row["layers"])
        print(
            f"{size:>5} MiB | {layers:>6} | {int(row['tokens']):>6} | {int(row['count']):>5} | "
            f"{row['raw_gbps']:>5.1f} GB/s | "
            + (f"{row['peer_gbps']:>5.1f} GB/s | " if peer else "")
            + f"{row['kvrt_gbps']:>5.1f} GB/s | {100 * row['ratio']:>8.0f}% | "
            f"{row['batched_gbps']:>5.1f} GB/s | {100 * row['batched_ratio']:>11.0f}% | {goals.get((size, layers), '')}"
        )
