"""`kvrt bench hosts`: kvrt's producer and consumer on two hosts joined by a link of a known
rate, beside a raw TCP stream of the same bytes over the same link, in one run.

Two network namespaces joined by a veth pair stand for the two hosts (`kvrt._bench._netns`):
`tc`'s token bucket filter holds each direction to `--rate-gbit` (4 Gbit/s by default), so
the link, not the two cores of a small machine, sets the pace, as between hosts. The
producer (or the raw sender) runs in one namespace, the consumer (or the raw receiver) in
the other, each a process with one torch thread.

* raw TCP stream (the reference): one connection; the sender `sendall`s the items' bytes
  back to back from one buffer, the receiver `recv_into`s one buffer it reuses: no message
  framing, no allocation, nothing but the kernel's copies, the most a TCP stream carries
  over this link;
* kvrt: the producer holds the items; the consumer takes each with `drop_select` by its
  tokens, one at a time (a large item: a layer of a long prompt, and an item above the 32 MiB
  that glibc's malloc serves from its heap) or 16 in flight (562 KiB items).

Goal: kvrt moves each row's bytes at no less than 85% of the raw stream's rate. Each row
prints both rates against the link's nominal rate, the consumer's CPU a request (every
thread of its process, over the timed requests) and its page faults a request (receive
memory touched for the first time inside a request shows there, see `kvrt._heap`).
Needs root (namespaces); without it the benchmark says why and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing.connection
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from kvrt._bench import _netns
from kvrt._bench._processes import from_child, join
from kvrt._bench._timing import Timed, markdown_table, spawn
from kvrt._bench.requests import _in_flight, _item, _one_thread, _tokens

RATE_GOAL: Final = 0.85
"""kvrt's rate against the raw stream's, over the same link in the same run."""
DEFAULT_RATE_GBIT: Final = 4.0
WARMUP: Final = 2
"""Items taken before the clock starts (connections up, receive memory grown), per row."""
RECV_CHUNK_BYTES: Final = 4 << 20
"""The raw receiver's largest read."""


@dataclass(frozen=True)
class Case:
    label: str
    item_bytes: int
    requests: int
    in_flight: int


CASES: Final = (
    Case("16 MiB, one at a time", 16 << 20, 32, 1),
    Case("64 MiB, one at a time", 64 << 20, 8, 1),
    Case("562 KiB, 16 in flight", 562 << 10, 1000, 16),
)
QUICK_CASES: Final = (
    Case("16 MiB, one at a time", 16 << 20, 16, 1),
    Case("64 MiB, one at a time", 64 << 20, 4, 1),
    Case("562 KiB, 16 in flight", 562 << 10, 400, 16),
)


@dataclass(frozen=True)
class Side:
    """What one side measured besides time: its minor page faults over the timed requests."""

    faults: int


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _placed(namespace: str, target: Callable[..., None], *args: Any) -> None:
    """`target(*args)` in a process placed on host `namespace` (its first act)."""
    _netns.enter(namespace)
    target(*args)


# -- raw TCP stream ----------------------------------------------------------------------------


def _raw_sender(address: str, case: Case, control: multiprocessing.connection.Connection) -> None:
    _one_thread()
    listener = socket.create_server((address, 0))
    control.send((address, listener.getsockname()[1]))
    connection, _ = listener.accept()
    listener.close()
    payload = memoryview(bytearray(case.item_bytes))
    with connection:
        assert connection.recv(1) == b"w"
        for _ in range(WARMUP):
            connection.sendall(payload)
        assert control.recv() == "mark"  # once the receiver took the warm-up items
        started = time.process_time()
        for _ in range(case.requests):
            connection.sendall(payload)
        assert control.recv() == "done"
        control.send(time.process_time() - started)
        control.recv()


def _raw_receiver(
    endpoint: tuple[str, int], case: Case, in_flight: int, control: multiprocessing.connection.Connection
) -> None:
    _one_thread()
    buffer = memoryview(bytearray(case.item_bytes))
    latencies: list[float] = []
    with socket.create_connection(endpoint) as connection:
        connection.sendall(b"w")

        def item() -> None:
            started, got = time.perf_counter(), 0
            while got < case.item_bytes:
                read = connection.recv_into(buffer[got:], min(RECV_CHUNK_BYTES, case.item_bytes - got))
                if read == 0:
                    raise ConnectionError("the raw sender closed the stream early")
                got += read
            latencies.append(time.perf_counter() - started)

        for _ in range(WARMUP):
            item()
        control.send("ready")
        assert control.recv() == "go"
        latencies.clear()
        faults, cpu, wall = _faults(), time.process_time(), time.perf_counter()
        for _ in range(case.requests):
            item()
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
        control.send((Timed(latencies, wall, cpu), Side(_faults() - faults)))


# -- kvrt --------------------------------------------------------------------------------------


def _kvrt_producer(address: str, case: Case, control: multiprocessing.connection.Connection) -> None:
    import kvrt

    _one_thread()

    async def main() -> None:
        count = WARMUP * case.in_flight + case.requests
        budget = max(1 << 30, 2 * count * case.item_bytes)
        async with kvrt.Producer(bind=f"tcp://{address}:0", buffer_bytes=budget) as producer:
            for index in range(count):
                tokens, key, value = _item(index, case.item_bytes)
                await producer.insert(tokens, None, key, value)
            control.send(producer.endpoint)
            assert await asyncio.to_thread(control.recv) == "mark"
            started = time.process_time()
            assert await asyncio.to_thread(control.recv) == "done"
            control.send(time.process_time() - started)
            await asyncio.to_thread(control.recv)

    asyncio.run(main())


