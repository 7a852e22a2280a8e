"""Driving a ZeroMQ socket from asyncio: non-blocking socket calls, and one wait on its FD.

ZeroMQ's file descriptor is edge-triggered: it signals that libzmq has *commands* to
process, not that a message is waiting, and any socket call (a send too) may process
them and swallow the signal. Mixing pyzmq's asyncio futures with direct calls on the same
socket therefore loses wakeups, and cancelling a pending future receive can lose a
message that arrived in the same loop iteration. So kvrt does neither:

* every socket call is non-blocking, made on the loop's thread;
* `_ready` is set by a reader on the FD, and by any call that may have swallowed a signal
  another task was waiting for (a send checks `EVENTS` afterwards and wakes the receiver
  only if a message is really there); a waiter clears it, re-checks `EVENTS`, then waits;
* waiting on an `asyncio.Event` can be cancelled or timed out without losing anything.

Under load this also saves most of the loop's work: after one wakeup, `drain` takes
everything already queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final, cast

import zmq

MAX_BATCH: Final = 64
"""Most messages taken per wakeup, so deadlines are still checked under a flood."""

Frames = Sequence[bytes | memoryview | zmq.Frame]


class SocketIO:
    """Asyncio waits for one ZeroMQ socket. Create it, use it and close it on one event loop."""

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self.socket = socket
        self._loop = asyncio.get_running_loop()
        self._fd = cast(int, socket.getsockopt(zmq.FD))
        self._ready = asyncio.Event()
        self._loop.add_reader(self._fd, self._ready.set)
        self._blocked_senders = 0
        self._closed = False

    async def next(self, deadline: float | None) -> list[zmq.Frame] | None:
        """The next multipart message, or None once `deadline` (loop time) has passed."""
        while True:
            try:
                return self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
            if not await self._wait(zmq.POLLIN, deadline):
                return None

    def drain(self) -> list[list[zmq.Frame]]:
        """Messages already queued, taken without waiting."""
        batch: list[list[zmq.Frame]] = []
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self.socket.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
        if self._blocked_senders:
            self._ready.set()  # the reads may have swallowed the signal that room to send was made
        return batch

    async def send(self, frames: Frames, deadline: float | None = None) -> bool:
        """Send a multipart message, waiting while the queue is full; False if `deadline` passed."""
        while not self.send_nowait(frames):
            self._blocked_senders += 1
            try:
                if not await self._wait(zmq.POLLOUT, deadline):
                    return False
            finally:
                self._blocked_senders -= 1
        return True

    def send_nowait(self, frames: Frames) -> bool:
        """Send if the queue has room; False if it has none."""
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False
        finally:
            # The send may have swallowed the FD's signal for a message that arrived.
            if self._events() & zmq.POLLIN:
                self._ready.set()

    async def _wait(self, event: int, deadline: float | None) -> bool:
        """Wait until the socket may have `event`; False once `deadline` has passed."""
        self._ready.clear()
        if self._events() & event:
            return True
        loop = self._loop
        if deadline is not None and deadline <= loop.time():
            return False
        timer = None if deadline is None else loop.call_at(deadline, self._ready.set)
        try:
            await self._ready.wait()
        finally:
            if timer is not None:
                timer.cancel()
        return deadline is None or loop.time() < deadline or bool(self._events() & event)

    def _events(self) -> int:
        return cast(int, self.socket.getsockopt(zmq.EVENTS))

    def close(self) -> None:
        """Stop watching the FD (before the socket is closed)."""
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)
