"""What the request benchmarks share: a server process and a client process that times its
requests to it (`timed_pair`), what they measured (`Timed`), and the tables they print."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import statistics
from dataclasses import dataclass
from typing import Any

from kvrt._bench._phases import SideClock
from kvrt._bench._processes import from_child, join

spawn = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class Timed:
    """One path's timed requests: their latencies, the wall time, and each side's CPU time."""

    latencies_s: list[float]
    wall_s: float
    consumer_cpu_s: float
    producer_cpu_s: float = 0.0
    consumer_clock: SideClock | None = None
    producer_clock: SideClock | None = None
    """Each side's CPU split into its loop thread and the rest (and, in a profiled run, the
    loop thread's phases), where the side reports it."""

    @property
    def count(self) -> int:
        return len(self.latencies_s)

    def p50_ms(self) -> float:
        return statistics.median(self.latencies_s) * 1e3

    def p99_ms(self) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3

    def per_s(self) -> float:
        return self.count / self.wall_s

    def cpu_us(self, side: str) -> float:
        return (self.consumer_cpu_s if side == "consumer" else self.producer_cpu_s) / self.count * 1e6


def timed_pair(
    server: Any, server_args: tuple[Any, ...], client: Any, case: Any, in_flight: int,
    client_args: tuple[Any, ...] = (),
) -> Timed:
    """A server process (it sends its endpoint first) and a client process timing its requests
    to it (see `_timed_client`)."""
    control, child = spawn.Pipe()
    process = spawn.Process(target=server, args=(*server_args, child), name="server")
    process.start()
    try:
        endpoint = from_child(control, 600)
        timed = _timed_client(client, (endpoint, case, in_flight, *client_args), control)
    finally:
        control.send("stop")
        join(process)
    return timed


def _timed_client(target: Any, args: tuple[Any, ...], server: multiprocessing.connection.Connection) -> Timed:
    """Run a client process: warmed up, then the server's CPU clock is marked and the client
    times its requests; the server reports its CPU time over them."""
    client_control, client_child = spawn.Pipe()
    client = spawn.Process(target=target, args=(*args, client_child), name="client")
    client.start()
    try:
        assert from_child(client_control, 600) == "ready"
        server.send("mark")
        client_control.send("go")
        timed: Timed = from_child(client_control, 600)
        server.send("done")
        server_cpu: float | SideClock = from_child(server, 60)
    finally:
        join(client)
    if isinstance(server_cpu, SideClock):
        return Timed(timed.latencies_s, timed.wall_s, timed.consumer_cpu_s, server_cpu.process_s,
                     timed.consumer_clock, server_cpu)  # fmt: skip
    return Timed(timed.latencies_s, timed.wall_s, timed.consumer_cpu_s, server_cpu)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(header), "| " + " | ".join("-" * width for width in widths) + " |", *map(line, rows)])
