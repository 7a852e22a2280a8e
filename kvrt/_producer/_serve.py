"""The producer's driver of its core: what comes in handed to the core, and the core's actions
performed. Two ways in: a consumer's control frames, read by the serve loop (`ServeLoop`, one
task, started by `Producer.start`, owned by the producer, which wakes for a frame or for the
core's next deadline), and an item inserted (`Inserter`, in the caller's task: the caller's
tensors copied into the item's bytes, its record handed to the core once the buffer has room,
an event, never a poll). One way out, `ServeLoop.perform`: replies, deliveries over the
transport, peers joining and leaving.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Final

import msgspec
import torch
import zmq

from kvrt import _messages as m
from kvrt import _metrics
from kvrt._checksum import HIDDEN_POSITION, delivery_checksum, stream_start_checksum, tensors_checksum
from kvrt._errors import (
    ErrorCode,
    PeerLostError,
    translate_zmq_error,
)
from kvrt._heads import check_heads
from kvrt._heap import trim_heap
from kvrt._item import NewItem, check_item, check_timeout, item_from_packed, masked_tokens
from kvrt._item_bytes import GathersFailed, ItemBytes, all_gathers_queued
from kvrt._producer._parts import Gate, ItemKeeper, loop_time
from kvrt._protocol import Outgoing, ProducerCore
from kvrt._protocol.lookup_buffer import BufferedItem
from kvrt._tensors import Allocate, pack
from kvrt._zmqio import MAX_BATCH, STREAM_BACKLOG_MESSAGES, Dropped, RouterOutboxes, SocketIO
from kvrt.transports import HostCopies, Sender, Transfer

TRIM_AFTER_DEPARTURES: Final = 256
"""Peers forgotten since the last heap trim that make the next one worth it."""

_UNASKED_PONG: Final = m.encode(m.Pong(nonce=m.UNASKED_NONCE))

log = logging.getLogger("kvrt.producer")


class _Unencodable(Exception):
    """A message the core built that the wire cannot carry (a bug: every value is checked first)."""


def _encoded(message: m.Message) -> bytes:
    try:
        return m.encode(message)
    except (OverflowError, TypeError, ValueError) as exc:
        raise _Unencodable(f"{type(message).__name__}: {exc}") from exc


def _frame_bytes(frame: bytes | memoryview) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def _earliest(*deadlines: float | None) -> float | None:
    return min((deadline for deadline in deadlines if deadline is not None), default=None)


BytesOf = Callable[[BufferedItem], ItemBytes]
"""The bytes the driver keeps beside an item's record."""


def _with_checksums(message: m.Message, send: Outgoing, bytes_of: BytesOf) -> m.Message:
    """A message with the checksums of the bytes that follow it. A piece's, or a finished
    stream's read whole, is known once its `fill` wrote it, after the core built the header;
    an open stream's layer has the checksum `put_layer` computed; a layer or the hidden states
    of a whole item read as a stream are checksummed from the item's bytes here (on the host;
    a GPU stream's layers leave before they are written: its end carries their checksums)."""
    record = send.item
    item = None if record is None else bytes_of(record)
    match message:
        case m.Deliver(request_id=request_id, item_id=item_id, matched=matched, lease=lease) if record is not None:
            assert item is not None
            return msgspec.structs.replace(
                message, checksum=record.checksum, device_checksum=item.device_checksum,
                delivery_checksum=_delivery_checksum(request_id, item_id, matched, lease, record, item),
            )  # fmt: skip
        case m.DeliverMany(request_id=request_id):
            records = iter(send.items)
            hits = [
                None if hit is None else msgspec.structs.replace(
                    hit, checksum=(hit_record := next(records)).checksum,
                    device_checksum=(hit_item := bytes_of(hit_record)).device_checksum,
                    delivery_checksum=_delivery_checksum(
                        request_id, hit.item_id, hit.matched, hit.lease, hit_record, hit_item
                    ),
                )
                for hit in message.hits
            ]  # fmt: skip
            return msgspec.structs.replace(message, hits=hits)
        case m.StreamLayer(layer=layer) if item is not None and item.store is not None:
            if item.store.layer_sums:  # a GPU stream's: its end carries them (the item holds only its tokens)
                return message
            return msgspec.structs.replace(message, checksum=item.store.checksums[layer])
        case m.StreamLayer(layer=layer) if item is not None and item.storage.device.type == "cpu":
            layer_checksum = tensors_checksum((item.key[layer], item.value[layer]), (message.key, message.value), layer)
            return msgspec.structs.replace(message, checksum=layer_checksum)
        case m.StreamEnd(hidden=hidden) if item is not None and item.hidden is not None and hidden is not None:
            if item.hidden.device.type == "cpu":
                hidden_checksum = tensors_checksum((item.hidden,), (hidden,), HIDDEN_POSITION)
                return msgspec.structs.replace(message, checksum=hidden_checksum)
    return message


