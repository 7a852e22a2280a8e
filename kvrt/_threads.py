"""Worker threads that queue GPU work off the event loop."""

from __future__ import annotations

import concurrent.futures

import torch


def gpu_worker(device: torch.device, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """One thread, for work that must stay in order, with `device` current for good (made
    current once, not switched per call). It queues kernels without the loop waiting: a
    first Triton launch compiles, for about a second."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=torch.cuda.set_device, initargs=(device,)
    )
