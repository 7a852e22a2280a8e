"""`kvrt bench requests`: what one request costs kvrt beside the raw ZeroMQ paths, in one run.

Two processes on loopback, a producer (or a raw server) and a consumer (or a raw client),
each with one torch thread, for items of 64 KiB, 562 KiB and 16 MiB, one request at a time
and 16 in flight:

* kvrt: the producer holds the items; the consumer takes each with `drop_select` by its
  tokens (its exact prefix), once;
* raw round trip (one at a time): a DEALER asks a ROUTER for the same bytes with plain
  blocking calls on both sides, no event loop: the least a ZeroMQ round trip costs;
* raw request/reply: an asyncio DEALER asks a ROUTER for the same bytes and waits for them,
  what a request/response transfer layer without kvrt's protocol costs;
* raw PUSH/PULL: zero-copy messages of the same bytes, as fast as one socket moves them (the
  ceiling for the in-flight rows);
* with `--transport nixl`: kvrt's producer and consumer over NIXL, beside raw NIXL READs of
  the same bytes between two agents (registered once, each READ posted and asked after until
  done), whatever `UCX_TLS` says. Goals there: 16 MiB one at a time at least 90% of raw NIXL's
  rate; 64 KiB p50 at most the raw request/reply's plus raw NIXL's plus 50 us.

Each side reports the CPU time (every thread of its process, ZeroMQ's I/O threads included)
it spent during the timed requests, per request, and kvrt's split by phase (`_phases`: the
event loop's thread against the rest, the loop thread's by a profiled run of the same
requests). Goals: 64 KiB one at a time, p50 at most 2x the raw round trip and at most 150 µs
of CPU a side; 16 in flight, at least 80% of PUSH/PULL's rate for items of 562 KiB
and more (64 KiB messages PUSH/PULL moves at a rate no request/reply reaches, the raw one
included: that row shows kvrt beside both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import torch

from kvrt._bench._phases import SideClock, breakdown_line, per_request_us
from kvrt._bench._timing import Timed, markdown_table, timed_pair
from kvrt._bench.buffer import run_zmq_ceiling
from kvrt._bench.nixl import raw_nixl_client, raw_nixl_server

spawn = multiprocessing.get_context("spawn")

IN_FLIGHT: Final = 16
TOKENS: Final = 64
"""Tokens an item has (its query names them all)."""
WARMUP: Final = 20
"""Requests made before the clock starts, on every path, as many in flight as then (connections
and caches warm, and the consumer's receive memory grown to what that many take)."""


@dataclass(frozen=True)
class Case:
    label: str
    item_bytes: int
    requests: int


CASES: Final = (Case("64 KiB", 64 << 10, 3000), Case("562 KiB", 562 << 10, 1500), Case("16 MiB", 16 << 20, 120))
QUICK_CASES: Final = (Case("64 KiB", 64 << 10, 300), Case("562 KiB", 562 << 10, 150), Case("16 MiB", 16 << 20, 16))


def _one_thread() -> None:
    torch.set_num_threads(1)


def _tokens(index: int) -> torch.Tensor:
    return torch.arange(TOKENS, dtype=torch.int64) + (index + 1) * 1_000_000


def _item(index: int, item_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens and a key and value of `item_bytes` in all (tokens included), distinct per index."""
    tokens = _tokens(index)
    elements = max(1, (item_bytes - tokens.nbytes) // 2 // 2 // TOKENS)  # fp16, key and value
    key = torch.full((1, TOKENS, 1, elements), float(index % 7), dtype=torch.float16)
    return tokens, key, key


async def _in_flight(step: Callable[[int], Awaitable[None]], indexes: range, in_flight: int) -> None:
    """`await step(index)` for each of `indexes`, `in_flight` at a time, in order."""
    pending = iter(indexes)

    async def worker() -> None:
        for index in pending:
            await step(index)

    await asyncio.gather(*(worker() for _ in range(in_flight)))


def _cpu_s() -> float:
    """CPU time of every thread of this process so far (ZeroMQ's I/O threads included), to the
    nanosecond (`os.times` counts in clock ticks of 10 ms)."""
    return time.process_time()


# -- kvrt -------------------------------------------------------------------------------------


def _kvrt_producer(
    case: Case, count: int, transport: str | None, profiled: bool, control: multiprocessing.connection.Connection
) -> None:
    import kvrt

    _one_thread()

    async def main() -> None:
        budget = max(1 << 30, 2 * count * case.item_bytes)
        async with kvrt.Producer(buffer_bytes=budget, transport=transport) as producer:
            for index in range(count):
                tokens, key, value = _item(index, case.item_bytes)
                await producer.insert(tokens, None, key, value)
            control.send(producer.endpoint)
            assert await asyncio.to_thread(control.recv) == "mark"
            clock = SideClock(profiled)
            clock.start()
            assert await asyncio.to_thread(control.recv) == "done"
            control.send(clock.stop())
            await asyncio.to_thread(control.recv)

    asyncio.run(main())


def _kvrt_consumer(
    endpoint: str, case: Case, in_flight: int, transport: str | None, profiled: bool,
    control: multiprocessing.connection.Connection,
) -> None:  # fmt: skip
    import kvrt

    _one_thread()

    async def main() -> None:
        async with kvrt.Consumer(connect=endpoint, transport=transport) as consumer:
            queries = [_tokens(index) for index in range(WARMUP + case.requests)]
            latencies: list[float] = []

            async def take(index: int) -> None:
                started = time.perf_counter()
                item = await consumer.drop_select(queries[index])
                latencies.append(time.perf_counter() - started)
                assert item is not None

            await _in_flight(take, range(WARMUP), in_flight)
            control.send("ready")
            assert control.recv() == "go"
            latencies.clear()
            clock, wall = SideClock(profiled), time.perf_counter()
            clock.start()
            await _in_flight(take, range(WARMUP, WARMUP + case.requests), in_flight)
            wall = time.perf_counter() - wall
            clock.stop()
            control.send(Timed(latencies, wall, clock.process_s, consumer_clock=clock))

    asyncio.run(main())


def run_kvrt(case: Case, in_flight: int, transport: str | None = None, *, profiled: bool = False) -> Timed:
    """kvrt's producer and consumer on `case`; `profiled`: under cProfile, for the phases."""
    return timed_pair(
        _kvrt_producer, (case, WARMUP + case.requests, transport, profiled), _kvrt_consumer, case, in_flight,
        (transport, profiled),
    )  # fmt: skip


def phases(case: Case, in_flight: int, timed: Timed, transport: str | None = None) -> dict[str, dict[str, float]]:
    """Each side's CPU µs a request by phase: `timed`'s clocks split as a profiled run's."""
    profiled = run_kvrt(case, in_flight, transport, profiled=True)
    spent: dict[str, dict[str, float]] = {}
    for side in ("producer", "consumer"):
        clock = getattr(timed, f"{side}_clock")
        profiled_clock = getattr(profiled, f"{side}_clock")
        assert clock is not None and profiled_clock is not None
        spent[side] = per_request_us(clock, profiled_clock, timed.count)
    return spent


# -- raw ZeroMQ request/reply ------------------------------------------------------------------


def _raw_server(case: Case, count: int, control: multiprocessing.connection.Connection) -> None:
    import zmq
    import zmq.asyncio

    _one_thread()

    async def main() -> None:
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        payloads = [memoryview(bytearray(os.urandom(16)) * (case.item_bytes // 16)) for _ in range(8)]
        control.send(f"tcp://127.0.0.1:{port}")

        async def serve() -> None:
            served = 0
            while True:
                identity, request = await router.recv_multipart(copy=False)
                served += 1
                # The request's id frame comes back before the bytes, as a reply's header would.
                await router.send_multipart([identity, request, payloads[served % len(payloads)]], copy=False)

        serving = asyncio.create_task(serve())
        assert await asyncio.to_thread(control.recv) == "mark"
        started = _cpu_s()
        assert await asyncio.to_thread(control.recv) == "done"
        control.send(_cpu_s() - started)
        await asyncio.to_thread(control.recv)
        serving.cancel()
        router.close(linger=0)
        context.term()

    asyncio.run(main())


def _raw_client(endpoint: str, case: Case, in_flight: int, control: multiprocessing.connection.Connection) -> None:
    import zmq
    import zmq.asyncio

    _one_thread()

    async def main() -> None:
        context = zmq.asyncio.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.connect(endpoint)
        waiting: dict[int, asyncio.Future[Any]] = {}

        async def read() -> None:
            while True:
                frames = await dealer.recv_multipart(copy=False)
                request_id = int.from_bytes(frames[0].bytes, "little")
                waiting.pop(request_id).set_result(frames[1])

        reader = asyncio.create_task(read())
        ids = iter(range(1 << 62))

        async def ask() -> None:
            request_id = next(ids)
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            waiting[request_id] = future
            await dealer.send_multipart([request_id.to_bytes(8, "little")], copy=False)
            await future

        latencies: list[float] = []

        async def timed_ask(_: int) -> None:
            started = time.perf_counter()
            await ask()
            latencies.append(time.perf_counter() - started)

        await _in_flight(timed_ask, range(WARMUP), in_flight)
        control.send("ready")
        assert control.recv() == "go"
        latencies.clear()
        cpu, wall = _cpu_s(), time.perf_counter()
        await _in_flight(timed_ask, range(case.requests), in_flight)
        control.send(Timed(latencies, time.perf_counter() - wall, _cpu_s() - cpu))
        reader.cancel()
        dealer.close(linger=0)
        context.term()

    asyncio.run(main())


def run_raw_request_reply(case: Case, in_flight: int) -> Timed:
    return timed_pair(_raw_server, (case, case.requests), _raw_client, case, in_flight)


# -- raw blocking round trip --------------------------------------------------------------------


def _blocking_server(case: Case, count: int, control: multiprocessing.connection.Connection) -> None:
    """A ROUTER answering each request with the bytes from a thread of plain blocking calls:
    the least a ZeroMQ round trip costs, no event loop on either side."""
    import threading

    import zmq

    _one_thread()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVTIMEO, 100)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    payloads = [memoryview(bytearray(os.urandom(16)) * (case.item_bytes // 16)) for _ in range(8)]
    stop = threading.Event()

    def serve() -> None:
        served = 0
        while not stop.is_set():
            try:
                identity, request = router.recv_multipart(copy=False)
            except zmq.Again:
                continue
            served += 1
            router.send_multipart([identity, request, payloads[served % len(payloads)]], copy=False)

    serving = threading.Thread(target=serve, name="raw-blocking-server")
    serving.start()
    control.send(f"tcp://127.0.0.1:{port}")
    assert control.recv() == "mark"
    started = _cpu_s()
    assert control.recv() == "done"
    control.send(_cpu_s() - started)
    control.recv()
    stop.set()
    serving.join()
    router.close(linger=0)
    context.term()


def _blocking_client(endpoint: str, case: Case, in_flight: int, control: multiprocessing.connection.Connection) -> None:
    import zmq

    _one_thread()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    latencies: list[float] = []

    def ask(request_id: int) -> None:
        started = time.perf_counter()
        dealer.send(request_id.to_bytes(8, "little"), copy=False)
        frames = dealer.recv_multipart(copy=False)
        assert int.from_bytes(frames[0].bytes, "little") == request_id
        latencies.append(time.perf_counter() - started)

    for request_id in range(WARMUP):
        ask(request_id)
    control.send("ready")
    assert control.recv() == "go"
    latencies.clear()
    cpu, wall = _cpu_s(), time.perf_counter()
    for request_id in range(case.requests):
        ask(request_id)
    control.send(Timed(latencies, time.perf_counter() - wall, _cpu_s() - cpu))
    dealer.close(linger=0)
    context.term()


def run_raw_blocking(case: Case) -> Timed:
    """One request at a time over plain blocking DEALER and ROUTER sockets."""
    return timed_pair(_blocking_server, (case, case.requests), _blocking_client, case, 1)


# -- raw NIXL READs ----------------------------------------------------------------------------


def _raw_nixl_client(endpoint: Any, case: Case, in_flight: int, control: multiprocessing.connection.Connection) -> None:
    raw_nixl_client(endpoint, case.item_bytes, case.requests, "cpu", control)


def run_raw_nixl(case: Case) -> Timed:
    """Raw NIXL READs of the case's bytes between two host agents (`kvrt._bench.nixl`)."""
    return timed_pair(raw_nixl_server, (case.item_bytes, "cpu"), _raw_nixl_client, case, 1)


NIXL_RATE_GOAL: Final = 0.9
NIXL_SMALL_SLACK_MS: Final = 0.05


# -- raw PUSH/PULL ------------------------------------------------------------------------------


def run_push_pull(case: Case) -> float:
    """Bytes per second of zero-copy PUSH/PULL between two processes, messages of the item's size."""
    return run_zmq_ceiling(max(case.requests, 32), case.item_bytes)


# -- the run ------------------------------------------------------------------------------------


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


ONE_AT_A_TIME_GOAL: Final = 2.0
"""64 KiB one at a time: kvrt's p50 against the raw blocking round trip's."""
CPU_GOAL_US: Final = 150
"""64 KiB one at a time: each side's CPU a request (every thread of its process)."""
IN_FLIGHT_GOAL: Final = 0.8
IN_FLIGHT_GOAL_FROM_BYTES: Final = 512 << 10


def main(args: argparse.Namespace) -> int:
    _one_thread()
    cases = QUICK_CASES if args.quick else CASES
    rows: list[list[str]] = []
    record: list[dict[str, Any]] = []
    goals_met = True
    transport = getattr(args, "transport", None)
    if transport not in (None, "tcp", "nixl"):
        print(f"bench requests runs over tcp or nixl, not {transport}", file=sys.stderr)
        return 2
    nixl_rows: list[list[str]] = []
    breakdowns: list[str] = []
    for case in cases:
        ceiling = run_push_pull(case)
        for in_flight in (1, IN_FLIGHT):
            _log(f"{case.label}, {in_flight} in flight: raw request/reply, then kvrt, then kvrt profiled")
            raw = run_raw_request_reply(case, in_flight)
            ours = run_kvrt(case, in_flight, transport)
            spent = phases(case, in_flight, ours, transport)
            breakdowns += [f"{case.label}, {in_flight} in flight:"]
            breakdowns += [f"  {breakdown_line(side, spent[side])}" for side in ("producer", "consumer")]
            if transport == "nixl" and in_flight == 1:
                _log(f"{case.label}: raw NIXL READs")
                raw_nixl = run_raw_nixl(case)
                row, nixl_met = _nixl_row(case, ours, raw, raw_nixl)
                nixl_rows.append(row)
                goals_met = goals_met and nixl_met is not False
                record.append({"case": asdict(case), "raw_nixl": {"p50_ms": raw_nixl.p50_ms(),
                               "p99_ms": raw_nixl.p99_ms(), "per_s": raw_nixl.per_s()}})  # fmt: skip
            blocking = None
            if in_flight == 1:
                _log(f"{case.label}: raw blocking round trip")
                blocking = run_raw_blocking(case)
                ratio = ours.p50_ms() / blocking.p50_ms()
                measure = (
                    f"p50 {ours.p50_ms():.3f} ms vs round trip {blocking.p50_ms():.3f} ms: {ratio:.2f}x"
                    f" ({ours.p50_ms() / raw.p50_ms():.2f}x request/reply)"
                )
                goal, met = "", None
                if case.item_bytes == 64 << 10:
                    most_cpu = max(ours.cpu_us("producer"), ours.cpu_us("consumer"))
                    goal = f"<= {ONE_AT_A_TIME_GOAL}x, CPU <= {CPU_GOAL_US} us a side"
                    met = ratio <= ONE_AT_A_TIME_GOAL and most_cpu <= CPU_GOAL_US
            else:
                ratio = ours.per_s() * case.item_bytes / ceiling
                measure = (
                    f"{ours.per_s() * case.item_bytes / 1e9:.2f} GB/s vs PUSH/PULL {ceiling / 1e9:.2f}: {ratio:.0%}"
                    f" ({ours.per_s() / raw.per_s():.0%} of request/reply)"
                )
                # PUSH/PULL of small messages is beyond any request/reply (the raw one included):
                # the goal is for items of a layer's size and more.
                goal = f">= {IN_FLIGHT_GOAL:.0%}" if case.item_bytes >= IN_FLIGHT_GOAL_FROM_BYTES else ""
                met = ratio >= IN_FLIGHT_GOAL if goal else None
            if met is False:
                goals_met = False
            rows.append([
                case.label, str(in_flight),
                "" if blocking is None else f"{blocking.p50_ms():.3f} ms",
                f"{raw.p50_ms():.3f} / {raw.p99_ms():.3f} ms, {raw.per_s():,.0f}/s",
                f"{ours.p50_ms():.3f} / {ours.p99_ms():.3f} ms, {ours.per_s():,.0f}/s",
                measure, goal, "" if met is None else ("met" if met else "not met"),
                f"{ours.cpu_us('producer'):.0f} / {raw.cpu_us('producer'):.0f}",
                f"{ours.cpu_us('consumer'):.0f} / {raw.cpu_us('consumer'):.0f}",
            ])  # fmt: skip
            record.append({
                "case": asdict(case), "in_flight": in_flight, "push_pull_bytes_per_s": ceiling,
                "raw_round_trip": None if blocking is None else {
                    "p50_ms": blocking.p50_ms(), "p99_ms": blocking.p99_ms(), "per_s": blocking.per_s()},
                "raw": {"p50_ms": raw.p50_ms(), "p99_ms": raw.p99_ms(), "per_s": raw.per_s(),
                        "producer_cpu_us": raw.cpu_us("producer"), "consumer_cpu_us": raw.cpu_us("consumer")},
                "kvrt": {"p50_ms": ours.p50_ms(), "p99_ms": ours.p99_ms(), "per_s": ours.per_s(),
                         "producer_cpu_us": ours.cpu_us("producer"), "consumer_cpu_us": ours.cpu_us("consumer"),
                         "phases_us": spent},
            })  # fmt: skip
    header = [
        "item", "in flight", "raw round trip p50", "raw request/reply p50 / p99", "kvrt p50 / p99", "kvrt vs reference",
        "goal", "met",
        "producer CPU us/req (kvrt / raw)", "consumer CPU us/req (kvrt / raw)",
    ]  # fmt: skip
    print(markdown_table(header, rows))
    if nixl_rows:
        print()
        nixl_header = ["item", "raw NIXL READ p50 / rate", "kvrt over nixl p50 / rate", "kvrt vs reference"]
        nixl_header += ["goal", "met"]
        print(markdown_table(nixl_header, nixl_rows))
    print("CPU: every thread of each side's process (ZeroMQ's I/O threads included), over the timed requests.")
    print("\nkvrt's CPU a request by phase (the loop thread's split as in a profiled run of the same requests):")
    print("\n".join(breakdowns))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0 if goals_met or args.quick else 1


def _nixl_row(case: Case, ours: Timed, raw: Timed, raw_nixl: Timed) -> tuple[list[str], bool | None]:
    """One item size over nixl, one request at a time, beside raw NIXL READs of its bytes."""
    ours_rate = case.item_bytes / (ours.p50_ms() / 1e3)
    raw_rate = case.item_bytes / (raw_nixl.p50_ms() / 1e3)
    met: bool | None = None
    if case.item_bytes >= 16 << 20:
        measure, goal = f"{ours_rate / raw_rate:.0%} of raw NIXL's rate", f">= {NIXL_RATE_GOAL:.0%}"
        met = ours_rate >= NIXL_RATE_GOAL * raw_rate
    elif case.item_bytes == 64 << 10:
        bound = raw.p50_ms() + raw_nixl.p50_ms() + NIXL_SMALL_SLACK_MS
        measure = f"p50 {ours.p50_ms():.3f} ms vs request/reply + READ + 50 us = {bound:.3f} ms"
        goal, met = "<= that", ours.p50_ms() <= bound
    else:
        measure, goal = f"{ours_rate / raw_rate:.0%} of raw NIXL's rate", ""
    row = [
        case.label, f"{raw_nixl.p50_ms():.3f} ms, {raw_rate / 1e9:.2f} GB/s",
        f"{ours.p50_ms():.3f} ms, {ours_rate / 1e9:.2f} GB/s", measure, goal,
        "" if met is None else ("met" if met else "not met"),
    ]  # fmt: skip
    return row, met
