"""Receiving from a ZeroMQ socket with a deadline, without ever losing a message.

Cancelling a pending `recv_multipart` is not safe: when the deadline fires in the same
loop iteration as the message arrives, the message is already off the socket and the
cancellation throws it away. `FrameReader` instead keeps one receive outstanding and
waits on it with `asyncio.wait`, which leaves it running when the deadline passes; the
next call picks it up.
"""

from __future__ import annotations

import asyncio
from typing import cast

import zmq
import zmq.asyncio


class FrameReader:
    """The owner's one outstanding receive on `socket`. Only one task may call `next`."""

    def __init__(self, socket: zmq.asyncio.Socket) -> None:
        self._socket = socket
        self._pending: asyncio.Future[list[zmq.Frame]] | None = None

    async def next(self, deadline: float | None) -> list[zmq.Frame] | None:
        """The next multipart message, or None if `deadline` (loop time) passed first."""
        pending = self._pending
        if pending is None:
            pending = self._pending = cast("asyncio.Future[list[zmq.Frame]]", self._socket.recv_multipart(copy=False))
        if not pending.done():
            loop = asyncio.get_running_loop()
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            await asyncio.wait((pending,), timeout=timeout)
            if not pending.done():
                return None
        self._pending = None
        return pending.result()

    def close(self) -> None:
        """Cancel the outstanding receive (the socket is closing; nothing more will be read)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
