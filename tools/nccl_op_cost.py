"""Host cost of the operations one GPU item pays for, on two GPUs (a diagnostic).

python3 tools/nccl_op_cost.py      prints microseconds per call, median of 200
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

spawn = multiprocessing.get_context("spawn")
N = 200


def median_us(samples: list[float]) -> float:
    return 1e6 * statistics.median(samples)


def timed(call: Callable[[], Any], count: int = N) -> tuple[float, list[Any]]:
    samples, results = [], []
    for _ in range(count):
        started = time.perf_counter()
        results.append(call())
        samples.append(time.perf_counter() - started)
    return median_us(samples), results


VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "no flight recorder": {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_FR_BUFFER_SIZE": "0"},
    "avoid record_stream": {"TORCH_NCCL_AVOID_RECORD_STREAMS": "1"},
    "no async error handling": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
}


def rank_main(rank: int, port: int, variant: str, results: Any) -> None:
    os.environ.update(VARIANTS[variant])
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    from kvrt.transports.paired import _process_group

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    group = _process_group("nccl", PrefixStore("probe", store), rank, datetime.timedelta(seconds=60))
    peer = 1 - rank
    tensor = torch.ones(1 << 16, dtype=torch.uint8, device=device)
    warm = group.send([tensor], peer, 0) if rank == 0 else group.recv([tensor], peer, 0)
    warm.wait()
    torch.cuda.synchronize()
    out: dict[str, float] = {}
    side = torch.cuda.Stream(device)

    def p2p() -> Any:
        return group.send([tensor], peer, 0) if rank == 0 else group.recv([tensor], peer, 0)

    def p2p_on_side_stream() -> Any:
        with torch.cuda.stream(side):
            tensor.record_stream(side)
            work = p2p()
            work.wait()
            event = torch.cuda.Event()
            event.record(side)
        return work, event

    group.allreduce([torch.ones(1, device=device)]).wait()
    torch.cuda.synchronize()
    out["p2p_us"], works = timed(p2p)
    torch.cuda.synchronize()
    group.allreduce([torch.ones(1, device=device)]).wait()
    torch.cuda.synchronize()
    out["p2p_side_stream_event_us"], works = timed(p2p_on_side_stream)
    torch.cuda.synchronize()
    del works
    try:
        group.allreduce([torch.ones(1, device=device)]).wait()
        torch.cuda.synchronize()

        def eight_coalesced() -> Any:
            group._start_coalescing(device)
            for _ in range(8):
                p2p()
            return group._end_coalescing(device)

        out["8_coalesced_us"], works = timed(eight_coalesced, 50)
        torch.cuda.synchronize()
        del works
    except Exception as error:  # a diagnostic: report and go on
        print(f"rank {rank} {variant}: coalescing failed: {error!r}"[:300], flush=True)
    # 1 GiB operations queued back to back, as a transfer of big items posts them: the host
    # time of each call, alone and with a kvrt-like thread blocked on an event meanwhile.
    big = [torch.ones(1 << 30, dtype=torch.uint8, device=device) for _ in range(4)]
    for waiting in (False, True):
        group.allreduce([torch.ones(1, device=device)]).wait()
        torch.cuda.synchronize()
        calls: list[float] = []
        waiter = None
        for index, buffer in enumerate(big):
            started = time.perf_counter()
            work = group.send([buffer], peer, 0) if rank == 0 else group.recv([buffer], peer, 0)
            calls.append(time.perf_counter() - started)
            if waiting and index == 0:
                finished = torch.cuda.Event(blocking=True)
                work.wait()
                finished.record()
                waiter = threading.Thread(target=finished.synchronize)
                waiter.start()
        torch.cuda.synchronize()
        if waiter is not None:
            waiter.join()
        out[f"queued_1gib_{'beside_a_waiter' if waiting else 'alone'}_us"] = median_us(calls[1:])
    del big
    out["event_create_record_us"], _ = timed(lambda: torch.cuda.Event().record())
    cached = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    del cached
    out["empty_1gib_cached_us"], _ = timed(lambda: torch.empty(1 << 30, dtype=torch.uint8, device=device).numel(), 50)
    other = 1 - rank
    out["exchange_device_us"], _ = timed(
        lambda: torch.cuda._exchange_device(other) and torch.cuda._exchange_device(rank), 20
    )
    results.put((rank, variant, out))


def main() -> int:
    import socket

    results = spawn.Queue()
    for variant in VARIANTS:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        ranks = [spawn.Process(target=rank_main, args=(rank, port, variant, results)) for rank in (0, 1)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(120)
    while not results.empty():
        rank, variant, out = results.get()
        print(f"rank {rank} {variant}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