def _kvrt_consumer(endpoint: str, case: Case, in_flight: int, control: multiprocessing.connection.Connection) -> None:
    import kvrt

    _one_thread()

    async def main() -> None:
        async with kvrt.Consumer(connect=endpoint) as consumer:
            warmup = WARMUP * in_flight
            queries = [_tokens(index) for index in range(warmup + case.requests)]
            latencies: list[float] = []

            async def take(index: int) -> None:
                started = time.perf_counter()
                item = await consumer.drop_select(queries[index])
                latencies.append(time.perf_counter() - started)
                assert item is not None

            await _in_flight(take, range(warmup), in_flight)
            control.send("ready")
            assert control.recv() == "go"
            latencies.clear()
            faults, cpu, wall = _faults(), time.process_time(), time.perf_counter()
            await _in_flight(take, range(warmup, warmup + case.requests), in_flight)
            wall = time.perf_counter() - wall
            cpu = time.process_time() - cpu
            control.send((Timed(latencies, wall, cpu), Side(_faults() - faults)))

    asyncio.run(main())


# -- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    timed: Timed
    consumer: Side

    def bytes_per_s(self, case: Case) -> float:
        return self.timed.per_s() * case.item_bytes

    def faults_per_request(self) -> float:
        return self.consumer.faults / self.timed.count


def run_raw(link: _netns.Link, case: Case) -> Measured:
    return _measure(link, case, _raw_sender, _raw_receiver)


def run_kvrt(link: _netns.Link, case: Case) -> Measured:
    return _measure(link, case, _kvrt_producer, _kvrt_consumer)


def _measure(link: _netns.Link, case: Case, sender: Callable[..., None], receiver: Callable[..., None]) -> Measured:
    """`sender` placed on host a and `receiver` on host b, warmed up, then timed."""
    control, child = spawn.Pipe()
    server = spawn.Process(target=_placed, args=(link.a, sender, link.address_a, case, child), name="sender")
    server.start()
    client_control, client_child = spawn.Pipe()
    client = None
    try:
        endpoint = from_child(control, 600)
        client = spawn.Process(target=_placed, args=(link.b, receiver, endpoint, case, case.in_flight, client_child),
                               name="receiver")  # fmt: skip
        client.start()
        assert from_child(client_control, 600) == "ready"
        control.send("mark")
        client_control.send("go")
        timed, side = from_child(client_control, 600)
        control.send("done")
        producer_cpu: float = from_child(control, 60)
    finally:
        control.send("stop")
        join(server, *([client] if client is not None else []))
    return Measured(Timed(timed.latencies_s, timed.wall_s, timed.consumer_cpu_s, producer_cpu), side)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    reason = _netns.unavailable()
    if reason is not None:
        print(f"bench hosts needs two network namespaces, which cannot be made here: {reason}", file=sys.stderr)
        return 2
    rate_gbit = float(getattr(args, "rate_gbit", None) or DEFAULT_RATE_GBIT)
    cases = QUICK_CASES if args.quick else CASES
    rows, record, met_all = [], [], True
    # Stopped from outside (`timeout`), the run still removes its namespaces on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with _netns.shaped_link(int(rate_gbit * 1e9)) as link:
        for case in cases:
            _log(f"{case.label}: raw TCP stream, then kvrt (a link of {rate_gbit:g} Gbit/s)")
            raw = run_raw(link, case)
            ours = run_kvrt(link, case)
            row, met = report_row(case, raw, ours, rate_gbit)
            met_all = met_all and met
            rows.append(row)
            record.append({
                "case": asdict(case), "link_gbit_s": rate_gbit,
                **{name: {"bytes_per_s": measured.bytes_per_s(case), "p50_ms": measured.timed.p50_ms(),
                          "consumer_cpu_us": measured.timed.cpu_us("consumer"),
                          "producer_cpu_us": measured.timed.cpu_us("producer"),
                          "consumer_faults": measured.faults_per_request()}
                   for name, measured in (("raw", raw), ("kvrt", ours))},
            })  # fmt: skip
    print(markdown_table(HEADER, rows))
    print("CPU: every thread of each side's process over the timed requests; faults: the consumer's minor page faults.")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0 if met_all or args.quick else 1


HEADER: Final = [
    "item", "raw TCP stream", "kvrt", "kvrt vs raw", "goal", "met", "consumer CPU µs a request (kvrt / raw)",
    "consumer faults a request (kvrt / raw)", "producer CPU µs a request (kvrt / raw)",
]  # fmt: skip


def report_row(case: Case, raw: Measured, ours: Measured, rate_gbit: float) -> tuple[list[str], bool]:
    """One row of the table, and whether it meets the goal."""
    link = rate_gbit * 1e9 / 8
    ratio = ours.bytes_per_s(case) / raw.bytes_per_s(case)
    met = ratio >= RATE_GOAL
    row = [
        case.label,
        f"{raw.bytes_per_s(case) / 1e9:.3f} GB/s ({raw.bytes_per_s(case) / link:.0%} of the link)",
        f"{ours.bytes_per_s(case) / 1e9:.3f} GB/s ({ours.bytes_per_s(case) / link:.0%} of the link)",
        f"{ratio:.0%}", f">= {RATE_GOAL:.0%}", "met" if met else "not met",
        f"{ours.timed.cpu_us('consumer'):,.0f} / {raw.timed.cpu_us('consumer'):,.0f}",
        f"{ours.faults_per_request():,.1f} / {raw.faults_per_request():,.1f}",
        f"{ours.timed.cpu_us('producer'):,.0f} / {raw.timed.cpu_us('producer'):,.0f}",
    ]  # fmt: skip
    return row, met
