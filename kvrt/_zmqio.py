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
import errno
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

import zmq

MAX_BATCH: Final = 64
"""Most messages taken per wakeup, so deadlines are still checked under a flood."""

_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)
_NOBLOCK: Final = int(zmq.NOBLOCK)
_MORE_NOBLOCK: Final = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_EVENTS: Final = int(zmq.EVENTS)
"""As plain ints: pyzmq's flags are enums, whose `&` and `|` cost twenty times an int's."""

# pyzmq's compiled socket calls, one frame each. Its Python `send_multipart` and
# `recv_multipart` wrap them with a type check, an enum `|` and an option read per frame:
# about half of a small message's cost, on every message kvrt sends or reads.
_send_frame = cast(Any, zmq.backend.Socket).send
_recv_frame = cast(Any, zmq.backend.Socket).recv
_get_option = cast(Any, zmq.backend.Socket).get

Frames = Sequence[bytes | memoryview | zmq.Frame]


def send_frames(socket: zmq.Socket[bytes], frames: Frames) -> None:
    """`socket.send_multipart(frames, zmq.NOBLOCK, copy=False)`, one compiled call a frame:
    `zmq.Again` if the queue has no room (then nothing was sent: libzmq takes a multipart
    message's later frames whenever it took its first)."""
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        _send_frame(socket, frame, _MORE_NOBLOCK if index < last else _NOBLOCK, False, False)


def recv_frames(socket: zmq.Socket[bytes]) -> list[zmq.Frame]:
    """`socket.recv_multipart(zmq.NOBLOCK, copy=False)`, one compiled call a frame: `zmq.Again`
    if no message waits (a message's later frames are there whenever its first is)."""
    frame = _recv_frame(socket, _NOBLOCK, False, False)
    frames = [frame]
    while frame.more:
        frame = _recv_frame(socket, _NOBLOCK, False, False)
        frames.append(frame)
    return frames


class SocketIO:
    """Asyncio waits for one ZeroMQ socket (and, optionally, its monitor socket). Create it,
    use it and close it on one event loop."""

    def __init__(self, socket: zmq.Socket[bytes], monitor: zmq.Socket[bytes] | None = None) -> None:
        self.socket = socket
        self.monitor = monitor
        self._loop = asyncio.get_running_loop()
        self._fd = cast(int, socket.getsockopt(zmq.FD))
        self._ready = asyncio.Event()
        self._loop.add_reader(self._fd, self._ready.set)
        self._monitor_fd: int | None = None
        if monitor is not None:
            self._monitor_fd = cast(int, monitor.getsockopt(zmq.FD))
            self._loop.add_reader(self._monitor_fd, self._ready.set)
        self._blocked_senders = 0
        self._reader_parked = False
        """Whether a task waits in `next`: only then may a send have swallowed its signal."""
        self._closed = False
        self.drained_a_full_batch = False
        """Whether the last `drain` stopped at `MAX_BATCH`: more may be waiting (a flood)."""

    async def next(self, deadline: float | None) -> list[zmq.Frame] | None:
        """The next multipart message, or None once `deadline` (loop time) has passed or the
        monitor has events to read (`monitor_events`)."""
        while True:
            self._ready.clear()  # before the check: a signal that comes after it sets it again
            if self._events() & _POLLIN:  # cheaper than a receive that raises `Again`
                try:
                    return recv_frames(self.socket)
                except zmq.Again:
                    pass
            if self._monitor_pending():
                return None
            self._reader_parked = True
            try:
                if not await self._ready_by(deadline):
                    return None
            finally:
                self._reader_parked = False

    def monitor_events(self) -> list[tuple[int, int]]:
        """The monitor's events read so far, as (event, value), taken without waiting."""
        events: list[tuple[int, int]] = []
        if self.monitor is None:
            return events
        while len(events) < MAX_BATCH and self._monitor_pending():  # cheaper than a receive that raises
            try:
                first = recv_frames(self.monitor)[0].bytes
            except zmq.Again:
                break
            events.append((int.from_bytes(first[:2], "little"), int.from_bytes(first[2:6], "little")))
        return events

    def _monitor_pending(self) -> bool:
        return self.monitor is not None and bool(_get_option(self.monitor, _EVENTS) & _POLLIN)

    def drain(self) -> list[list[zmq.Frame]]:
        """Messages already queued, taken without waiting."""
        batch: list[list[zmq.Frame]] = []
        while len(batch) < MAX_BATCH and self._events() & _POLLIN:
            try:
                batch.append(recv_frames(self.socket))
            except zmq.Again:
                break
        self.drained_a_full_batch = len(batch) == MAX_BATCH
        if self._blocked_senders:
            self._ready.set()  # the reads may have swallowed the signal that room to send was made
        return batch

    async def send(self, frames: Frames, deadline: float | None = None) -> bool:
        """Send a multipart message, waiting while the queue is full; False if `deadline` passed."""
        while not self.send_nowait(frames):
            self._blocked_senders += 1
            try:
                if not await self._wait_for_room(deadline):
                    return False
            finally:
                self._blocked_senders -= 1
        return True

    def send_nowait(self, frames: Frames) -> bool:
        """Send if the queue has room; False if it has none."""
        try:
            send_frames(self.socket, frames)
            return True
        except zmq.Again:
            return False
        finally:
            # The send may have swallowed the FD's signal for a message that arrived, which a
            # reader waits for (one that is not waiting checks before it does).
            if self._reader_parked and self._events() & _POLLIN:
                self._ready.set()

    async def _wait_for_room(self, deadline: float | None) -> bool:
        """Wait until the socket may have room to send; False once `deadline` has passed."""
        self._ready.clear()
        if self._events() & _POLLOUT:
            return True
        return await self._ready_by(deadline) or bool(self._events() & _POLLOUT)

    async def _ready_by(self, deadline: float | None) -> bool:
        """Wait for `_ready` (cleared by the caller before its last check); False once
        `deadline` has passed first."""
        loop = self._loop
        if deadline is not None and deadline <= loop.time():
            return False
        timer = None if deadline is None else loop.call_at(deadline, self._ready.set)
        try:
            await self._ready.wait()
        finally:
            if timer is not None:
                timer.cancel()
        return deadline is None or loop.time() < deadline

    def _events(self) -> int:
        return cast(int, _get_option(self.socket, _EVENTS))

    def close(self) -> None:
        """Stop watching the FD (before the socket is closed)."""
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)
            if self._monitor_fd is not None:
                self._loop.remove_reader(self._monitor_fd)


