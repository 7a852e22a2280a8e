"""Helpers the benchmarks share for their helper processes."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import socket
from collections.abc import Callable
from typing import Any

JOIN_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for a store or a process group)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def join(*processes: multiprocessing.process.BaseProcess) -> None:
    """Wait for helper processes to end; kill those that do not within the timeout."""
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()


def from_child(control: multiprocessing.connection.Connection, timeout_s: float = 180) -> Any:
    """A helper process's next message; an error, not a hang, if it died."""
    if not control.poll(timeout_s):
        raise RuntimeError(f"the benchmark's helper process said nothing for {timeout_s} s")
    return control.recv()


def start_producer(
    target: Callable[[int, multiprocessing.connection.Connection], None], name: str
) -> tuple[Any, int, multiprocessing.connection.Connection, multiprocessing.process.BaseProcess]:
    """A two-GPU benchmark's producer process, spawned as `target(store_port, control)`, and
    the TCPStore this process hosts for the pair's raw process group: (store, its port, the
    control pipe, the process). The store must stay referenced until the process ended."""
    from torch._C._distributed_c10d import TCPStore

    spawn = multiprocessing.get_context("spawn")
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    control, child = spawn.Pipe()
    process = spawn.Process(target=target, args=(port, child), name=name)
    process.start()
    return store, port, control, process
