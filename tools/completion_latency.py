"""How soon an event loop hears that GPU work finished, by the ways kvrt could learn it.

python3 tools/completion_latency.py      (one CUDA device)

A kernel of known length (torch.cuda._sleep) runs on a side stream; the loop is told when it
ends by: (a) a kvrt thread waiting on a blocking event, then call_soon_threadsafe (what the
paired transport does); (b) the same with a spinning (default) event; (c) a host function
queued on the stream behind the kernel (the driver's cuLaunchHostFunc), which calls
call_soon_threadsafe from the driver's thread. Printed: the delay from the kernel's end
(launch + its measured length) to the loop callback, p50 and p90 over the runs. Then what a
waiting thread costs the loop's own CUDA calls (an allocation, an event, a small kernel, a
device query) while it waits on a long kernel, blocking or spinning.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

RUNS = 60
CYCLES = 2_000_000  # ~1 ms on an H200


def kernel_ms(stream: torch.cuda.Stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        torch.cuda._sleep(CYCLES)
        end.record()
    end.synchronize()
    return start.elapsed_time(end)


_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_pending: dict[int, Callable[[], None]] = {}


@_HOST_FN
def _on_stream(key: Any) -> None:
    _pending.pop(key)()


async def main() -> None:
    loop = asyncio.get_running_loop()
    stream = torch.cuda.Stream()
    duration = statistics.median(kernel_ms(stream) for _ in range(10)) / 1e3
    waiter = concurrent.futures.ThreadPoolExecutor(1)
    libcuda = ctypes.CDLL("libcuda.so.1")
    libcuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
    results: dict[str, list[float]] = {}
    for name in ("blocking event + thread", "spinning event + thread", "host function on the stream"):
        delays = []
        for run in range(RUNS):
            heard: asyncio.Future[float] = loop.create_future()

            def note(heard: asyncio.Future[float] = heard) -> None:
                heard.set_result(time.perf_counter())

            with torch.cuda.stream(stream):
                torch.cuda._sleep(CYCLES)
                launched = time.perf_counter()
                if name.startswith("host"):
                    key = run + 1
                    _pending[key] = lambda: loop.call_soon_threadsafe(note)
                    assert libcuda.cuLaunchHostFunc(ctypes.c_void_p(stream.cuda_stream), _on_stream, key) == 0
                else:
                    event = torch.cuda.Event(blocking=name.startswith("blocking"))
                    event.record(stream)
                    waited = waiter.submit(event.synchronize)
                    waited.add_done_callback(lambda _: loop.call_soon_threadsafe(note))
            delays.append(await heard - launched - duration)
        results[name] = delays[5:]
    print(f"kernel {duration * 1e3:.3f} ms; delay from its end to the loop callback, {RUNS - 5} runs:")
    for name, delays in results.items():
        ordered = sorted(delays)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        print(f"  {name:<30} p50 {statistics.median(delays) * 1e6:7.1f} us  p90 {p90 * 1e6:7.1f} us")


def loop_calls_beside_a_waiting_thread() -> None:
    stream = torch.cuda.Stream()
    waiter = concurrent.futures.ThreadPoolExecutor(1)
    small = torch.zeros(256, device="cuda")
    print("the loop's CUDA calls (empty 1 MiB, event record, small kernel, current_device), per round:")
    for name in ("nobody waiting", "blocking event + thread", "spinning event + thread"):
        rounds = []
        for _ in range(5):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(40 * CYCLES)  # ~40 ms
                event = torch.cuda.Event(blocking=name.startswith("blocking"))
                event.record(stream)
            waited = None if name.startswith("nobody") else waiter.submit(event.synchronize)
            time.sleep(0.002)  # the thread is in its wait now
            for _ in range(200):
                started = time.perf_counter()
                torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
                torch.cuda.Event().record()
                small.add_(1)
                torch.cuda.current_device()
                rounds.append(time.perf_counter() - started)
            if waited is not None:
                waited.result()
            event.synchronize()
        print(f"  {name:<30} p50 {statistics.median(rounds) * 1e6:7.1f} us  max {max(rounds) * 1e6:7.1f} us")


if __name__ == "__main__":
    asyncio.run(main())
    loop_calls_beside_a_waiting_thread()
