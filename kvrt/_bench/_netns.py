"""Two hosts on one machine: two network namespaces joined by a veth pair whose rate `tc`'s
token bucket filter (`tbf`) holds, each way, to what a link between hosts would carry.

    reason = unavailable()                       # None where namespaces can be made (root, ip, tc)
    with shaped_link(rate_bits_per_s) as link:   # made, then removed whatever happens
        enter(link.a)                            # this thread, and the threads it starts, in host a
        link.address_a, link.address_b           # each host's address on the link

A process is placed on a host by calling `enter` first thing (a spawned benchmark process) or
by starting it from a thread that entered (`subprocess` inherits the thread's namespace).
Names are unique per run (`kvrt` and the creating process's id); namespaces left by a run
that was killed before it could remove them are removed by the next run (their creator is
gone), so a host never collects them.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Final

NETNS_DIR: Final = Path("/run/netns")
"""Where `ip netns` keeps its namespaces."""
PREFIX: Final = "kvrt"
ADDRESS_A: Final = "10.231.0.1"
ADDRESS_B: Final = "10.231.0.2"
"""The link's addresses (each namespace is a world of its own: no clash with the machine's)."""
BURST_BYTES: Final = 1 << 20
"""The token bucket's depth: at least a GSO packet of the veth (64 KiB), and a millisecond at
the rates used (4 Gbit/s: 500 KB), so that the bucket, not the timer tick, sets the rate."""
QUEUE_LATENCY_MS: Final = 20
"""How long a packet may wait in the shaper's queue before it is dropped (its queue's size)."""
COMMAND_S: Final = 20.0
PROBE_RATE_BITS_PER_S: Final = 1_000_000_000
_CLONE_NEWNET: Final = 0x40000000


@dataclass(frozen=True)
class Link:
    """Two namespaces (`a`, `b`) and the addresses of the veth pair's two ends in them."""

    a: str
    b: str
    address_a: str
    address_b: str
    rate_bits_per_s: int
    device_a: str
    device_b: str


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_S, check=False)


def _checked(*command: str) -> None:
    done = _run(*command)
    if done.returncode != 0:
        raise OSError(f"`{' '.join(command)}` failed ({done.returncode}): {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why two hosts joined by a shaped link cannot be made here (not root, no `ip` or `tc`,
    or the kernel refuses namespaces, veth pairs or `tbf`), or None when they can: a link is
    made and removed to find out."""
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    try:
        with shaped_link(PROBE_RATE_BITS_PER_S):
            pass
    except OSError as exc:
        return str(exc)
    return None


def _creator(name: str) -> int | None:
    """The process id a namespace of ours was made by (its name says), or None."""
    digits = name.removeprefix(PREFIX)
    digits = digits[: len(digits) - len(digits.lstrip("0123456789"))]
    return int(digits) if digits and name.startswith(PREFIX) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans() -> list[str]:
    """Remove the namespaces of ours whose creating process is gone (a run killed before it
    removed them); their veth ends go with them. The names removed."""
    if not NETNS_DIR.is_dir():
        return []
    removed = []
    for entry in NETNS_DIR.iterdir():
        pid = _creator(entry.name)
        if pid is not None and not _alive(pid):
            _run("ip", "netns", "delete", entry.name)
            removed.append(entry.name)
    return removed


@contextmanager
def shaped_link(rate_bits_per_s: int, mtu: int = 1500) -> Iterator[Link]:
    """Two namespaces joined by a veth pair, each end's egress held to `rate_bits_per_s` by a
    `tbf` qdisc, loopback up in both. Removed (namespaces, veth, qdiscs) when the block ends,
    however it ends. Raises OSError if a command fails (nothing is left behind then either)."""
    remove_orphans()
    tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
    # The veth ends are made inside their namespaces (never in the machine's), so their names
    # are the same every run.
    link = Link(f"{tag}a", f"{tag}b", ADDRESS_A, ADDRESS_B, rate_bits_per_s, "kvrta", "kvrtb")
    made: list[str] = []
    try:
        for namespace in (link.a, link.b):
            _checked("ip", "netns", "add", namespace)
            made.append(namespace)
        _checked("ip", "link", "add", link.device_a, "netns", link.a, "mtu", str(mtu), "type", "veth",
                 "peer", "name", link.device_b, "netns", link.b, "mtu", str(mtu))  # fmt: skip
        rate = f"{rate_bits_per_s}bit"
        ends = ((link.a, link.device_a, link.address_a), (link.b, link.device_b, link.address_b))
        for namespace, device, address in ends:
            _checked("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", device)
            _checked("ip", "-n", namespace, "link", "set", device, "up")
            _checked("ip", "-n", namespace, "link", "set", "lo", "up")
            _checked("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
                     "burst", str(BURST_BYTES), "latency", f"{QUEUE_LATENCY_MS}ms")  # fmt: skip
        yield link
    finally:
        for namespace in made:
            _run("ip", "netns", "delete", namespace)


def enter(namespace: str) -> None:
    """Move the calling thread into `namespace`'s network (threads and processes it starts
    afterwards are there too). Call it before the thread opens any socket."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(NETNS_DIR / namespace, "rb") as handle:
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {namespace}: {os.strerror(error)}")


@contextmanager
def entered(namespace: str) -> Iterator[None]:
    """The calling thread in `namespace` for the block, back in its own network after."""
    with open("/proc/thread-self/ns/net", "rb") as own:
        enter(namespace)
        try:
            yield
        finally:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(own.fileno(), _CLONE_NEWNET) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"setns back: {os.strerror(error)}")
