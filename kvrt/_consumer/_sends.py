"""What a link sends its producer, and in which order: receipts, releases, hello and bye must
arrive in the order they were made (a hello or bye that overtook a receipt would make the
producer take that item back, and give it to someone else), and a receipt is never dropped for
want of room; pings and cancels may be dropped (the producer's lease covers them)."""

from __future__ import annotations

import asyncio
import collections
import logging

import zmq

from kvrt import _messages as m
from kvrt._protocol import ConsumerCore
from kvrt._zmqio import SocketIO

log = logging.getLogger("kvrt.consumer")


class OrderedSends:
    """A link's sends: the receipts to confirm, the messages that must leave in order (sent
    now, or by a task of its own once the socket has room), and those that may be dropped."""

    def __init__(self, io: SocketIO, core: ConsumerCore, endpoint: str) -> None:
        self._io = io
        self._core = core
        self._endpoint = endpoint
        self._receipts: list[tuple[int, int]] = []
        """(item id, lease) of items handed over, to confirm in the next `Received`."""
        self._in_order: collections.deque[bytes] = collections.deque()
        """Messages that must reach the producer in this order and that a full send queue
        refused: `_sender` sends them once it has room."""
        self._sender: asyncio.Task[None] | None = None

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The task sending what a full queue refused, while there is one (the link owns it)."""
        return self._sender

    def receipt(self, item_id: int, lease: int) -> None:
        """Confirm an item in the next `send_receipts`."""
        self._receipts.append((item_id, lease))

    def send_receipts(self) -> None:
        """One Received for every item confirmed since the last one, in order with the
        messages that must follow it."""
        while self._receipts:
            batch = self._receipts[: m.MAX_RECEIPTS]
            del self._receipts[: m.MAX_RECEIPTS]
            item_ids = [item_id for item_id, _ in batch]
            self._queue([m.encode(m.Received(item_ids=item_ids, leases=[lease for _, lease in batch]))])
            self._core.receipts_sent(batch)

    def in_order(self, message: m.Message) -> None:
        """Send `message` after every receipt and in-order message before it (a release, a
        hello, a bye)."""
        self.send_receipts()
        self._queue([m.encode(message)])

    def nowait(self, message: m.Message) -> None:
        """Queue a small message without awaiting (cancels, pings). If the queue is full or
        the socket closed, the message is dropped: the producer's lease then returns whatever
        it would have released."""
        try:
            sent = self._io.send_nowait([m.encode(message)])
        except zmq.ZMQError as exc:
            sent = False
            log.debug("could not send %s to %s: %s", type(message).__name__, self._endpoint, exc)
        if not sent:
            log.debug("dropped %s to %s: send queue full", type(message).__name__, self._endpoint)

    async def sent(self, within_s: float) -> None:
        """Closing: the in-order messages left waiting, given `within_s` to leave (else the
        producer takes their items back once the lease ends, and may deliver them again)."""
        sender = self._sender
        if sender is None or sender.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(sender), within_s)
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("closing with %d messages unsent to %s (%r): their items may be delivered again",
                        len(self._in_order), self._endpoint, exc, extra={"endpoint": self._endpoint})  # fmt: skip

    def _queue(self, frames: list[bytes]) -> None:
        self._in_order.extend(frames)
        if self._sender is not None and not self._sender.done():
            return  # it sends these too, in order
        try:
            while self._in_order and self._io.send_nowait([self._in_order[0]]):
                self._in_order.popleft()
        except zmq.ZMQError as exc:  # the socket is closing: the link is going away
            log.debug("could not send to %s: %s", self._endpoint, exc)
            self._in_order.clear()
            return
        if self._in_order:
            self._sender = asyncio.create_task(self._send_with_room(), name=f"kvrt-in-order-{self._endpoint}")

    async def _send_with_room(self) -> None:
        """The in-order messages a full send queue refused, each sent as soon as it has room."""
        while self._in_order:
            await self._io.send([self._in_order[0]])
            self._in_order.popleft()
