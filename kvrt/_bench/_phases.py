"""Where one side's CPU goes, per request, by phase.

A side's CPU over its timed requests is split two ways. The event loop's own thread (the
Python work) against every other thread of the process (libzmq's I/O threads, kvrt's waiter
and worker threads), both clocked in the timed run. The loop thread's share is then split by
phase in proportion to a second, profiled run of the same requests (cProfile's own time per
function, grouped by where the function lives; time blocked in the selector's wait is not
CPU and is left out). The profiler slows every Python call alike, so its proportions stand
while its absolute times do not.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from dataclasses import dataclass, field
from typing import Final

PHASES: Final = (
    "ZeroMQ calls",
    "event loop",
    "protocol and messages",
    "kvrt driver",
    "transport",
    "torch",
    "caller",
)
"""The loop thread's phases, in print order ("caller": the benchmark's own code, what an
engine's code would be)."""

OTHER_THREADS: Final = "other threads"

_IDLE: Final = ("method 'poll' of 'select.epoll' objects", "method 'select' of 'select.")
"""The selector's wait: the loop thread blocked, not running."""

_HELPERS: Final = ("/enum.py", "/typing.py", "/functools.py", "/contextlib.py", "/abc.py", "/weakref.py")
"""Library helpers that belong to whoever calls them, as built-ins do."""

_Function = tuple[str, int, str]


def phase_of(where: str) -> str | None:
    """The phase of one profiled function, by its file; None for the selector's wait."""
    if any(idle in where for idle in _IDLE):
        return None
    if "kvrt/_bench/" in where:
        return "caller"
    if "/zmq/" in where or "kvrt/_zmqio.py" in where:
        return "ZeroMQ calls"
    if "/asyncio/" in where or "selectors.py" in where or "threading.py" in where:
        return "event loop"
    if "kvrt/_protocol/" in where or "kvrt/_messages.py" in where or "msgspec" in where:
        return "protocol and messages"
    if "/transports/" in where:
        return "transport"
    if "torch" in where or "kvrt/_tensors.py" in where or "numpy" in where:
        return "torch"
    if "/kvrt/" in where:
        return "kvrt driver"
    return "caller"


def _where(function: _Function) -> str:
    filename, line, name = function
    return name if filename == "~" else f"{filename}:{line}({name})"


def _belongs_to_caller(function: _Function) -> bool:
    """A built-in (its name says which library it is, but not which phase called it; those
    of zmq, torch, msgspec and the selector do), or a library helper."""
    filename, _, name = function
    if filename == "~":
        return not any(library in name for library in ("zmq.", "torch", "msgspec", *_IDLE))
    return filename.endswith(_HELPERS)


def profile_shares(profile: cProfile.Profile) -> dict[str, float]:
    """Each phase's fraction of the profiled loop thread's busy time. A built-in's or a library
    helper's own time is its callers', split as they called it."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    resolved: dict[_Function, dict[str, float]] = {}

    def phases(function: _Function, depth: int) -> dict[str, float]:
        if function in resolved:
            return resolved[function]
        if not _belongs_to_caller(function):
            phase = phase_of(_where(function))
            found = {} if phase is None else {phase: 1.0}
        else:
            callers = stats.get(function, (0, 0, 0.0, 0.0, {}))[4]
            by_call = sum(entry[2] for entry in callers.values())
            found = {}
            if depth < 8 and by_call > 0:
                for caller, entry in callers.items():
                    for phase, part in phases(caller, depth + 1).items():
                        found[phase] = found.get(phase, 0.0) + part * entry[2] / by_call
            if not found:
                found = {"caller": 1.0}
        resolved[function] = found
        return found

    spent = dict.fromkeys(PHASES, 0.0)
    for function, (_, _, own_s, _, _) in stats.items():
        for phase, part in phases(function, 0).items():
            spent[phase] += own_s * part
    busy = sum(spent.values())
    return {phase: (seconds / busy if busy else 0.0) for phase, seconds in spent.items()}


@dataclass
class SideClock:
    """One side's CPU over a window of requests: its whole process and its loop's thread
    (start and stop it on that thread); with `profiled`, the loop thread's phases too."""

    profiled: bool = False
    process_s: float = 0.0
    loop_s: float = 0.0
    shares: dict[str, float] | None = None
    _profile: cProfile.Profile | None = field(default=None, repr=False)

    def start(self) -> None:
        if self.profiled:
            self._profile = cProfile.Profile()
        self.process_s, self.loop_s = time.process_time(), time.thread_time()
        if self._profile is not None:
            self._profile.enable()

    def stop(self) -> SideClock:
        if self._profile is not None:
            self._profile.disable()
        self.process_s, self.loop_s = time.process_time() - self.process_s, time.thread_time() - self.loop_s
        if self._profile is not None:
            self.shares = profile_shares(self._profile)
            self._profile = None
        return self


def per_request_us(timed: SideClock, profiled: SideClock, requests: int) -> dict[str, float]:
    """µs a request by phase: the timed run's loop-thread CPU split as the profiled run's, and
    the rest of the process as `OTHER_THREADS`."""
    shares = profiled.shares or {}
    loop_us = timed.loop_s / requests * 1e6
    spent = {phase: shares.get(phase, 0.0) * loop_us for phase in PHASES}
    spent[OTHER_THREADS] = max(0.0, timed.process_s - timed.loop_s) / requests * 1e6
    return spent


def breakdown_line(side: str, spent: dict[str, float]) -> str:
    """One side's phases as a line of text, largest first."""
    total = sum(spent.values())
    parts = ", ".join(f"{phase} {us:.0f}" for phase, us in sorted(spent.items(), key=lambda kv: -kv[1]) if us >= 0.5)
    return f"{side} {total:.0f} µs: {parts}"