def _delivery_checksum(
    request_id: int, item_id: int, matched: int, lease: int, record: BufferedItem, item: ItemBytes
) -> int | None:
    checksum = record.checksum if record.checksum is not None else item.device_checksum
    return None if checksum is None else delivery_checksum(request_id, item_id, matched, lease, checksum)


def _lowered(send: Outgoing, bytes_of: BytesOf) -> Transfer | None:
    """The bytes `send` moves, as its transport is given them (None: a message alone)."""
    message, record = send.message, send.item
    if isinstance(message, m.StreamLayer):
        assert record is not None
        item, layer = bytes_of(record), message.layer
        if item.store is not None:  # an open stream's layer, from its store: written once its event fired
            return Transfer(tensors=(item.store.keys[layer], item.store.values[layer]), ready=item.store.ready[layer],
                            stream_id=message.item_id)  # fmt: skip
        # A whole item's layer, written once the item is (its gathers or its fill were queued
        # by the stream's start).
        return Transfer(tensors=(item.key[layer], item.value[layer]), ready=item.written, stream_id=message.item_id)
    if isinstance(message, m.StreamEnd):
        whole = None if record is None else bytes_of(record)
        if whole is None or whole.hidden is None:
            return None
        return Transfer(tensors=(whole.hidden,), ready=whole.written, stream_id=message.item_id)
    if isinstance(message, m.DeliverMany):
        return Transfer(items=tuple(bytes_of(hit) for hit in send.items), batch=message)
    if record is not None and not isinstance(message, m.StreamStart):
        return Transfer(items=(bytes_of(record),), segments=tuple(record.segments))
    return None


