"""The gathers of a published item (dp > 1 or paged pools): planned at publish, queued on
the gather thread off the loop, awaited by the send. `_publish` creates them, `_serve` waits on them.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvrt._item_bytes import GathersFailed

if TYPE_CHECKING:  # the kernels import Triton: only when pools are used
    from kvrt.kernels.paged_kv import PreparedGather


class _Gathers:
    """A published item's gathers in send order, each followed by its event. `publish` plans
    them while the index ranges travel back from the device; else the first `prepare` does
    (the send path's, right after the Deliver header left, or `publish`'s once the item is
    buffered), so that the header never waits for the planning alone.

    When every launch was compiled before, they are queued on the loop, each right before the
    sends of its bytes, so the first chunk is on the wire before the last is even gathered.
    Else a worker thread queues them all, once the item's first send or `publish` asks: a
    first launch compiles, for about a second, and the loop must not wait for that.
    """

    def __init__(
        self,
        plan: Callable[[], list[PreparedGather]],
        ready: list[torch.cuda.Event],
        stream: torch.cuda.Stream,
        thread: Callable[[], concurrent.futures.Executor],
    ) -> None:
        self._plan = plan
        self._launches: list[PreparedGather] = []
        self._ready = ready
        self._stream = stream
        self._thread = thread
        self._compiled: bool | None = None
        self._queued = 0
        self._in_thread: concurrent.futures.Future[None] | None = None
        self._failure: BaseException | None = None

    def plan(self) -> None:
        """Plan the launches now (else the first `prepare` does); a failure is kept for it."""
        if self._compiled is None and self._failure is None:
            try:
                self._launches = self._plan()
                self._compiled = all(launch.compiled for launch in self._launches)
            except Exception as exc:  # a plan that cannot be made fails every send, and publish
                self._failure = exc

    def prepare(self) -> concurrent.futures.Future[None] | None:
        """The worker thread's queuing of every gather, started on the first call, when they
        must compile; None when the loop queues them."""
        self.plan()
        self._raise_failure()
        if not self._compiled and self._in_thread is None:
            self._in_thread = self._thread().submit(self._queue, None)
        return self._in_thread

    def queue_through(self, gather: int | None) -> None:
        self.prepare()
        if self._in_thread is not None:
            assert self._in_thread.done(), "a send waits for the gather thread before queuing"
            failure = self._in_thread.exception()
            if failure is not None:
                raise GathersFailed(str(failure)) from failure
            return
        try:
            self._queue(gather)
        except Exception as exc:
            self._failure = exc
            self._raise_failure()

    def _queue(self, through: int | None) -> None:
        launches = self._launches
        last = len(launches) - 1 if through is None else through
        with torch.cuda.stream(self._stream):
            while self._queued <= last:
                launches[self._queued].launch()
                self._ready[self._queued].record(self._stream)
                self._queued += 1

    @property
    def failed(self) -> bool:
        """Whether queuing these gathers failed (the item's bytes never come)."""
        in_thread = self._in_thread
        return self._failure is not None or (
            in_thread is not None and in_thread.done() and in_thread.exception() is not None
        )

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise GathersFailed(str(self._failure)) from self._failure
