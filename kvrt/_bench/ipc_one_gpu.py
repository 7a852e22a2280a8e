"""`kvrt bench ipc` on a host with one GPU: a producer and a consumer process both on cuda:0,
kvrt's cuda_ipc transport beside two raw two-process references of the same bytes, same run.

* raw, mapped once: the producer shares one buffer holding every item once; the consumer
  maps it once and copies item after item out of it (`copy_`, a copy engine) into memory of
  its own, synchronizing its stream per request (one at a time) or per batch (in flight):
  what moving the bytes costs on this GPU with no per-item control at all;
* raw, mapped per item: the producer shares each item's storage as torch's own sharing does
  (pickled over a pipe between the two: an IPC handle and a reference counter per item); the
  consumer asks for a batch, opens each, copies it and lets it go: a fresh mapping per item;
* kvrt: the producer holds the items (inserted before the clock); the consumer takes each
  with `drop_select` by its tokens, on `transport="cuda_ipc"`.

Each side reports the CPU time of its process over the timed requests, per request, and
kvrt's split by phase (`_phases`: its event loop's thread against the rest, the loop thread's
by a second, profiled run of the same requests). Both
contexts share the one GPU: the work of one process and the copies of the other time-slice
it, so a row in which one process's stream waits for the other's work pays a context switch.

Goals on one H200: 128 KiB one at a time p50 <= 0.35 ms; 16 MiB with 8 in flight >= 25% of the
mapped-once copy; 1 GiB >= 70% of it; each side's CPU time <= 150 us per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.connection
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import torch

from kvrt._bench._phases import SideClock, breakdown_line, per_request_us
from kvrt._bench._processes import from_child, join

spawn = multiprocessing.get_context("spawn")
Connection = multiprocessing.connection.Connection

DEVICE: Final = "cuda:0"
TOKENS: Final = 64
WARMUP: Final = 8
CPU_GOAL_US: Final = 150.0
DISTINCT_ITEMS_BYTES: Final = 2 << 30
"""The raw paths cycle through this many bytes of distinct items (at least two items)."""


@dataclass(frozen=True)
class Case:
    label: str
    item_bytes: int
    in_flight: int
    requests: int
    goal: str = ""
    """"p50": kvrt's p50 at most `goal_value` ms; "share": kvrt's rate at least `goal_value` of
    the mapped-once copy's; "": no goal."""
    goal_value: float = 0.0


CASES: Final = (
    Case("128 KiB", 128 << 10, 1, 2000, "p50", 0.35),
    Case("1 MiB", 1 << 20, 8, 800),
    Case("16 MiB", 16 << 20, 8, 400, "share", 0.25),
    Case("1 GiB", 1 << 30, 1, 12, "share", 0.70),
)
QUICK_CASES: Final = (
    Case("128 KiB", 128 << 10, 1, 200, "p50", 0.35),
    Case("16 MiB", 16 << 20, 8, 48, "share", 0.25),
    Case("1 GiB", 1 << 30, 1, 3, "share", 0.70),
)


@dataclass(frozen=True)
class Timed:
    """One path's timed requests: latencies (of a request, or of a batch of `in_flight` on the
    raw paths), how many requests, the wall time, and each side's CPU time."""

    latencies_s: list[float]
    requests: int
    wall_s: float
    consumer_cpu_s: float
    producer_cpu_s: float = 0.0
    consumer_clock: SideClock | None = None
    producer_clock: SideClock | None = None

    def p50_ms(self) -> float:
        return statistics.median(self.latencies_s) * 1e3

    def p99_ms(self) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3

    def bytes_per_s(self, item_bytes: int) -> float:
        return self.requests * item_bytes / self.wall_s

    def cpu_us(self, side: str) -> float:
        return (self.consumer_cpu_s if side == "consumer" else self.producer_cpu_s) / self.requests * 1e6


