"""One thread that runs an asyncio event loop for callers on other threads: `kvrt.blocking`'s
objects each own one, and the vLLM connector's scheduler and worker sides theirs.

A caller either waits for a coroutine's result (`call`: interrupted or timed out, it cancels
the coroutine on the loop) or hands one over and goes on: `post` returns at once, whatever
the loop is doing (an engine's hot path: the scheduler's and the workers' hooks); `submit`
returns once the loop has taken the coroutine (anyio's `start_task_soon`: for rare calls).
Both give a concurrent future the caller may look at later. The loop thread owns every
coroutine it runs (the portal's task group, or its set of posts): `stop` cancels what still
runs. Each loop is watched while it runs (`kvrt._loop_watch`): its lag and its thread's time
are metrics, and a turn that came late is logged with where the thread's time went.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Final, Generic, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from kvrt._errors import ClosedError, InvalidInputError, KVRTError
from kvrt._loop_watch import LoopWatch, unwatch, watch_running_loop
from kvrt._threads import own_thread

log = logging.getLogger("kvrt.blocking")

CLOSE_TIMEOUT_S: Final = 30.0
"""The longest `stop` waits for the loop's thread to end, and `kvrt.blocking`'s `close()` for
the async side to say its byes."""

_T = TypeVar("_T")


class LoopThread:
    """One thread running an asyncio loop with a `BlockingPortal` in it, until `stop()`."""

    def __init__(self, name: str, kind: str, *, cores: frozenset[int] | None = None) -> None:
        """`cores`: the CPU cores the thread runs on, and the threads it starts (ZeroMQ's I/O
        threads, kvrt's workers) with it; None: those of the thread that makes it."""
        self._kind = kind
        started: concurrent.futures.Future[tuple[BlockingPortal, asyncio.AbstractEventLoop, LoopWatch]]
        started = concurrent.futures.Future()
        self._posts: set[asyncio.Task[None]] | None = set()
        """On the loop: the posted coroutines still running (None once stopping), which it owns."""
        # A daemon: a loop that a hung peer holds must not hold the interpreter's exit too.
        # It is stopped before that as a rule: by close(), by the owner's finalizer, at exit.
        self._thread = threading.Thread(target=self._run, args=(started, name, cores), name=name, daemon=True)
        self._thread.start()
        self._portal, self._event_loop, watch = started.result()
        self.watch = watch
        """The loop's lag and its thread's time (`kvrt._loop_watch`)."""
        self._stopping = threading.Lock()
        self._stopped = False

    def _run(
        self,
        started: concurrent.futures.Future[tuple[BlockingPortal, asyncio.AbstractEventLoop, LoopWatch]],
        name: str,
        cores: frozenset[int] | None,
    ) -> None:
        own_thread()

        async def serve() -> None:
            if cores is not None:
                try:
                    os.sched_setaffinity(0, cores)  # this thread's (on Linux 0 is the calling thread)
                except OSError as exc:
                    raise InvalidInputError(f"kvrt's threads cannot run on cores {sorted(cores)}: {exc}") from None
            watch = watch_running_loop(name)
            try:
                async with BlockingPortal() as portal:
                    started.set_result((portal, asyncio.get_running_loop(), watch))
                    await portal.sleep_until_stopped()
                    posts, self._posts = self._posts or set(), None
                    for task in posts:
                        task.cancel()
                    await asyncio.gather(*posts, return_exceptions=True)
            finally:
                unwatch(watch)

        try:
            anyio.run(serve, backend="asyncio")
        except BaseException as exc:  # handed to the constructor, or logged
            if not started.done():
                started.set_exception(exc)
            else:
                log.error("kvrt's loop thread ended with an error", exc_info=exc)

    @property
    def on_this_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def call(self, function: Callable[[], Awaitable[_T]], what: str, timeout_s: float | None = None) -> _T:
        """Run `function` on the loop and wait for its result in this thread.

        However this thread stops waiting (an interrupt such as Ctrl-C, `timeout_s`), the call
        on the loop is cancelled, also when the interrupt lands while the call is being handed
        over: the portal's own hand-over waits too, and its future is then never seen here.
        """
        if self.on_this_thread:
            raise KVRTError(f"{what}: kvrt.blocking was called on kvrt's own loop thread; use the async API there")
        task = CancellableCall(function)
        try:
            try:
                future = self._portal.start_task_soon(task.run)
            except RuntimeError:  # the portal has stopped: `close()` ran
                raise ClosedError(f"{what}: the {self._kind} is closed") from None
            return future.result(timeout_s)
        except concurrent.futures.CancelledError:
            raise ClosedError(f"{what}: the {self._kind} was closed while the call waited") from None
        except BaseException:
            # The call's own error (its task is done: nothing to cancel), or this thread was
            # interrupted or gave up while it waited: the call is cancelled on the loop. Not
            # through the portal, whose calls wait and so could be interrupted in their turn.
            try:
                self._event_loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                pass  # the loop has ended: nothing runs on it any more
            raise

    def post(self, function: Callable[[], Awaitable[_T]], what: str) -> concurrent.futures.Future[_T]:
        """Hand `function` to the loop and return at once, without waiting for the loop's thread
        (which may be busy, or waiting for the GIL): its future, done when it is (cancelled when
        the loop stops first; with `ClosedError` once it stopped). Posts run in the order they
        were posted."""
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        closed = f"{what}: the {self._kind} is closed"

        def start() -> None:  # on the loop
            if not future.set_running_or_notify_cancel():
                return
            if self._posts is None:  # stopping: no more are taken
                future.set_exception(ClosedError(closed))
                return
            task = self._event_loop.create_task(_run_into(function, future, closed), name=what)
            self._posts.add(task)
            task.add_done_callback(self._posts.discard)

        try:
            self._event_loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop has ended
            future.set_running_or_notify_cancel()
            future.set_exception(ClosedError(closed))
        return future

    def submit(self, function: Callable[[], Awaitable[_T]], what: str) -> concurrent.futures.Future[_T]:
        """Start `function` on the loop and return at once: its future, done when it is (with
        `ClosedError` once the loop stopped)."""
        try:
            return self._portal.start_task_soon(function)
        except RuntimeError:  # the portal has stopped
            failed: concurrent.futures.Future[_T] = concurrent.futures.Future()
            failed.set_exception(ClosedError(f"{what}: the {self._kind} is closed"))
            return failed

    def stop(self) -> None:
        """Cancel what still runs on the loop, end it and join the thread (idempotent)."""
        with self._stopping:
            if self._stopped:
                return
            self._stopped = True
            try:
                self._portal.call(self._portal.stop, True)
            except RuntimeError:
                pass  # stopped already
            self._thread.join(CLOSE_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("kvrt's loop thread %s did not end within %s s", self._thread.name, CLOSE_TIMEOUT_S)


async def _run_into(function: Callable[[], Awaitable[_T]], future: concurrent.futures.Future[_T], closed: str) -> None:
    """Run a posted coroutine and hand its outcome to its caller's future: its error too (the
    caller's to read), `ClosedError(closed)` when the loop stops first."""
    try:
        result = await function()
    except asyncio.CancelledError:
        future.set_exception(ClosedError(closed))
        raise
    except Exception as exc:  # the caller's, through its future
        future.set_exception(exc)
    else:
        future.set_result(result)


class CancellableCall(Generic[_T]):
    """A blocking call's coroutine on the loop, which `cancel()` (run on the loop) ends whether
    it has started yet or not."""

    def __init__(self, function: Callable[[], Awaitable[_T]]) -> None:
        self._function = function
        self._scope: anyio.CancelScope | None = None
        self._cancelled = False

    async def run(self) -> _T:
        with anyio.CancelScope() as scope:
            self._scope = scope
            if self._cancelled:
                scope.cancel()
            return await self._function()
        # Reached only when cancel() ended it: its caller has stopped waiting for a result.
        raise ClosedError("the call was cancelled by its caller")

    def cancel(self) -> None:
        self._cancelled = True
        if self._scope is not None:
            self._scope.cancel()
