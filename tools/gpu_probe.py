"""Where the time of one GPU item goes: phase timestamps and profiles of both processes.

python3 tools/gpu_probe.py OUT_DIR        (two CUDA devices)
"""

from __future__ import annotations

import asyncio
import cProfile
import multiprocessing
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

spawn = multiprocessing.get_context("spawn")
SMALL, BIG = 16, 4096  # tokens: 64 KiB and 16 MiB items


def item(index: int, tokens: int, device: str) -> tuple[Any, ...]:
    key = torch.full((1, tokens, 8, 128), 1.0, dtype=torch.bfloat16, device=device)
    return torch.arange(tokens, device=device) + (index << 32), None, key, key.clone(), None


def producer(out: str, control: Any) -> None:
    import kvrt
    from kvrt.transports.paired import PairedTransport

    spent: list[float] = []
    original = PairedTransport.send

    async def timed_send(self: Any, peer: bytes, item_: Any) -> Any:
        started = time.perf_counter()
        try:
            return await original(self, peer, item_)
        finally:
            spent.append(time.perf_counter() - started)

    PairedTransport.send = timed_send  # type: ignore[method-assign]

    async def main() -> None:
        async with kvrt.Producer(device="cuda:0", buffer_bytes=1 << 40) as p:
            for index in range(200):
                await p.insert(*item(index, SMALL, "cuda:0"))
            for index in range(200, 264):
                await p.insert(*item(index, BIG, "cuda:0"))
            torch.cuda.synchronize()
            control.send(p.endpoint)
            profile = cProfile.Profile()
            profile.enable()
            await asyncio.to_thread(control.recv)
            profile.disable()
            with open(f"{out}/producer-profile.txt", "w") as f:  # noqa: ASYNC230 (a diagnostic, after timing)
                pstats.Stats(profile, stream=f).sort_stats("tottime").print_stats(30)
            control.send(spent)

    asyncio.run(main())


async def consume(endpoint: str, out: str) -> dict[str, float]:
    import kvrt
    from kvrt import _consumer

    marks: dict[str, list[float]] = {"deliver": [], "posted": [], "synced": []}
    link_cls = _consumer._Link
    original_on_deliver = link_cls._on_deliver

    def on_deliver(self: Any, future: Any, deliver: Any, payload: Any) -> None:
        marks["deliver"].append(time.perf_counter())
        original_on_deliver(self, future, deliver, payload)
        marks["posted"].append(time.perf_counter())

    link_cls._on_deliver = on_deliver  # type: ignore[method-assign]
    result: dict[str, float] = {}
    async with kvrt.Consumer(connect=endpoint, device="cuda:1") as consumer:
        starts, ends = [], []
        for index in range(200):
            starts.append(time.perf_counter())
            assert await consumer.drop_select(torch.arange(4) + (index << 32)) is not None
            ends.append(time.perf_counter())
        rtt = [e - s for s, e in zip(starts, ends, strict=True)][20:]
        to_deliver = [d - s for s, d in zip(starts, marks["deliver"], strict=True)][20:]
        post = [p - d for d, p in zip(marks["deliver"], marks["posted"], strict=True)][20:]
        result["small_rtt_p50_ms"] = 1e3 * statistics.median(rtt)
        result["small_request_to_deliver_p50_ms"] = 1e3 * statistics.median(to_deliver)
        result["small_post_receive_p50_ms"] = 1e3 * statistics.median(post)
        profile = cProfile.Profile()
        profile.enable()
        started = time.perf_counter()
        slots = asyncio.Semaphore(8)

        async def one(index: int) -> None:
            async with slots:
                assert await consumer.drop_select(torch.arange(4) + (index << 32)) is not None

        await asyncio.gather(*(one(index) for index in range(200, 264)))
        torch.cuda.synchronize()
        result["big_16mib_x64_gbps"] = 64 * 16 * 2**20 / (time.perf_counter() - started) / 1e9
        profile.disable()
        with open(f"{out}/consumer-profile.txt", "w") as f:  # noqa: ASYNC230 (a diagnostic, after timing)
            pstats.Stats(profile, stream=f).sort_stats("tottime").print_stats(30)
    return result


def main(out: str) -> int:
    Path(out).mkdir(parents=True, exist_ok=True)
    control, child = spawn.Pipe()
    process = spawn.Process(target=producer, args=(out, child))
    process.start()
    endpoint = control.recv()
    result = asyncio.run(consume(endpoint, out))
    control.send("done")
    spent = control.recv()
    process.join(30)
    result["producer_send_p50_ms"] = 1e3 * statistics.median(spent[20:200])
    for name, value in result.items():
        print(f"probe {name}: {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
