"""Helpers the benchmarks share for their helper processes."""

from __future__ import annotations

import multiprocessing.connection
import multiprocessing.process
import socket
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
