"""Threads kvrt owns: workers that queue GPU work off the event loop, a waiter for transfers,
and daemon threads for set-ups that wait on a peer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, Final, Protocol, TypeVar, overload

import torch

from kvrt._errors import TransportUnavailableError
from kvrt._heap import libc

_T = TypeVar("_T")


_OPENMP_RUNTIMES: Final = ("libgomp", "libiomp5", "libomp")


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs its host operations on, as loaded in this process."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return None
    for path in sorted(paths):
        if any(runtime in os.path.basename(path) for runtime in _OPENMP_RUNTIMES):
            with contextlib.suppress(OSError, AttributeError):
                runtime = ctypes.CDLL(path)
                runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
                return runtime
    return None


_PR_SET_NAME: Final = 15
"""Linux's `prctl` option that names the calling thread (16 bytes with the terminating NUL)."""


def own_thread() -> None:
    """Set up a thread kvrt started, on it, first thing: its name for the OS is its Python
    name (Linux keeps 15 bytes of it), so that `top -H`, `ps -L` and /proc show which of
    kvrt's threads takes a core in an engine's process, not a row of "python"; and torch's
    host operations on it run on it alone (`host_ops_on_this_thread`)."""
    c_library = libc()
    if c_library is not None and sys.platform == "linux":
        c_library.prctl(_PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0)
    host_ops_on_this_thread()


def host_ops_on_this_thread() -> None:
    """Make torch's host operations on the calling thread (one of kvrt's) run on it alone.

    kvrt moves a request's bytes on the host in copies of tens of kilobytes to a few
    megabytes, which torch splits over its OpenMP team. In an engine's process that team's
    other threads are the engine's (bound to its cores, busy with forward passes): a copy
    waits at the team's barrier for a thread the OS has not scheduled, tens of milliseconds
    on a busy host where alone it takes tens of microseconds. OpenMP's thread count is a
    setting of each thread, so this changes kvrt's own threads and none of the engine's
    (`torch.set_num_threads` would change the count new threads start with too)."""
    torch.get_num_threads()  # torch sets a thread's count at its first use: before, not after this
    runtime = _openmp()
    if runtime is not None:
        runtime.omp_set_num_threads(1)


def gpu_worker(device: torch.device, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """One thread, for work that must stay in order, with `device` current for good (made
    current once, not switched per call). It queues kernels without the loop waiting: a
    first Triton launch compiles, for about a second."""

    def start() -> None:
        own_thread()
        torch.cuda.set_device(device)

    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=start)