def zmtp_heartbeats(socket: zmq.Socket[bytes], heartbeat_s: float, timeout_s: float, ttl_s: float) -> None:
    """ZeroMQ's own heartbeats on `socket` (before it connects or binds): libzmq's I/O thread
    pings every `heartbeat_s` and closes a connection silent for `timeout_s`, so a dead or
    stopped peer is found without the Python loop, and a loop busy for seconds (an engine
    holding the GIL) does not make its peer look dead. The peer closes its end once this side
    is silent for `ttl_s` (this whole process stopped, or gone without closing)."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(heartbeat_s * 1000)))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, round(timeout_s * 1000)))
    socket.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_500, max(100, round(ttl_s * 1000))))


MAX_QUEUED_MESSAGES: Final = 4096
"""Most messages kept for one peer beyond what its ZeroMQ queue holds; past this the peer is
dropped as one that does not read."""

STREAM_BACKLOG_MESSAGES: Final = MAX_QUEUED_MESSAGES // 4
"""A stream's messages waiting for its reader past which its prefill waits for room
(`RouterOutboxes.room`): a reader slower than its prefill slows the prefill down instead of
being dropped as one that does not read (which it is only once it reads nothing for
`stall_s`)."""

MAX_MUTED_PEERS: Final = 65536
"""Most dropped peers remembered as muted (the oldest are forgotten first)."""

FIRST_RETRY_S: Final = 0.001
LAST_RETRY_S: Final = 0.05
"""A ROUTER tells no one when one peer's queue has room again (its POLLOUT is the socket's,
set while any peer has room), so a peer's waiting messages are retried on a backoff from
`FIRST_RETRY_S` to `LAST_RETRY_S`, and whenever that peer sends something."""


@dataclass(slots=True)
class _Outbox:
    messages: deque[Frames]
    stalled_since: float
    """When the first waiting message stopped moving (reset whenever one leaves)."""
    retry_in_s: float = FIRST_RETRY_S
    retry_at: float = 0.0


@dataclass(slots=True)
class Dropped:
    """A peer that `RouterOutboxes` gave up sending to, and why."""

    peer: bytes
    reason: str


@dataclass(slots=True)
class RouterOutboxes:
    """Sends to each peer of a ROUTER without ever waiting on one peer for another.

    A message goes out at once when its peer's ZeroMQ queue has room; otherwise it waits in
    that peer's own outbox, in order, behind the ones already waiting there. A peer whose
    outbox made no progress for `stall_s`, or holds more than `MAX_QUEUED_MESSAGES`, is
    dropped (the caller forgets it) and muted: nothing more is sent to it until it starts a
    new session (`unmute`), so a peer that floods without reading costs no more replies. One
    that ZeroMQ no longer routes to (it disconnected) is dropped too. The serve loop calls
    `flush` at `next_retry()` and whenever a peer sends.
    """

    io: SocketIO
    stall_s: float
    _outboxes: dict[bytes, _Outbox] = field(default_factory=dict)
    _muted: dict[bytes, None] = field(default_factory=dict)
    _rooms: dict[bytes, list[tuple[int, asyncio.Future[None]]]] = field(default_factory=dict)
    """Per peer, who waits for its outbox to hold fewer messages than a bound (`room`)."""
    discarded: int = 0
    """Messages not sent because their peer was muted."""

    async def room(self, peer: bytes, below: int) -> None:
        """Return once fewer than `below` messages wait for `peer` (at once if so), or it was
        dropped or left: what a sender waits for before it adds more to a slow reader's queue.
        Bounded as the outbox is: one that moves nothing for `stall_s` is dropped."""
        if self.waiting(peer) < below:
            return
        room = asyncio.get_running_loop().create_future()
        waiters = self._rooms.setdefault(peer, [])
        waiters.append((below, room))
        try:
            await room
        finally:
            if (below, room) in waiters:
                waiters.remove((below, room))
            if not waiters and self._rooms.get(peer) is waiters:
                del self._rooms[peer]

    def _made_room(self, peer: bytes) -> None:
        """Wake who waits for room to `peer` (its outbox shrank, or it is gone)."""
        waiting = self.waiting(peer)
        for below, room in self._rooms.get(peer, ()):
            if not room.done() and (waiting < below or peer not in self._outboxes):
                room.set_result(None)

    def post(self, peer: bytes, frames: Frames, now: float) -> Dropped | None:
        """Send `frames` to `peer` now, or queue them behind its waiting messages."""
        if peer in self._muted:
            self.discarded += 1
            return None
        outbox = self._outboxes.get(peer)
        if outbox is not None:
            if len(outbox.messages) >= MAX_QUEUED_MESSAGES:
                return self._drop(peer, f"it left {MAX_QUEUED_MESSAGES} messages unread")
            outbox.messages.append(frames)
            return None
        try:
            if self.io.send_nowait([peer, *frames]):
                return None
        except zmq.ZMQError as exc:
            return self._unroutable(peer, exc)
        self._outboxes[peer] = _Outbox(deque([frames]), now, retry_at=now + FIRST_RETRY_S)
        return None

    def flush(self, now: float, only: bytes | None = None) -> list[Dropped]:
        """Send what waits (for `only`, or for every peer whose retry is due); the peers dropped."""
        dropped: list[Dropped] = []
        if only is not None:
            peers = [only] if only in self._outboxes else []
        else:
            peers = [peer for peer, outbox in self._outboxes.items() if outbox.retry_at <= now]
        for peer in peers:
            outbox = self._outboxes[peer]
            moved = False
            try:
                while outbox.messages and self.io.send_nowait([peer, *outbox.messages[0]]):
                    outbox.messages.popleft()
                    moved = True
            except zmq.ZMQError as exc:
                if (gone := self._unroutable(peer, exc)) is not None:
                    dropped.append(gone)
                continue
            if not outbox.messages:
                del self._outboxes[peer]
                self._made_room(peer)
                continue
            if moved:
                self._made_room(peer)
                outbox.stalled_since, outbox.retry_in_s = now, FIRST_RETRY_S
            elif now - outbox.stalled_since >= self.stall_s:
                dropped.append(self._drop(peer, f"it read nothing for {self.stall_s:.1f} s"))
                continue
            else:
                outbox.retry_in_s = min(LAST_RETRY_S, outbox.retry_in_s * 2)
            outbox.retry_at = now + outbox.retry_in_s
        return dropped

    def reaches(self, peer: bytes, frames: Frames) -> bool:
        """Whether ZeroMQ still routes to `peer` (its connection is up), learnt by sending it
        `frames`, a message it ignores, past its outbox and mute: only a closed connection
        refuses it (a full queue only means the peer does not read now)."""
        try:
            self.io.send_nowait([peer, *frames])
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            return False
        return True

    def next_retry(self) -> float | None:
        return min((outbox.retry_at for outbox in self._outboxes.values()), default=None)

    def waiting(self, peer: bytes) -> int:
        """Messages waiting for room to `peer`."""
        outbox = self._outboxes.get(peer)
        return 0 if outbox is None else len(outbox.messages)

    def discard(self, peer: bytes) -> None:
        """Forget what waits for a peer that left."""
        self._outboxes.pop(peer, None)
        self._made_room(peer)

    def unmute(self, peer: bytes) -> None:
        """`peer` starts a new session: send to it again."""
        self._muted.pop(peer, None)

    def _drop(self, peer: bytes, reason: str) -> Dropped:
        self._outboxes.pop(peer, None)
        self._made_room(peer)
        self._muted[peer] = None
        if len(self._muted) > MAX_MUTED_PEERS:
            del self._muted[next(iter(self._muted))]  # the longest muted
        return Dropped(peer, reason)

    def _unroutable(self, peer: bytes, exc: zmq.ZMQError) -> Dropped | None:
        if exc.errno != errno.EHOSTUNREACH:
            raise exc
        return self._drop(peer, "it is no longer connected")
