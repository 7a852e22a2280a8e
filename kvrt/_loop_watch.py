"""Where a kvrt event loop's time goes: how late each turn of it comes, and what its thread did
meanwhile, so that "which side starved" has an answer from kvrt's own output.

A `LoopWatch` lives on one running loop (kvrt's loop threads, `kvrt.blocking`'s and the vLLM
connector's, each watch their own; a producer or consumer started in an application's loop
watches that one while it runs). Every `LOOP_WATCH_INTERVAL_S` a timer on the loop notes how
late it fired (the loop's lag: the loop was busy with other callbacks, or its thread was not
running) and the thread's own counters since the last turn:

    cpu        the time the loop's thread ran on a core
    runqueue   the time it was ready to run and waited for a core (Linux: schedstat)
    neither    the rest: it waited for the GIL (another thread of the process held it), or a
               call blocked it (a lock, a system call); or the loop slept, as it should

A turn later than `LOOP_LAG_LOG_S` is logged (at most once per `LOOP_LAG_LOG_EVERY_S` per
loop, the turns in between counted in the next line) with those figures over the window it
covers and the whole process's CPU in it; every turn is counted for the metrics
(`kvrt_loop_*` in `kvrt._metrics`: lag histogram, CPU, runqueue, late turns). The timer
costs a few tens of microseconds a turn; it reads, never holds, the loop.

A loop that stalls past a timeout's deadline (its thread waited for a core or for the GIL)
would blame the peer for time this side was not listening: the answer may have come, and sit
unread. `ListeningTimer` and `fail_after_listening` are timeouts that, firing late, wait again
for as long as they were late, so that what arrived meanwhile is read first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import anyio

log = logging.getLogger("kvrt.loop")

LOOP_WATCH_INTERVAL_S: Final = 0.1
"""How often a watched loop's timer is due: its lag is measured at this grain."""

LOOP_LAG_LOG_S: Final = 0.25
"""A turn of a loop that came later than this is logged (a tenth of the connector's default
lookup timeout: well before a peer gives up on it)."""

LOOP_LAG_LOG_EVERY_S: Final = 5.0
"""At most one log line per loop this often; the late turns in between are summed into it."""

LAG_BUCKETS_S: Final = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)

_SCHEDSTAT: Final = Path("/proc/thread-self/schedstat")
"""Linux: the calling thread's time on a core and waiting for one, in nanoseconds."""