def _item_shape(item_bytes: int) -> tuple[int, int, int, int]:
    """The key's (and the value's) shape for an item of about `item_bytes`, fp16."""
    return 1, TOKENS, 1, max(1, item_bytes // 2 // 2 // TOKENS)


def _tokens(index: int) -> torch.Tensor:
    return torch.arange(TOKENS, dtype=torch.int64) + (index + 1) * 1_000_000


def _distinct(case: Case) -> int:
    return max(2, min(case.requests + WARMUP, DISTINCT_ITEMS_BYTES // case.item_bytes))


def _batches(case: Case) -> int:
    return case.requests // case.in_flight


def _synchronize() -> None:
    torch.cuda.current_stream(torch.device(DEVICE)).synchronize()


def _release() -> None:
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
    torch.cuda.empty_cache()


# -- the producer process: serves each path in turn -------------------------------------------


def _producer(control: Connection, direct: Connection) -> None:
    import torch.multiprocessing  # registers torch's CUDA IPC pickling

    torch.cuda.set_device(DEVICE)
    while (order := control.recv()) != "stop":
        path, case = order
        if path.startswith("kvrt"):
            _serve_kvrt(case, control, profiled=path == "kvrt profiled")
        elif path == "mapped once":
            _serve_mapped_once(case, control, direct)
        else:
            _serve_mapped_per_item(case, control, direct)
        _release()


def _report_cpu(control: Connection) -> None:
    """Mark the CPU clock on "mark"; send its advance on "done"."""
    assert control.recv() == "mark"
    started = time.process_time()
    assert control.recv() == "done"
    control.send(time.process_time() - started)


def _serve_mapped_once(case: Case, control: Connection, direct: Connection) -> None:
    count = _distinct(case)
    whole = torch.empty((count, *_item_shape(case.item_bytes)), dtype=torch.float16, device=DEVICE)
    for index in range(count):
        whole[index].fill_(index % 7)
    _synchronize()
    direct.send(whole)  # shared once, straight to the consumer (a share cannot be passed on)
    control.send(count)
    _report_cpu(control)
    assert control.recv() == "finished"


def _serve_mapped_per_item(case: Case, control: Connection, direct: Connection) -> None:
    """The items the consumer asks for by index, shared one by one over the pipe between the
    two, until it says "finished"; its "mark" and "done" bracket the timed requests."""
    count = _distinct(case)
    shape = _item_shape(case.item_bytes)
    items = [torch.full(shape, index % 7, dtype=torch.float16, device=DEVICE) for index in range(count)]
    _synchronize()
    control.send(count)
    started = time.process_time()
    while (asked := direct.recv()) != "finished":
        if asked == "mark":
            started = time.process_time()
        elif asked == "done":
            direct.send(time.process_time() - started)
        else:
            direct.send([items[index] for index in asked])
    assert control.recv() == "finished"


def _serve_kvrt(case: Case, control: Connection, *, profiled: bool) -> None:
    import kvrt

    shape = _item_shape(case.item_bytes)
    count = WARMUP + _batches(case) * case.in_flight

    async def main() -> None:
        async with kvrt.Producer(device=DEVICE, buffer_bytes=2 * count * case.item_bytes + (1 << 30)) as producer:
            for index in range(count):
                key = torch.full(shape, index % 7, dtype=torch.float16, device=DEVICE)
                await producer.insert(_tokens(index), None, key, key)
            _synchronize()
            control.send(producer.endpoint)
            assert await asyncio.to_thread(control.recv) == "mark"
            clock = SideClock(profiled)
            clock.start()  # on the loop's thread
            assert await asyncio.to_thread(control.recv) == "done"
            control.send(clock.stop())
            assert await asyncio.to_thread(control.recv) == "finished"

    asyncio.run(main())


# -- the consumer process -----------------------------------------------------------------------


def _consumer(control: Connection, direct: Connection) -> None:
    import torch.multiprocessing  # registers torch's CUDA IPC pickling

    torch.cuda.set_device(DEVICE)
    while (order := control.recv()) != "stop":
        path, case, offer = order
        if path.startswith("kvrt"):
            timed = _take_kvrt(case, offer, control, profiled=path == "kvrt profiled")
        elif path == "mapped once":
            timed = _take_mapped_once(case, direct.recv(), control)
        else:
            timed = _take_mapped_per_item(case, offer, control, direct)
        _release()
        control.send(timed)


def _take_mapped_once(case: Case, whole: torch.Tensor, control: Connection) -> Timed:
    count = whole.shape[0]
    landing = [torch.empty_like(whole[0]) for _ in range(case.in_flight)]
    for index in range(WARMUP):
        landing[0].copy_(whole[index % count])
    _synchronize()
    control.send("ready")
    assert control.recv() == "go"
    latencies: list[float] = []
    cpu, wall = time.process_time(), time.perf_counter()
    for batch in range(_batches(case)):
        started = time.perf_counter()
        for slot in range(case.in_flight):
            landing[slot].copy_(whole[(batch * case.in_flight + slot) % count], non_blocking=True)
        _synchronize()
        latencies.append(time.perf_counter() - started)
    return Timed(latencies, _batches(case) * case.in_flight, time.perf_counter() - wall, time.process_time() - cpu)


def _take_mapped_per_item(case: Case, count: int, control: Connection, direct: Connection) -> Timed:
    def request(batch: int) -> None:
        direct.send([(batch * case.in_flight + slot) % count for slot in range(case.in_flight)])
        shared: list[torch.Tensor] = direct.recv()
        for source in shared:
            torch.empty_like(source).copy_(source, non_blocking=True)
        _synchronize()
        shared.clear()  # each mapping closes with its last reference

    for batch in range(WARMUP):
        request(batch)
    control.send("ready")
    assert control.recv() == "go"
    latencies: list[float] = []
    direct.send("mark")
    cpu, wall = time.process_time(), time.perf_counter()
    for batch in range(_batches(case)):
        started = time.perf_counter()
        request(batch)
        latencies.append(time.perf_counter() - started)
    wall_s, cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    direct.send("done")
    producer_cpu_s: float = direct.recv()
    direct.send("finished")
    return Timed(latencies, _batches(case) * case.in_flight, wall_s, cpu_s, producer_cpu_s)


def _take_kvrt(case: Case, endpoint: str, control: Connection, *, profiled: bool) -> Timed:
    import kvrt

    async def main() -> Timed:
        async with kvrt.Consumer(connect=endpoint, device=DEVICE, transport="cuda_ipc") as consumer:
            assert consumer.transports == {endpoint: "cuda_ipc"}, consumer.transports
            for index in range(WARMUP):
                assert await consumer.drop_select(_tokens(index)) is not None
            await asyncio.to_thread(control.send, "ready")
            assert await asyncio.to_thread(control.recv) == "go"
            latencies: list[float] = []
            pending = iter(range(WARMUP, WARMUP + _batches(case) * case.in_flight))

            async def worker() -> None:
                for index in pending:
                    started = time.perf_counter()
                    item = await consumer.drop_select(_tokens(index))
                    latencies.append(time.perf_counter() - started)
                    assert item is not None

            clock, wall = SideClock(profiled), time.perf_counter()
            clock.start()
            await asyncio.gather(*(worker() for _ in range(case.in_flight)))
            _synchronize()
            wall = time.perf_counter() - wall
            clock.stop()
            return Timed(latencies, len(latencies), wall, clock.process_s, consumer_clock=clock)

    return asyncio.run(main())


# -- the run ----------------------------------------------------------------------------------------

PATHS: Final = ("mapped once", "mapped per item", "kvrt", "kvrt profiled")
"""The last runs kvrt again under the profiler, for the phases of the row's CPU only."""


def _run_path(path: str, case: Case, producer: Connection, consumer: Connection) -> Timed:
    producer.send((path, case))
    offer = from_child(producer, 600)
    consumer.send((path, case, offer))
    assert from_child(consumer, 600) == "ready"
    if path == "mapped per item":  # the two mark the producer's CPU clock between them
        consumer.send("go")
        timed: Timed = from_child(consumer, 600)
        producer.send("finished")
        return timed
    producer.send("mark")
    consumer.send("go")
    timed = from_child(consumer, 600)
    producer.send("done")
    producer_cpu: float | SideClock = from_child(producer, 60)
    producer.send("finished")
    if isinstance(producer_cpu, SideClock):
        return Timed(timed.latencies_s, timed.requests, timed.wall_s, timed.consumer_cpu_s, producer_cpu.process_s,
                     timed.consumer_clock, producer_cpu)  # fmt: skip
    return Timed(timed.latencies_s, timed.requests, timed.wall_s, timed.consumer_cpu_s, producer_cpu)


def main(args: argparse.Namespace) -> int:
    cases = QUICK_CASES if args.quick else CASES
    results: dict[str, dict[str, Timed]] = {}
    producer_control, producer_child = spawn.Pipe()
    consumer_control, consumer_child = spawn.Pipe()
    producer_end, consumer_end = spawn.Pipe()  # between the two: the shares of each item
    producer = spawn.Process(target=_producer, args=(producer_child, producer_end), name="producer")
    consumer = spawn.Process(target=_consumer, args=(consumer_child, consumer_end), name="consumer")
    producer.start()
    consumer.start()
    try:
        for case in cases:
            for path in PATHS:
                print(f"{case.label}, {case.in_flight} in flight: {path}", flush=True)
                results.setdefault(case.label, {})[path] = _run_path(path, case, producer_control, consumer_control)
    finally:
        for control in (producer_control, consumer_control):
            control.send("stop")
        join(producer, consumer)
    return _report(cases, results, args)


def _report(cases: tuple[Case, ...], results: dict[str, dict[str, Timed]], args: argparse.Namespace) -> int:
    rows: list[list[str]] = []
    record: list[dict[str, Any]] = []
    goals_met = True
    breakdowns: list[str] = []
    for case in cases:
        once, per_item, ours, profiled = (results[case.label][path] for path in PATHS)
        spent: dict[str, dict[str, float]] = {}
        for side in ("producer", "consumer"):
            clock, profiled_clock = getattr(ours, f"{side}_clock"), getattr(profiled, f"{side}_clock")
            assert clock is not None and profiled_clock is not None
            spent[side] = per_request_us(clock, profiled_clock, ours.requests)
        breakdowns += [f"{case.label}, {case.in_flight} in flight:"]
        breakdowns += [f"  {breakdown_line(side, spent[side])}" for side in ("producer", "consumer")]
        share = ours.bytes_per_s(case.item_bytes) / once.bytes_per_s(case.item_bytes)
        if case.goal == "p50":
            measure = f"p50 {ours.p50_ms():.3f} ms (mapped once {once.p50_ms():.3f}, per item {per_item.p50_ms():.3f})"
            goal = f"p50 <= {case.goal_value} ms"
            met: bool | None = ours.p50_ms() <= case.goal_value
        else:
            per_item_share = ours.bytes_per_s(case.item_bytes) / per_item.bytes_per_s(case.item_bytes)
            measure = f"{share:.0%} of mapped once, {per_item_share:.0%} of mapped per item"
            goal = f">= {case.goal_value:.0%} of mapped once" if case.goal else ""
            met = share >= case.goal_value if case.goal else None
        cpu_met = max(ours.cpu_us("producer"), ours.cpu_us("consumer")) <= CPU_GOAL_US
        goals_met = goals_met and met is not False and cpu_met
        rows.append([
            case.label, str(case.in_flight),
            *(f"{t.p50_ms():.3f} ms, {t.bytes_per_s(case.item_bytes) / 1e9:.1f} GB/s" for t in (once, per_item, ours)),
            measure, goal, "" if met is None else ("met" if met else "not met"),
            f"{ours.cpu_us('producer'):.0f} / {ours.cpu_us('consumer'):.0f}", "met" if cpu_met else "not met",
        ])  # fmt: skip
        record.append({
            "case": asdict(case),
            **{path: {"p50_ms": t.p50_ms(), "p99_ms": t.p99_ms(), "bytes_per_s": t.bytes_per_s(case.item_bytes),
                      "producer_cpu_us": t.cpu_us("producer"), "consumer_cpu_us": t.cpu_us("consumer")}
               for path, t in zip(PATHS[:3], (once, per_item, ours), strict=True)},
            "kvrt_phases_us": spent,
        })  # fmt: skip
    header = [
        "item", "in flight", "raw mapped once: p50, rate", "raw mapped per item", "kvrt", "kvrt vs references",
        "goal", "met", f"kvrt CPU us/req, producer / consumer (goal <= {CPU_GOAL_US:.0f})", "met",
    ]  # fmt: skip
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)) + " |"

    print(f"\nkvrt bench ipc, one GPU: producer and consumer processes both on {DEVICE}")
    print("\n".join([line(header), "| " + " | ".join("-" * width for width in widths) + " |", *map(line, rows)]))
    print("p50: of one request (kvrt), of one request or batch of `in flight` (raw). CPU: every thread of")
    print("each side's process over the timed requests.")
    print("\nkvrt's CPU a request by phase (the loop thread's split as in a profiled run of the same requests):")
    print("\n".join(breakdowns))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0 if goals_met or args.quick else 1