def _host_of(endpoint: str) -> str:
    """The host part of a bound tcp:// endpoint, as peers can reach it."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host in ("*", "0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


class _RateLimit:
    """At most one log line per `per_s` for a kind of event a peer can cause at will (a flood
    of refused messages must not become a flood of log lines); the others are counted."""

    def __init__(self, per_s: float) -> None:
        self._per_s = per_s
        self._next = 0.0
        self._suppressed = 0

    def allows(self, now: float) -> bool:
        if now >= self._next:
            self._next = now + self._per_s
            return True
        self._suppressed += 1
        return False

    def suppressed_note(self) -> str:
        note = f" ({self._suppressed} more not logged)" if self._suppressed else ""
        self._suppressed = 0
        return note


class ServeLoop:
    """The serve loop and what it performs: replies, deliveries, peers leaving. It owns the
    producer's socket I/O once bound (`bind`), its outboxes and its send lock."""

    def __init__(self, core: ProducerCore, gate: Gate, items: ItemKeeper, transports: dict[str, Sender]) -> None:
        self._core = core
        self._gate = gate
        self._items = items
        self._transports = transports
        self._io: SocketIO | None = None
        self.outboxes: RouterOutboxes | None = None
        self._endpoint = ""
        self._send_lock = asyncio.Lock()
        self._refusal_log = _RateLimit(per_s=1.0)
        self._peer_log = _RateLimit(per_s=0.1)
        """Consumers joining and leaving: a storm of connections must not become one of log lines."""
        self._departed_since_trim = 0
        self.host_copies = HostCopies()
        """A stream's head (its tokens) as host frames (see `_send_one`)."""
        self.peer_left = asyncio.Event()
        """Set whenever a consumer left and its pair was released (tests and metrics await it)."""

    def bind(self, io: SocketIO, outboxes: RouterOutboxes, endpoint: str) -> None:
        """The producer's socket is bound at `endpoint`: serve it (`run`)."""
        self._io, self.outboxes, self._endpoint = io, outboxes, endpoint

    def _bytes_of(self, record: BufferedItem) -> ItemBytes:
        return self._items[record]

    def _fill(self, record: BufferedItem) -> None:
        """Write an item's bytes before they are first read (see `ItemBytes.fill`)."""
        item = self._bytes_of(record)
        fill, item.fill = item.fill, None
        if fill is not None:
            fill(record, item)

    def reclaim(self) -> None:
        """Before allocating an item: memory that finished transfers still reference is freed
        (else a GPU item allocates anew, a device allocation on the loop)."""
        for transport in self._transports.values():
            transport.reclaim()

    async def run(self) -> None:
        io, outboxes = self._io, self.outboxes
        assert io is not None and outboxes is not None
        core = self._core
        while True:
            first = await io.next(_earliest(core.next_deadline(), outboxes.next_retry()))
            now = loop_time()
            batch = [] if first is None else [first, *io.drain()]
            for frames in batch:
                if len(frames) >= 2:
                    # Answered one by one: a burst's first item goes out (and its transfer
                    # starts) before the rest of the burst is looked up.
                    out = self._answer(frames[0].bytes, frames[1].buffer, len(frames) - 2, now)
                    if out:
                        await self.perform(out)
                    if outboxes.waiting(frames[0].bytes):  # a peer that sends may have read too
                        await self.perform(self._dropped(outboxes.flush(now, only=frames[0].bytes), now))
            if outboxes.next_retry() is not None:
                await self.perform(self._dropped(outboxes.flush(now), now))
            expired = core.expire(now, self._connected)
            if expired:
                await self.perform(expired)
            self.release_departed()
            self._gate.update_room()  # receipts in the batch may have made room
            if len(batch) > MAX_BATCH:
                # A flood never suspends `io.next`: yield once a full batch, so that inserts
                # and the engine's other tasks on this loop still run while one peer floods.
                await asyncio.sleep(0)

    def _connected(self, peer: bytes) -> bool:
        """Whether `peer`'s connection is still up (it is sent a Pong it ignores)."""
        assert self.outboxes is not None
        return self.outboxes.reaches(peer, [_UNASKED_PONG])

    def _answer(self, peer: bytes, frame: memoryview, extra_frames: int, now: float) -> list[Outgoing]:
        """The core's answer to one frame. A frame the core fails on (a bug, or a peer's input
        nobody foresaw) fails alone: its peer gets an internal error, everyone else is served."""
        try:
            return self._core.receive(peer, frame, extra_frames, now)
        except Exception as exc:
            log.exception("a frame could not be handled", extra={"peer": peer})
            return [self._core.refusal(peer, m.peek_request_id(frame), ErrorCode.INTERNAL, f"{type(exc).__name__}")]

    def _dropped(self, dropped: list[Dropped], now: float) -> list[Outgoing]:
        """Forget the peers the outboxes gave up on (their items go back once their lease ends)."""
        out: list[Outgoing] = []
        for gone in dropped:
            log.warning("dropped a consumer: %s", gone.reason, extra={"peer": gone.peer})
            out += self._core.peer_unreachable(gone.peer, now, gone.reason)
        return out

    def _post(self, peer: bytes, frames: list[bytes | memoryview], dropped: list[Dropped]) -> None:
        """Send to one peer without waiting on it (see `RouterOutboxes`)."""
        assert self.outboxes is not None
        gone = self.outboxes.post(peer, frames, loop_time())
        if gone is not None:
            dropped.append(gone)

    async def perform(self, out: list[Outgoing]) -> None:
        """Send what the core answered; a peer found unreachable, or not reading, is forgotten.

        No send waits for a peer: each peer's messages wait in its own outbox when its queue is
        full. Under one lock all the same: an out-of-band transport's sends must be issued in
        the order their Deliver headers are posted, and `insert` and the serve loop both come
        here. A message that cannot be built fails its own request only.
        """
        dropped: list[Dropped] = []
        async with self._send_lock:
            while out:
                send = out.pop(0)
                try:
                    await self._send_one(send, dropped)
                except (zmq.ZMQError, PeerLostError) as exc:
                    if isinstance(exc, zmq.ZMQError):
                        error = translate_zmq_error(exc, endpoint=self._endpoint)
                        if not isinstance(error, PeerLostError):
                            raise error from exc
                    out += self._core.peer_unreachable(send.peer, loop_time(), "it is no longer connected")
                except GathersFailed:
                    # The consumer may hold a header whose bytes will never come: its pair
                    # cannot be trusted any more. The item is gone (`publish` raises).
                    for item in (send.item,) if send.item is not None else send.items:
                        source = item if item.parent is None else item.parent
                        gathers = self._bytes_of(source).gathers
                        if gathers is not None and gathers.failed:
                            out += self._core.discard(source)
                    out += self._core.peer_unreachable(send.peer, loop_time(), "an item's gathers failed")
                except _Unencodable as exc:
                    log.error("could not build a reply: %s", exc, extra={"peer": send.peer})
                    out += self._core.unsendable(send, str(exc), loop_time())
                if dropped:
                    out += self._dropped(dropped, loop_time())
                    dropped = []
            self.release_departed()
        self._gate.update_room()

    async def _send_one(self, send: Outgoing, dropped: list[Dropped]) -> None:
        """Build and post one message the core answered; one that moves bytes goes to its
        consumer's transport, lowered into a `Transfer`."""
        message = send.message
        if isinstance(message, m.ErrorReply) and self._refusal_log.allows(loop_time()):
            log.info(
                "refused a message: %s%s", message.message, self._refusal_log.suppressed_note(),
                extra={"peer": send.peer, "request_id": message.request_id, "code": message.code.value},
            )  # fmt: skip
        frames: Sequence[bytes | memoryview] = ()
        if isinstance(message, m.Welcome):
            assert self.outboxes is not None
            self.outboxes.unmute(send.peer)
            # A second hello ended the peer's old session first: its pair goes now,
            # not after the new one is offered (the peer's identity is the same).
            self.release_departed()
            if self._peer_log.allows(loop_time()):
                log.info("a consumer joined; its items travel over %s%s", message.transport,
                         self._peer_log.suppressed_note(),
                         extra={"peer": send.peer, "transport": message.transport})  # fmt: skip
            rendezvous = self._transports[message.transport].offer(send.peer)
            if rendezvous:
                message = msgspec.structs.replace(message, rendezvous=rendezvous)
        bytes_of = self._bytes_of
        for record in (send.item, *send.items):
            if record is not None and bytes_of(record).fill is not None and not isinstance(message, m.StreamEnd):
                if record.parent is not None:  # a piece: cut from its item's bytes once they are written
                    self._fill(record.parent)
                    await all_gathers_queued(bytes_of(record.parent))
                self._fill(record)  # a finished stream read whole after all, or a piece
        if self._items.checksum:
            if isinstance(message, m.Deliver | m.DeliverMany):
                for record in (send.item, *send.items):
                    if record is None:
                        continue
                    item = bytes_of(record)
                    if item.device_checksum is None and item.storage.device.type == "cuda":
                        await self._items.device_checksum(record)  # its header leaves with it
            elif (
                isinstance(message, m.StreamEnd) and send.item is not None
                and bytes_of(send.item).storage.device.type == "cuda"
            ):  # fmt: skip
                message = await self._items.stream_end_checksums(message, send.item)
            message = _with_checksums(message, send, bytes_of)
        if isinstance(message, m.StreamStart):
            assert send.item is not None
            item = bytes_of(send.item)
            await all_gathers_queued(item)  # a published item's layers follow: gathered first
            # The frame: the tokens (and roi) at the head of the item's buffer, read
            # back in a kvrt thread for a GPU item (written before its ready event).
            head = item.storage[: message.payload_bytes]
            frames = await self.host_copies.frames([head], item.ready_event)
            if self._items.checksum:
                start = message
                checksum = stream_start_checksum(
                    start.request_id, start.item_id, start.matched, start.lease, start.layers, start.payload_bytes,
                    frames[0], (start.input_tokens, start.roi),
                )  # fmt: skip
                message = msgspec.structs.replace(start, checksum=checksum)
        elif (transfer := _lowered(send, bytes_of)) is not None:
            transport_name = self._core.transport_of(send.peer)
            if transport_name is None:
                return  # the peer left meanwhile; the core took the items (or the stream) back
            peer, header = send.peer, _encoded(message)
            if isinstance(message, m.Deliver | m.DeliverMany):
                delivery = message

                def post(frames: Sequence[memoryview]) -> None:
                    self._post_delivery(peer, delivery, header, frames, dropped)
            else:

                def post(frames: Sequence[memoryview]) -> None:
                    self._post(peer, [header, *frames], dropped)

            await self._transports[transport_name].send(peer, transfer, post)
            return
        self._post(send.peer, [_encoded(message), *frames], dropped)

    def _post_delivery(
        self, peer: bytes, message: m.Deliver | m.DeliverMany, header: bytes, frames: Sequence[bytes | memoryview],
        dropped: list[Dropped],
    ) -> None:  # fmt: skip
        """A delivery's `header` (`message` encoded): with its frames, or, when they are large
        (the bytes themselves, over TCP; not a cuda_ipc share that names them), alone and the
        frames in a `payload` message right behind (see `SPLIT_PAYLOAD_BYTES`)."""
        if not frames or sum(_frame_bytes(frame) for frame in frames) < m.SPLIT_PAYLOAD_BYTES:
            self._post(peer, [header, *frames], dropped)
            return
        self._post(peer, [header], dropped)
        self._post(peer, [_encoded(m.Payload(request_id=message.request_id)), *frames], dropped)

    async def room_for(self, reader: bytes) -> None:
        """Before a stream adds its next layer: wait while more than `STREAM_BACKLOG_MESSAGES`
        of its messages wait for its reader, until half of them left (or the reader was dropped
        or left). Bounded: a reader that reads nothing for the stall bound is dropped."""
        outboxes = self.outboxes
        if outboxes is not None and outboxes.waiting(reader) >= STREAM_BACKLOG_MESSAGES:
            await outboxes.room(reader, STREAM_BACKLOG_MESSAGES // 2)

    def release_departed(self) -> None:
        departed = self._core.take_departed()
        for departure in departed:
            if self._peer_log.allows(loop_time()):
                log.info("consumer left; what it held is back in the buffer%s", self._peer_log.suppressed_note(),
                         extra={"peer": departure.peer})  # fmt: skip
            unconfirmed = [self._bytes_of(record) for record in departure.unconfirmed]
            self._transports[departure.transport].forget(departure.peer, unconfirmed)
            self.peer_left.set()
        self._departed_since_trim += len(departed)
        if self._departed_since_trim >= TRIM_AFTER_DEPARTURES and self._core.peer_count < self._departed_since_trim:
            # After a storm of peers, give the memory their connections and records held back
            # to the system (glibc keeps freed memory in its arenas otherwise).
            self._departed_since_trim = 0
            trim_heap()

    def ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        failure = task.exception()
        if failure is not None:
            # The serve loop owns the protocol; without it nothing can be served. Close,
            # so that every later call says so instead of waiting for ever.
            self._gate.close(failure)


class Inserter:
    """`insert`, and buffering an item for the core (also used by publish and streams)."""

    def __init__(
        self, core: ProducerCore, gate: Gate, items: ItemKeeper, serving: ServeLoop, *, heads: m.HeadRange | None
    ) -> None:
        self._core = core
        self._gate = gate
        self._items = items
        self._serving = serving
        self._heads = heads

    async def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor | None,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor | None = None,
        *,
        timeout: float | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """See `Producer.insert`."""
        self._gate.check_open()
        timer = _metrics.Timer("insert")
        check_item(input_tokens, roi, key, value, hidden)
        check_heads(self._heads, key, value, what="insert")
        check_timeout(timeout, what="insert")
        await self._gate.wait_for_room(timeout)
        self._serving.reclaim()
        item = buffered_item(
            (input_tokens, roi, key, value, hidden),
            self._items.device,
            item_id=self._core.new_item_id(),
            seq=self._core.buffer.next_seq(),
            allocate=self._items.allocate,
        )
        await self.buffer(item)
        timer.done()

    async def buffer(self, item: NewItem) -> None:
        """Hand a built item to the transports and the core (room was waited for already); its
        bytes are kept beside its record."""
        record = self._items.keep(item)
        self._items.prepare(record, item.bytes)
        await self._serving.perform(self._core.insert(record, loop_time()))


def buffered_item(
    tensors: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None],
    device: torch.device, *, item_id: int, seq: int, allocate: Allocate | None = None,
) -> NewItem:  # fmt: skip
    """An item for the buffer: the five tensors (already checked) packed into one new buffer
    on `device` (the one copy insert makes), with its lookup key: read from the caller's
    tokens when they are on the host (from the packed copy on a GPU, the read would wait for
    everything queued on the caller's stream, a whole prefill's work)."""
    input_tokens, roi = tensors[0], tensors[1]
    on_host = input_tokens.device.type == "cpu" and (roi is None or roi.device.type == "cpu")
    masked = masked_tokens(input_tokens, roi).copy() if on_host else None  # the caller may change its tokens
    return item_from_packed(pack(tensors, device, allocate), item_id=item_id, seq=seq, masked=masked)