def _runqueue_s() -> float | None:
    """The calling thread's time spent ready to run and waiting for a core (None where the
    kernel does not say)."""
    try:
        fields = _SCHEDSTAT.read_text().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class LoopWatch:
    """One loop's lag and its thread's time (see the module docstring). Made and started on
    the loop's thread (`start`); stopped there (`stop`). Its totals are read by scrapes on
    any thread: plain numbers, each written by the loop's thread alone."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self.name = name
        """What runs on the loop, for logs and the metrics' `loop` label."""
        self.loop = loop
        self._handle: asyncio.TimerHandle | None = None
        self.thread_id = 0
        """The loop's thread's native id (as `top -H` and /proc show it)."""
        self.turns = 0
        self.late_turns = 0
        """Turns later than `LOOP_LAG_LOG_S`."""
        self.lag_s = 0.0
        """The sum of every turn's lateness."""
        self.max_lag_s = 0.0
        self.cpu_s = 0.0
        """The loop's thread's CPU time since the watch started."""
        self.runqueue_s: float | None = None
        """Its time waiting for a core since the watch started (None: the kernel does not say)."""
        self.lag_counts = [0] * (len(LAG_BUCKETS_S) + 1)
        """Turns by lateness, one count per bucket of `LAG_BUCKETS_S` (the last: above them)."""
        self._due = 0.0
        self._at = 0.0
        self._cpu_at = 0.0
        self._runqueue_at: float | None = None
        self._process_at = 0.0
        self._logged_at = -LOOP_LAG_LOG_EVERY_S
        self._unlogged = 0
        self._unlogged_max_s = 0.0

    def start(self) -> None:
        """Start watching (on the loop's thread)."""
        self.thread_id = threading.get_native_id()
        self._at = time.monotonic()
        self._cpu_at = time.thread_time()
        self._runqueue_at = _runqueue_s()
        self.runqueue_s = None if self._runqueue_at is None else 0.0
        self._process_at = time.process_time()
        self._schedule()
        _watches.add(self)

    def stop(self) -> None:
        """Stop watching (on the loop's thread; idempotent)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        _watches.discard(self)

    def stop_soon(self) -> None:
        """`stop`, from any thread: at once on the loop's own, else as the loop's next callback
        (nothing to stop once the loop has closed)."""
        if threading.get_native_id() == self.thread_id:
            self.stop()
            return
        _watches.discard(self)
        try:
            self.loop.call_soon_threadsafe(self.stop)
        except RuntimeError:
            pass  # the loop is closed: its timer will never run again

    def _schedule(self) -> None:
        self._due = self.loop.time() + LOOP_WATCH_INTERVAL_S
        self._handle = self.loop.call_at(self._due, self._turn)

    def _turn(self) -> None:
        lag = max(0.0, self.loop.time() - self._due)
        at, cpu, process, runqueue = time.monotonic(), time.thread_time(), time.process_time(), _runqueue_s()
        window, ran = at - self._at, cpu - self._cpu_at
        waited = None if runqueue is None or self._runqueue_at is None else runqueue - self._runqueue_at
        self.turns += 1
        self.lag_s += lag
        self.max_lag_s = max(self.max_lag_s, lag)
        self.cpu_s += ran
        if waited is not None and self.runqueue_s is not None:
            self.runqueue_s += waited
        bucket = 0
        while bucket < len(LAG_BUCKETS_S) and lag > LAG_BUCKETS_S[bucket]:
            bucket += 1
        self.lag_counts[bucket] += 1
        if lag > LOOP_LAG_LOG_S:
            self.late_turns += 1
            self._late(lag, window, ran, waited, process - self._process_at, at)
        self._at, self._cpu_at, self._runqueue_at, self._process_at = at, cpu, runqueue, process
        self._schedule()

    def _late(self, lag: float, window: float, ran: float, waited: float | None, process: float, at: float) -> None:
        if at - self._logged_at < LOOP_LAG_LOG_EVERY_S:
            self._unlogged += 1
            self._unlogged_max_s = max(self._unlogged_max_s, lag)
            return
        others = ""
        if self._unlogged:
            others = (
                f"; {self._unlogged} more turns were late since the last line, by {self._unlogged_max_s:.2f} s at most"
            )
        self._logged_at, self._unlogged, self._unlogged_max_s = at, 0, 0.0
        # Of the window, the loop slept until the turn was due (the interval at most); the rest
        # the thread ran, waited for a core, or neither: it waited for the GIL held by another
        # thread of the process, or in a call that blocked it.
        if waited is None:
            spent = f"its thread ran {ran:.2f} s on a core"
        else:
            neither = max(0.0, window - LOOP_WATCH_INTERVAL_S - ran - waited)
            spent = (
                f"its thread ran {ran:.2f} s on a core, waited {waited:.2f} s for one, and {neither:.2f} s for "
                "neither (for the GIL, held by another thread of this process, or in a call that blocked it)"
            )
        log.warning(
            "kvrt's loop %r (thread %d of process %d) came %.2f s late for a turn; over the last %.2f s %s; this "
            "process used %.2f s of CPU meanwhile%s",
            self.name, self.thread_id, os.getpid(), lag, window, spent, process, others,
        )  # fmt: skip


_watches: weakref.WeakSet[LoopWatch] = weakref.WeakSet()
_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWatch] = weakref.WeakKeyDictionary()
_owners: weakref.WeakKeyDictionary[LoopWatch, int] = weakref.WeakKeyDictionary()
_registry = threading.Lock()


def watches() -> list[LoopWatch]:
    """Every loop watched in this process now."""
    return list(_watches)


def watch_running_loop(name: str | None = None) -> LoopWatch:
    """Watch the running loop (called on its thread), named `name` (default: its thread's
    name), or count one more owner of the watch it has; each call is matched by one `unwatch`."""
    loop = asyncio.get_running_loop()
    with _registry:
        watch = _by_loop.get(loop)
        if watch is None:
            watch = _by_loop[loop] = LoopWatch(loop, name or threading.current_thread().name)
            watch.start()
        _owners[watch] = _owners.get(watch, 0) + 1
        return watch


def unwatch(watch: LoopWatch) -> None:
    """One owner of `watch` is done with it (from any thread): the last one stops it."""
    with _registry:
        owners = _owners.get(watch, 0) - 1
        if owners > 0:
            _owners[watch] = owners
            return
        _owners.pop(watch, None)
        if _by_loop.get(watch.loop) is watch:
            del _by_loop[watch.loop]
    watch.stop_soon()


class WatchIntervals:
    """A watch's figures since the last `take`, for a reporter that sends intervals (vLLM's
    connector stats): lag, late turns, CPU and time waiting for a core, under `prefix`."""

    def __init__(self, watch: LoopWatch, prefix: str) -> None:
        self._watch = watch
        self._prefix = prefix
        self._taken = self._totals()
        self._taken_at = time.monotonic()

    def _totals(self) -> dict[str, float]:
        watch = self._watch
        return {
            "loop_lag_seconds": watch.lag_s, "loop_late_turns": float(watch.late_turns),
            "loop_cpu_seconds": watch.cpu_s, "loop_runqueue_seconds": watch.runqueue_s or 0.0,
        }  # fmt: skip

    def take(self, every_s: float) -> dict[str, float]:
        """What changed since the last call, once `every_s` passed since it (else nothing)."""
        now = time.monotonic()
        if now - self._taken_at < every_s:
            return {}
        totals, taken = self._totals(), self._taken
        self._taken, self._taken_at = totals, now
        return {self._prefix + name: value - taken[name] for name, value in totals.items()}


STALL_GRACE_S: Final = 0.05
"""A timer that fires later than this was held up by its own loop (busy, or its thread not
running): a timeout that blames a peer then waits again, as long as it was late."""


class ListeningTimer:
    """`loop.call_later` for a timeout that blames a peer, counting only the time this side
    was listening: one that fires late (its loop stalled past it, while what the peer sent
    may sit unread) waits again for as long as it was late, so that what came meanwhile is
    read first; up to `delay_s` more in all, so that a loop starved for good still ends the
    wait. Made and cancelled on the loop's thread."""

    __slots__ = ("_args", "_callback", "_due", "_handle", "_loop", "_spare_s")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, delay_s: float, callback: Callable[..., object], *args: object
    ) -> None:
        self._loop = loop
        self._callback = callback
        self._args = args
        self._spare_s = delay_s
        self._due = loop.time() + delay_s
        self._handle = loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        late = self._loop.time() - self._due
        if late > STALL_GRACE_S and self._spare_s > 0:
            again = min(late, self._spare_s)
            self._spare_s -= again
            self._due = self._loop.time() + again
            self._handle = self._loop.call_at(self._due, self._fire)
            return
        self._callback(*self._args)

    def cancel(self) -> None:
        self._handle.cancel()


@contextlib.contextmanager
def fail_after_listening(timeout_s: float) -> Iterator[anyio.CancelScope]:
    """`anyio.fail_after` (raises `TimeoutError`) whose deadline is a `ListeningTimer`: a
    stall of this side's loop past it is not counted against the peer it waits for."""
    scope = anyio.CancelScope()
    with scope:
        timer = ListeningTimer(asyncio.get_running_loop(), timeout_s, scope.cancel)
        try:
            yield scope
        finally:
            timer.cancel()
    if scope.cancelled_caught:
        raise TimeoutError
