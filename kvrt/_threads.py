"""Worker threads that queue GPU work off the event loop."""

from __future__ import annotations

import concurrent.futures

import torch


def gpu_worker(device: torch.device, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """One thread, for work that must stay in order, with `device` current for good: making a
    device current costs milliseconds a time on an H200 host, so it is done once, not per call.
    It queues kernels (a first Triton launch compiles, for about a second) without the loop
    waiting."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=torch.cuda.set_device, initargs=(device,)
    )
