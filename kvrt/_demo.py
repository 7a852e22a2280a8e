"""`kvrt demo`: a prefill process and a decode process exchanging KV on loopback.

The prefill process inserts synthetic requests as fast as backpressure lets it; the decode
process asks for each request's KV by its tokens (a few requests in flight), checks every
byte, and reports progress to this process, which draws the bar and the final table.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.queues
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvrt._consumer import Consumer
from kvrt._producer import Producer
from kvrt._progress import Progress

_TOKEN_STRIDE = 1 << 20
"""Request i's tokens start at i * this, so that no request is a prefix of another."""

_RESULT_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class DemoShape:
    requests: int = 300
    min_tokens: int = 128
    max_tokens: int = 1024
    layers: int = 4
    heads: int = 8
    head_dim: int = 64
    hidden: int = 512
    in_flight: int = 8
    buffer_bytes: int = 64 << 20


def _tokens_of(request: int, shape: DemoShape) -> torch.Tensor:
    generator = torch.Generator().manual_seed(request)
    span = shape.max_tokens - shape.min_tokens + 1
    length = shape.min_tokens + int(torch.randint(span, (1,), generator=generator))
    return torch.arange(length, dtype=torch.int64) + request * _TOKEN_STRIDE


class _KVSource:
    """Deterministic KV for every request, sliced from one random pool that both processes build.

    Slicing costs nothing per request, so the demo measures the transfer, not the data
    generator, and the decode side can still check every byte.
    """

    _POOL_ELEMENTS = 1 << 25  # 64 MiB of float16

    def __init__(self, shape: DemoShape) -> None:
        self.shape = shape
        generator = torch.Generator().manual_seed(20261130)
        self._pool = torch.randn(self._POOL_ELEMENTS, generator=generator).to(torch.float16)

    def _slice(self, request: int, salt: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = 1
        for size in shape:
            count *= size
        start = (request * 7919 + salt * 104729) % (self._POOL_ELEMENTS - count)
        return self._pool[start : start + count].view(dtype).view(shape)

    def kv_of(self, request: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = self.shape
        kv_shape = (shape.layers, tokens, shape.heads, shape.head_dim)
        key = self._slice(request, 1, kv_shape, torch.float16)
        value = self._slice(request, 2, kv_shape, torch.float16)
        hidden = self._slice(request, 3, (tokens, shape.hidden), torch.bfloat16)
        return key, value, hidden


def _same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _wait_for_stop(control: multiprocessing.connection.Connection) -> None:
    try:
        control.recv()
    except EOFError:
        pass  # the parent went away: stop too


def _prefill_process(shape: DemoShape, control: multiprocessing.connection.Connection) -> None:
    torch.set_num_threads(1)  # two processes and two ZeroMQ I/O threads share the host's cores

    async def run() -> None:
        source = _KVSource(shape)
        async with Producer(buffer_bytes=shape.buffer_bytes) as producer:
            control.send(producer.endpoint)
            for request in range(shape.requests):
                tokens = _tokens_of(request, shape)
                key, value, hidden = source.kv_of(request, len(tokens))
                await producer.insert(tokens, None, key, value, hidden, timeout=_RESULT_TIMEOUT_S)
            # Stay up until the parent says decode has taken everything. (A pipe, not an
            # Event: an Event whose waiter was killed can block its setter for ever.)
            await asyncio.to_thread(_wait_for_stop, control)

    asyncio.run(run())


def _decode_process(shape: DemoShape, endpoint: str, progress: multiprocessing.queues.Queue[Any]) -> None:
    torch.set_num_threads(1)

    async def run() -> None:
        latencies: list[float] = []
        moved = 0
        source = _KVSource(shape)
        async with Consumer(connect=endpoint) as consumer:
            slots = asyncio.Semaphore(shape.in_flight)

            async def take(request: int) -> None:
                nonlocal moved
                tokens = _tokens_of(request, shape)
                async with slots:
                    started = time.perf_counter()
                    item = await consumer.drop_select(tokens, None, timeout=_RESULT_TIMEOUT_S)
                    latencies.append(time.perf_counter() - started)
                if item is None:
                    raise RuntimeError(f"request {request}: no KV arrived")
                key, value, hidden = source.kv_of(request, len(tokens))
                same = _same_bits(item.key, key) and _same_bits(item.value, value) and _same_bits(item.hidden, hidden)
                if not (same and torch.equal(item.input_tokens, tokens)):
                    raise RuntimeError(f"request {request}: KV differs from what prefill inserted")
                moved += sum(t.nbytes for t in (item.input_tokens, item.key, item.value, item.hidden) if t is not None)
                progress.put(("step", 1))

            started = time.perf_counter()
            async with asyncio.TaskGroup() as group:
                for request in range(shape.requests):
                    group.create_task(take(request))
            elapsed = time.perf_counter() - started
        progress.put(("done", {"elapsed_s": elapsed, "bytes": moved, "latencies_s": latencies}))

    try:
        asyncio.run(run())
    except BaseException as exc:  # report to the parent, which exits non-zero
        progress.put(("error", repr(exc)))
        raise


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def run_demo(shape: DemoShape) -> int:
    """Run the two processes; print the bar and the table. Returns the exit code."""
    spawn = multiprocessing.get_context("spawn")
    control, child_control = spawn.Pipe()
    progress: multiprocessing.queues.Queue[Any] = spawn.Queue()
    prefill = spawn.Process(target=_prefill_process, args=(shape, child_control), name="kvrt-prefill")
    prefill.start()
    decode = None
    try:
        if not control.poll(60):
            print("prefill process did not start within 60 s", file=sys.stderr)
            return 1
        endpoint = control.recv()
        print(f"kvrt demo: prefill at {endpoint}, TCP transport, {shape.requests} requests")
        decode = spawn.Process(target=_decode_process, args=(shape, endpoint, progress), name="kvrt-decode")
        decode.start()
        bar = Progress(shape.requests, "decode")
        while True:
            kind, payload = progress.get(timeout=_RESULT_TIMEOUT_S)
            if kind == "step":
                bar.advance(payload, "requests")
            elif kind == "error":
                print(f"\ndecode failed: {payload}", file=sys.stderr)
                return 1
            else:
                result = payload
                break
        latencies = result["latencies_s"]
        rows = [
            ("requests", f"{shape.requests}"),
            ("requests/s", f"{shape.requests / result['elapsed_s']:.0f}"),
            ("MB/s", f"{result['bytes'] / result['elapsed_s'] / 1e6:.0f}"),
            ("p50 latency", f"{_percentile(latencies, 0.50) * 1e3:.2f} ms"),
            ("p99 latency", f"{_percentile(latencies, 0.99) * 1e3:.2f} ms"),
            ("bytes checked", f"{result['bytes'] / 1e6:.0f} MB, all equal"),
        ]
        width = max(len(name) for name, _ in rows)
        print("+" + "-" * (width + 2) + "+" + "-" * 24 + "+")
        for name, value in rows:
            print(f"| {name:<{width}} | {value:>22} |")
        print("+" + "-" * (width + 2) + "+" + "-" * 24 + "+")
        return 0
    finally:
        with contextlib.suppress(OSError):
            control.send("stop")
        for process in (decode, prefill):
            if process is not None:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
                    process.join()