def host_worker(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """One thread, for host work that must stay in order (its torch operations on it alone)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=own_thread)


CHECK_WORKERS: Final = 2


class CheckWorkers:
    """One link's workers for checks of what landed (`CHECK_WORKERS` threads, started as the
    first check comes): one producer's checks never wait behind another's. Never the
    application's default executor, which it may fill with its own work, or wait in for one
    of kvrt's calls."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                CHECK_WORKERS, thread_name_prefix="kvrt-check", initializer=own_thread
            )
        return self._pool

    def submit(self, job: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        return self.executor.submit(job)

    def close(self) -> None:
        """The threads end once the checks already queued have run (nobody waits for them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)


MAX_DAEMON_JOBS: Final = 256
"""Most jobs `in_daemon_thread` runs at once; past it a job fails at once (`TransportUnavailableError`)."""
_daemon_jobs = 0
_daemon_jobs_lock = threading.Lock()


def in_daemon_thread(job: Callable[[], _T], name: str) -> concurrent.futures.Future[_T]:
    """Run `job` on a thread of its own that does not hold the interpreter's exit: a set-up
    that blocks on a peer which may never come (a pair's rendezvous waits up to its store's
    timeout), so that one stuck job neither delays the others nor the process's end."""
    global _daemon_jobs
    future: concurrent.futures.Future[_T] = concurrent.futures.Future()
    with _daemon_jobs_lock:
        if _daemon_jobs >= MAX_DAEMON_JOBS:
            future.set_exception(TransportUnavailableError(f"{MAX_DAEMON_JOBS} set-ups are waiting for their peers"))
            return future
        _daemon_jobs += 1

    def run() -> None:
        global _daemon_jobs
        own_thread()
        try:
            if future.set_running_or_notify_cancel():
                try:
                    result = job()
                except BaseException as error:  # the future's to report
                    future.set_exception(error)
                else:
                    future.set_result(result)
        finally:
            with _daemon_jobs_lock:
                _daemon_jobs -= 1

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class PreparedLaunch(Protocol):
    """A Triton launch worked out but not queued (`PreparedGather`, `PreparedCopy`)."""

    @property
    def compiled(self) -> bool: ...

    def launch(self) -> None: ...


async def launch_on(
    prepared: PreparedLaunch, stream: torch.cuda.Stream, thread: Callable[[], concurrent.futures.Executor]
) -> None:
    """Queue `prepared` on `stream`: from the loop when its kernel was compiled before, else in
    `thread` (a first launch compiles, for about a second, and the loop must not wait that
    long). Either way it is queued when this returns, before what the caller queues next."""
    if prepared.compiled:
        with torch.cuda.stream(stream):
            prepared.launch()
        return

    def launch() -> None:
        with torch.cuda.stream(stream):
            prepared.launch()

    await asyncio.wrap_future(thread().submit(launch))


class WaitThread:
    """One kvrt-owned thread that runs blocking waits in order (a transfer's completion), each
    resolving an asyncio future on its loop when it returns.

    Leaner than an executor plus `asyncio.wrap_future` (no concurrent future, no condition
    variable, one callback onto the loop), which a transfer pays once on the loop's thread.
    And what a wait closes over is freed here, on this thread: an NCCL work, when freed,
    drops its tensors from C++, which takes the GIL back while the loop may be wanting it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], asyncio.Future[Any], object] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._closed = False

    @overload
    def wait(self, blocking: Callable[[], object]) -> asyncio.Future[None]: ...
    @overload
    def wait(self, blocking: Callable[[], object], result: _T) -> asyncio.Future[_T]: ...
    def wait(self, blocking: Callable[[], object], result: object = None) -> asyncio.Future[Any]:
        """Run `blocking` on the thread after the waits queued before it; the future is done
        with `result` (or failed with its error) once it returned. Call from the event loop.
        A caller completes its own work from the future's callbacks: no task, no extra hop."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._closed:
            future.set_exception(RuntimeError(f"{self._name} is closed"))
            return future
        if self._thread is None:
            # A daemon: a wait on a GPU whose peer died must not hold the interpreter's exit.
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put((blocking, future, result))
        return future

    def close(self) -> None:
        """End the thread once the waits already queued have run."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    def _run(self) -> None:
        own_thread()
        while (job := self._jobs.get()) is not None:
            blocking, future, result = job
            del job
            error: BaseException | None = None
            try:
                blocking()
            except BaseException as raised:  # handed to the waiting task, whatever it is
                error = raised
            del blocking  # the closure and what it holds are freed here, off the loop
            settle_soon(future, result, error)
            del future, result, error


def settle_soon(future: asyncio.Future[Any], result: object, error: BaseException | None) -> None:
    """From any thread: settle `future` on its loop with `result`, or `error` when not None,
    unless it is done by then (a closed loop: nobody waits any more)."""
    with contextlib.suppress(RuntimeError):
        future.get_loop().call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[Any], result: object, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def pass_outcome(into: asyncio.Future[_T], source: asyncio.Future[_T]) -> None:
    """A done-callback of `source` that completes `into` as `source` ended (cancelled, failed or
    done), unless `into` ended first: then what `source` raised counts as seen."""
    if into.done():
        outcome_seen(source)
    elif source.cancelled():
        into.cancel()
    elif (error := source.exception()) is not None:
        into.set_exception(error)
    else:
        into.set_result(source.result())


def outcome_seen(future: asyncio.Future[Any]) -> None:
    """A done-callback for a future nobody awaits: its exception counts as retrieved (asyncio
    logs one that never was)."""
    if not future.cancelled():
        future.exception()
