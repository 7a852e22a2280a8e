"""The producer's side of the protocol: `ProducerCore` (see the package's docstring).

Per peer the producer knows one state; the table `_PRODUCER_ACCEPTS` says which messages a
peer may send in it.

Ownership of items: a Deliver hands an item to a consumer under a lease, but the producer
keeps it (and counts its bytes) until the consumer answers `Received`. `Release` and `Bye`
put it back in the buffer at once, with its original age. A consumer that stops answering
(stalled, dead, not reading, unreachable) keeps its items until its lease ends: `lease_s`
after the last message the producer had from it. The consumer reckons its side of the lease
from the send time of its last request the producer answered, which is earlier, and hands an
item to its caller only inside it; each delivery carries a number (`lease`) that the receipt
echoes, and a receipt that comes after the lease ended is refused. So an item is never lost,
never freed while a peer may read it, and a consumer that wakes from a stall longer than its
lease drops what it was sent meanwhile instead of sharing it with the next consumer.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import torch

from kvrt import _messages as m
from kvrt._buffer import BufferedItem, LookupBuffer, Match, Pieces
from kvrt._errors import ErrorCode, InvalidInputError, NotFoundError, ProtocolError
from kvrt._protocol import commands
from kvrt._protocol.commands import ProducerCounters
from kvrt._protocol.heartbeats import HEARTBEAT_MISSES
from kvrt._protocol.waiting import MAX_WAITING_REQUESTS, PieceAsked, Waiter, WaitingRequests
from kvrt._tensors import meta_end, tensor_meta

TICK_FRACTION: Final = 0.25
"""With peers connected, `expire` runs at least every this part of a heartbeat."""
STALL_GAP_FRACTION: Final = 0.5
"""A gap between two `expire` calls over this part of a heartbeat is a stall of this process."""

UNCONFIRMED_SHARE: Final = 0.5
"""Most of the buffer's limit one consumer may hold delivered and not confirmed: one that
takes items and never confirms them (alive, pinging) cannot fill the buffer and stall every
insert; past it, it is served again once it confirms or releases some."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A message for the driver to send to `peer`; for a Deliver or a stream's start, `item`
    holds the payload (for a DeliverMany, `items`); a stream's layers and end carry their
    tensors in `tensors` (and, when they are a whole item's, that item in `item`)."""

    peer: bytes
    message: m.Message
    item: BufferedItem | None = None
    tensors: tuple[torch.Tensor, ...] = ()
    ready: torch.cuda.Event | None = None
    """GPU: the event after which `tensors` hold their bytes (a send waits on it)."""
    items: tuple[BufferedItem, ...] = ()
    """A DeliverMany's hits, in order."""


@dataclass(frozen=True, slots=True)
class Departure:
    """A peer that left (bye, silence, a second hello, unreachable)."""

    peer: bytes
    transport: str
    """The transport chosen at its hello."""
    unconfirmed: tuple[BufferedItem, ...]
    """The items in flight to it that it never confirmed (back in the buffer now): a
    transport may still hold something for each on the peer's behalf."""


class PeerState(enum.Enum):
    UNKNOWN = "unknown"
    READY = "ready"
    GONE = "gone"
    """Dropped (unreachable, or not reading), holding its items until its lease ends: it may
    still confirm or give them back, or start a new session; nothing else."""


_PRODUCER_ACCEPTS: Final[dict[PeerState, tuple[type[m.Message], ...]]] = {
    PeerState.UNKNOWN: (m.Hello, m.Bye),
    PeerState.READY: (
        m.Hello,
        m.Ping,
        m.Bye,
        m.DropSelect,
        m.DropSelectMany,
        m.Cancel,
        m.Received,
        m.Release,
        m.Health,
        m.Stats,
        m.Probe,
        m.ProbeMany,
        m.ListItems,
        m.Evict,
    ),
    PeerState.GONE: (m.Hello, m.Bye, m.Received, m.Release),
}


Cut = Callable[[BufferedItem, PieceAsked, int], BufferedItem]
"""The driver's: a piece of an item (its heads `heads`, with or without its hidden states) as
a new item with this id, its storage allocated; `BufferedItem.fill` writes its bytes before it
is sent. Raises `InvalidInputError` for heads the item does not have."""


def _no_cut(item: BufferedItem, asked: PieceAsked, item_id: int) -> BufferedItem:
    raise InvalidInputError("this producer does not cut items into pieces")


@dataclass(slots=True)
class _Peer:
    identity: bytes
    name: str
    transport: str
    last_seen: float
    in_flight: dict[int, BufferedItem] = field(default_factory=dict)
    waiting: set[int] = field(default_factory=set)
    waiting_bytes: int = 0
    unconfirmed_bytes: int = 0
    """Bytes of the items in flight to it, as charged when each left (`_hand_out`)."""
    suspended: bool = False
    """Over its share of unconfirmed bytes: its waiting requests are out of the indexes (no
    insert serves them) until it confirms or releases enough."""
    gone: str | None = None
    """Why it was dropped (see `PeerState.GONE`); None while it is served."""


class _TimerKind(enum.IntEnum):
    PEER = 0
    WAITER = 1
    ITEM = 2


class ProducerCore:
    """The producer's protocol state: peers, waiting requests, items in flight, the buffer."""

    def __init__(
        self,
        *,
        producer_id: str,
        heartbeat_s: float,
        transports: Sequence[str] = ("tcp",),
        peer_timeout_s: float | None = None,
        max_waiting: int = MAX_WAITING_REQUESTS,
        buffer_limit_bytes: int = 0,
        started_at: float = 0.0,
        item_ttl_s: float | None = None,
        host: str = "",
        same_host_only: frozenset[str] = frozenset(),
        cut: Cut = _no_cut,
        heads: m.HeadRange | None = None,
    ) -> None:
        self.producer_id = producer_id
        self._cut = cut
        self.heads = heads
        """The model's KV heads this producer's items hold, told to consumers in the welcome."""
        self.host = host
        """This producer's machine (see `Hello.host`)."""
        self.same_host_only = same_host_only
        """Transports chosen only for a consumer whose hello names this producer's machine."""
        self.buffer_limit_bytes = buffer_limit_bytes
        self.started_at = started_at
        self.item_ttl_s = item_ttl_s
        self.heartbeat_s = heartbeat_s
        self.transports = tuple(transports)
        """What this producer can send with, preferred first."""
        self.buffer = LookupBuffer()
        self.streams = LookupBuffer()
        """Open streams: prefills still publishing layers, which streaming lookups can take."""
        self.counters = ProducerCounters()
        self.lease_s = heartbeat_s * HEARTBEAT_MISSES if peer_timeout_s is None else peer_timeout_s
        """How long a consumer keeps what it was delivered after its last message (see the
        module's docstring); also how long it may stay silent before it is forgotten."""
        self._peers: dict[bytes, _Peer] = {}
        self._waiting = WaitingRequests(max_waiting)
        """Drop-selects parked until an insert matches them."""
        self._lease_numbers = itertools.count(1)
        self._last_expire: float | None = None
        self._hold_leases_until = 0.0
        self._timers: list[tuple[float, _TimerKind, int, object]] = []
        self._timer_order = itertools.count()
        self._item_ids = itertools.count(1)
        self._departed: list[Departure] = []
        self.refusals: dict[str, int] = {}
        """Error replies sent, by error code (for metrics)."""
        self._closed = False

    # -- what the driver reads ----------------------------------------------------------

    @property
    def peer_timeout_s(self) -> float:
        return self.lease_s

    @property
    def peer_count(self) -> int:
        """Consumers being served (not those dropped and holding items until their lease ends)."""
        return sum(1 for peer in self._peers.values() if peer.gone is None)

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    def peers_by_transport(self) -> dict[str, int]:
        """Connected consumers by the transport chosen at their hello."""
        counts: dict[str, int] = {}
        for state in self._peers.values():
            if state.gone is None:
                counts[state.transport] = counts.get(state.transport, 0) + 1
        return counts

    def next_deadline(self) -> float | None:
        """When to call `expire` next: the first timer, and with peers connected at least every
        quarter heartbeat (so that a gap between calls tells a stalled loop, see `expire`)."""
        first = self._timers[0][0] if self._timers else None
        if self._peers and self._last_expire is not None:
            tick = self._last_expire + self.heartbeat_s * TICK_FRACTION
            first = tick if first is None else min(first, tick)
        return first

    def new_item_id(self) -> int:
        return next(self._item_ids)

    def transport_of(self, peer: bytes) -> str | None:
        """The transport chosen at `peer`'s hello (None once it left)."""
        state = self._peers.get(peer)
        return None if state is None or state.gone is not None else state.transport

    def take_departed(self) -> list[Departure]:
        """Peers that left since the last call: the driver releases what their transports held."""
        departed, self._departed = self._departed, []
        return departed

    # -- inputs -------------------------------------------------------------------------

    def receive(self, peer: bytes, frame: bytes | memoryview, extra_frames: int, now: float) -> list[Outgoing]:
        """One control frame from `peer` (with `extra_frames` payload frames after it)."""
        try:
            message = m.decode(frame)
        except ProtocolError as exc:
            return [self._refuse(peer, m.peek_request_id(frame), exc.code, str(exc))]
        request_id = getattr(message, "request_id", None)
        state_peer = self._peers.get(peer)
        if state_peer is None:
            state = PeerState.UNKNOWN
        else:
            state = PeerState.READY if state_peer.gone is None else PeerState.GONE
        if not isinstance(message, _PRODUCER_ACCEPTS[state]):
            if state is not PeerState.READY:
                text = "this producer does not know you (it restarted, or you were silent too long): send hello"
                return [self._refuse(peer, request_id, ErrorCode.UNKNOWN_PEER, text)]
            text = f"a producer never accepts {type(message).__name__}"
            return [self._refuse(peer, request_id, ErrorCode.PROTOCOL, text)]
        if extra_frames:
            text = f"{type(message).__name__} carries no payload frames, got {extra_frames}"
            return [self._refuse(peer, request_id, ErrorCode.PROTOCOL, text)]
        if state_peer is not None:
            state_peer.last_seen = now
        match message:
            case m.Hello():
                return self._on_hello(peer, message, now)
            case m.Ping(nonce=nonce):
                return [Outgoing(peer, m.Pong(nonce=nonce))]
            case m.Bye():
                return self._forget_peer(peer, now)
            case m.DropSelect():
                return self._on_drop_select(peer, message, now)
            case m.DropSelectMany():
                return self._on_drop_select_many(peer, message, now)
            case m.Cancel(request_id=request_id):
                self._drop_waiter(peer, request_id)
                return []
            case m.Received(item_ids=item_ids, leases=leases):
                return self._on_received(peer, item_ids, leases, now)
            case m.Release(item_id=item_id, lease=lease):
                return self._on_release(peer, item_id, lease, now)
            case m.Health() | m.Stats() | m.Probe() | m.ProbeMany() | m.ListItems() | m.Evict():
                return [self._command(peer, message, now)]
        raise AssertionError(f"unhandled {message!r}")  # the accept table and the match disagree

    def insert(self, item: BufferedItem, now: float) -> list[Outgoing]:
        """Buffer a new item; a waiting request it matches gets it at once."""
        item.inserted_at = now
        self.counters.inserted_items += 1
        self.counters.inserted_bytes += item.nbytes
        self.buffer.add(item)
        if self.item_ttl_s is not None:
            self._add_timer(now + self.item_ttl_s, _TimerKind.ITEM, item)
        return self._serve_waiters(item, now)

    def drop(self, item: BufferedItem) -> None:
        """Evict a buffered item (operator's request or its TTL)."""
        self.buffer.drop(item)

    def discard(self, item: BufferedItem) -> None:
        """Forget an item whose bytes can never be sent (its gathers failed to queue), whether
        buffered or in flight: it is not given back to the buffer when its peer leaves."""
        if item.buffered:
            self.buffer.drop(item)
            return
        for state in self._peers.values():
            if state.in_flight.get(item.item_id) is item:
                self._take_back(state, item.item_id)
                if item.parent is not None:
                    self._piece_back(item, self._last_expire or 0.0)
                else:
                    self.buffer.forget(item)
                return

    def peer_unreachable(self, peer: bytes, now: float, reason: str = "unreachable") -> list[Outgoing]:
        """The driver gave up sending to `peer` (it disconnected, or does not read): it is
        served no more, its waiting requests are dropped, and what it holds goes back once its
        lease ends, unless it confirms or releases it first."""
        state = self._peers.get(peer)
        if state is None or state.gone is not None:
            return []
        state.gone = reason
        for request_id in list(state.waiting):
            self._drop_waiter(peer, request_id)
        if not state.in_flight:
            return self._forget_peer(peer, now)
        return []

    def refusal(self, peer: bytes, request_id: int | None, code: ErrorCode, text: str) -> Outgoing:
        """An error reply to `peer`, counted (the driver's, for a frame it could not handle)."""
        return self._refuse(peer, request_id, code, text)

    def unsendable(self, send: Outgoing, reason: str, now: float) -> list[Outgoing]:
        """A message that could not be built: the items it carried go back to the buffer, and
        its request (if it names one) fails with an internal error."""
        out: list[Outgoing] = []
        state = self._peers.get(send.peer)
        for item in (send.item, *send.items):
            if item is not None and state is not None and state.in_flight.get(item.item_id) is item:
                self._take_back(state, item.item_id)
                out += self._restore(item, now)
        request_id = getattr(send.message, "request_id", None)
        if request_id is not None:
            text = f"the reply could not be built: {reason}"
            out.append(self._refuse(send.peer, request_id, ErrorCode.INTERNAL, text))
        return out

    def expire(self, now: float) -> list[Outgoing]:
        """Answer waiting requests whose timeout passed; forget peers silent for too long.

        A lease ends only after this side has run for a while without a gap: a gap of more
        than `STALL_GAP_FRACTION` of a heartbeat between two calls means this process was
        stopped or starved (SIGSTOP, a GC pause, a busy host), and what consumers sent meanwhile
        (a receipt for an item handed over inside its lease, say) may still wait unread in
        ZeroMQ's queues, or come again in a reconnecting consumer's hello. Leases that ended
        during the gap end only once a whole lease more has passed, by which time those
        messages are read."""
        out: list[Outgoing] = []
        if self._last_expire is not None and now - self._last_expire > self.heartbeat_s * STALL_GAP_FRACTION:
            self._hold_leases_until = now + self.lease_s
        self._last_expire = now
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, kind, _, key = heapq.heappop(timers)
            if kind is _TimerKind.PEER:
                assert isinstance(key, bytes)
                peer = self._peers.get(key)
                if peer is None:
                    continue
                expires = max(peer.last_seen + self.peer_timeout_s, self._hold_leases_until)
                if expires <= now:
                    out += self._forget_peer(key, now)
                else:
                    self._add_timer(expires, _TimerKind.PEER, key)
            elif kind is _TimerKind.ITEM:
                assert isinstance(key, BufferedItem)
                if key.buffered:  # unclaimed, or some readers' pieces never asked for (those out stay valid)
                    self.buffer.drop(key)
                    self.counters.expired_items += 1
            else:
                assert isinstance(key, tuple)
                waiter = self._waiting.get(key)
                if waiter is not None and waiter.deadline is not None and waiter.deadline <= now:
                    self._drop_waiter(waiter.peer, waiter.request_id)
                    self.counters.misses += 1
                    out.append(Outgoing(waiter.peer, m.Miss(request_id=waiter.request_id)))
        return out

    def close(self, reason: str) -> list[Outgoing]:
        """Say Bye to every peer. Items in flight return to the buffer (which closes with us)."""
        self._closed = True
        out = [Outgoing(peer, m.Bye(reason=reason)) for peer in self._peers]
        for identity in list(self._peers):
            self._forget_peer(identity, now=0.0)
        self._timers.clear()
        return out

    # -- message handlers ---------------------------------------------------------------

    def _on_hello(self, peer: bytes, hello: m.Hello, now: float) -> list[Outgoing]:
        if hello.version != m.PROTOCOL_VERSION:
            text = f"hello for protocol version {hello.version}; this producer speaks {m.PROTOCOL_VERSION}"
            return [self._refuse(peer, None, ErrorCode.VERSION, text)]
        offered = hello.capabilities or [m.Capability.TCP.value]
        same_host = bool(self.host) and hello.host == self.host
        transport = next(
            (name for name in self.transports if name in offered and (same_host or name not in self.same_host_only)),
            None,
        )
        if transport is None:
            text = f"no common transport: you receive with {offered}, this producer sends with {list(self.transports)}"
            return [self._refuse(peer, None, ErrorCode.INVALID, text)]
        out: list[Outgoing] = []
        if peer in self._peers:
            # A second hello ends the peer's old session: what it confirmed counts (the receipts
            # its hello repeats, in case one was lost with a broken connection), the rest goes back.
            if hello.received:
                self._on_received(peer, hello.received, hello.received_leases, now, quiet=True)
            out += self._forget_peer(peer, now)
        self._peers[peer] = _Peer(identity=peer, name=hello.name, transport=transport, last_seen=now)
        self._add_timer(now + self.peer_timeout_s, _TimerKind.PEER, peer)
        welcome = m.Welcome(
            version=m.PROTOCOL_VERSION,
            producer_id=self.producer_id,
            heartbeat_s=self.heartbeat_s,
            transport=transport,
            capabilities=[*self.transports, m.Capability.PROBE_MANY.value],
            lease_s=self.lease_s,
            heads=self.heads,
        )
        out.append(Outgoing(peer, welcome))
        return out

    def _on_drop_select(self, peer: bytes, request: m.DropSelect, now: float) -> list[Outgoing]:
        try:
            query = None if request.tokens is None else m.tokens_from_bytes(request.tokens)
        except ProtocolError as exc:
            return [self._refuse(peer, request.request_id, exc.code, str(exc))]
        state = self._peers[peer]
        if state.suspended:
            return self._while_suspended(peer, request, query, now)
        asked = PieceAsked.of(request)
        if asked is not None:
            found = self._piece_match(peer, query, asked)
            if found is not None:
                out, _ = self._piece_out(
                    peer, request.request_id, found, asked, stream=request.stream, whole=request.whole
                )
                return out
            if request.timeout_s == 0.0:
                self.counters.misses += 1
                return [Outgoing(peer, m.Miss(request_id=request.request_id))]
            return self._park(peer, request, query, now)
        found = self.buffer.best_match(query)
        if request.stream:
            opened = self.streams.best_match(query)
            if opened is not None and (found is None or _better(opened, found)):
                return self._attach(peer, request.request_id, opened.item, opened.matched)
            if found is not None:
                return self._finished_out(peer, request.request_id, found.item, found.matched, whole=request.whole)
        elif found is not None:
            return [self._deliver(peer, request.request_id, found.item, found.matched)]
        if request.timeout_s == 0.0:
            self.counters.misses += 1
            return [Outgoing(peer, m.Miss(request_id=request.request_id))]
        return self._park(peer, request, query, now)

    def _park(self, peer: bytes, request: m.DropSelect, query: np.ndarray | None, now: float) -> list[Outgoing]:
        """Keep a drop-select waiting for an insert (within the per-peer and global bounds); out
        of the indexes while its peer is suspended."""
        if (peer, request.request_id) in self._waiting:
            text = f"request id {request.request_id} is already waiting"
            return [self._refuse(peer, request.request_id, ErrorCode.PROTOCOL, text)]
        state = self._peers[peer]
        query_bytes = 0 if query is None else int(query.nbytes)
        full = self._waiting.refusal(len(state.waiting), state.waiting_bytes, query_bytes)
        if full is not None:
            return [self._refuse(peer, request.request_id, ErrorCode.CAPACITY, f"{full}; retry with timeout=0")]
        deadline = None if request.timeout_s is None else now + request.timeout_s
        self._waiting.park(peer, request, query, deadline, indexed=not state.suspended)
        state.waiting.add(request.request_id)
        state.waiting_bytes += query_bytes
        if deadline is not None:
            self._add_timer(deadline, _TimerKind.WAITER, (peer, request.request_id))
        return []

    def _while_suspended(
        self, peer: bytes, request: m.DropSelect, query: np.ndarray | None, now: float
    ) -> list[Outgoing]:
        """A drop-select from a peer over its share of unconfirmed bytes: one that may wait
        waits, out of the indexes, until the peer confirms enough; one that may not is refused."""
        state = self._peers[peer]
        if request.timeout_s == 0.0:
            text = (
                f"you hold {state.unconfirmed_bytes} bytes delivered and not confirmed, more than "
                f"{UNCONFIRMED_SHARE:.0%} of this producer's buffer: confirm (or release) items first"
            )
            return [self._refuse(peer, request.request_id, ErrorCode.CAPACITY, text)]
        return self._park(peer, request, query, now)

    def _on_drop_select_many(self, peer: bytes, request: m.DropSelectMany, now: float) -> list[Outgoing]:
        state = self._peers[peer]
        if state.suspended:
            text = (
                f"you hold {state.unconfirmed_bytes} bytes delivered and not confirmed, more than "
                f"{UNCONFIRMED_SHARE:.0%} of this producer's buffer: confirm (or release) items first"
            )
            return [self._refuse(peer, request.request_id, ErrorCode.CAPACITY, text)]
        try:
            queries = [None if tokens is None else m.tokens_from_bytes(tokens) for tokens in request.queries]
        except ProtocolError as exc:
            return [self._refuse(peer, request.request_id, exc.code, str(exc))]
        hits: list[m.Hit | None] = []
        items: list[BufferedItem] = []
        offset = 0
        asked = PieceAsked.of(request)
        for query in queries:
            found = self.buffer.best_match(query) if asked is None else self._piece_match(peer, query, asked)
            if found is None:
                self.counters.misses += 1
                hits.append(None)
                continue
            if asked is None:
                item = found.item
                self.buffer.take(item)
                self._hand_out(peer, item)
            else:
                piece = self._cut_piece(peer, found.item, asked)
                if isinstance(piece, str):
                    out: list[Outgoing] = []
                    for taken in items:  # the batch fails whole: its pieces go back
                        self._take_back(state, taken.item_id)
                        out += self._piece_back(taken, now)
                    return [self._refuse(peer, request.request_id, ErrorCode.INVALID, piece), *out]
                item = piece
            offset = -(-offset // m.BATCH_ALIGNMENT) * m.BATCH_ALIGNMENT
            hits.append(_hit(item, found.matched, offset))
            items.append(item)
            offset += item.nbytes
        segments = batch_segments([(hit.offset, hit.payload_bytes) for hit in hits if hit is not None])
        reply = m.DeliverMany(request_id=request.request_id, hits=hits, payload_bytes=offset, segments=segments)
        return [Outgoing(peer, reply, items=tuple(items))]

    def _on_received(
        self, peer: bytes, item_ids: list[int], leases: list[int], now: float, *, quiet: bool = False
    ) -> list[Outgoing]:
        """Receipts: the items are delivered for good. `quiet`: receipts repeated by a hello,
        some of them read before: no refusal for those."""
        state = self._peers[peer]
        unknown, open_streams = [], []
        for index, item_id in enumerate(item_ids):
            item = state.in_flight.get(item_id)
            if item is None or (index < len(leases) and leases[index] != item.lease):
                unknown.append(item_id)  # a receipt whose lease ended: the item went back
                continue
            if item.stream is not None:
                # A stream is confirmed after its end (then its whole item is in flight): before
                # it, its prefill still publishes into it and would grow what was freed.
                open_streams.append(item_id)
                continue
            self._take_back(state, item_id)
            self.buffer.forget(item)
            if item.parent is not None:
                self._piece_confirmed(item.parent)
            self.counters.delivered_items += 1
            self.counters.delivered_bytes += item.nbytes
        out = self._resume_if_under(state, now) + self._forget_if_done(peer, now)
        if unknown and not quiet:
            text = f"items {unknown} are not in flight to you (their lease ended, or they were never yours)"
            out.append(self._refuse(peer, None, ErrorCode.NOT_FOUND, text))
        if open_streams and not quiet:
            text = f"streams {open_streams} have not ended: a stream is confirmed after its stream_end"
            out.append(self._refuse(peer, None, ErrorCode.PROTOCOL, text))
        return out

    def _on_release(self, peer: bytes, item_id: int, lease: int, now: float) -> list[Outgoing]:
        state = self._peers[peer]
        item = state.in_flight.get(item_id)
        if item is None or (lease and lease != item.lease):
            return [self._refuse(peer, None, ErrorCode.NOT_FOUND, f"item {item_id} is not in flight to you")]
        self._take_back(state, item_id)
        return self._restore(item, now) + self._resume_if_under(state, now) + self._forget_if_done(peer, now)

    def _forget_if_done(self, peer: bytes, now: float) -> list[Outgoing]:
        """A dropped peer that holds nothing any more is forgotten now."""
        state = self._peers.get(peer)
        if state is not None and state.gone is not None and not state.in_flight:
            return self._forget_peer(peer, now)
        return []

    def _command(self, peer: bytes, command: commands.Command, now: float) -> Outgoing:
        """An operator's question or command (`kvrt._protocol.commands`), answered at once."""
        try:
            return Outgoing(peer, commands.answer(command, now, self.buffer, self.counters, self._facts))
        except (ProtocolError, NotFoundError) as exc:
            return self._refuse(peer, command.request_id, exc.code, str(exc))

    def _facts(self) -> commands.Facts:
        return commands.Facts(
            self.producer_id, self.started_at, self.transports, self.buffer_limit_bytes, len(self._peers),
            len(self._waiting),
        )  # fmt: skip

    # -- helpers ------------------------------------------------------------------------

    def _refuse(self, peer: bytes, request_id: int | None, code: ErrorCode, text: str) -> Outgoing:
        self.counters.errors += 1
        self.refusals[code.value] = self.refusals.get(code.value, 0) + 1
        return Outgoing(peer, m.ErrorReply(request_id=request_id, code=code, message=text))

    def _hand_out(self, peer: bytes, item: BufferedItem, lease: int | None = None, *, also: int = 0) -> None:
        """`item` is in flight to `peer` under a new lease number (or `lease`); a peer that now
        holds more than its share unconfirmed is suspended (`UNCONFIRMED_SHARE`). `also`: bytes
        it holds besides (a piece: its share of the item, kept for the other readers)."""
        item.lease = next(self._lease_numbers) if lease is None else lease
        state = self._peers[peer]
        state.in_flight[item.item_id] = item
        item.charged = item.nbytes + also
        state.unconfirmed_bytes += item.charged
        if not state.suspended and self._over_share(state):
            self._suspend(state)

    def _take_back(self, state: _Peer, item_id: int) -> BufferedItem | None:
        """An item leaves `state`'s in-flight set (confirmed, released, or going back)."""
        item = state.in_flight.pop(item_id, None)
        if item is not None:
            state.unconfirmed_bytes -= item.charged
        return item

    def _over_share(self, state: _Peer) -> bool:
        return 0 < self.buffer_limit_bytes * UNCONFIRMED_SHARE < state.unconfirmed_bytes

    def _suspend(self, state: _Peer) -> None:
        """Stop serving `state`'s waiting requests: out of the indexes, still waiting."""
        state.suspended = True
        for request_id in state.waiting:
            waiter = self._waiting.get((state.identity, request_id))
            assert waiter is not None
            self._waiting.unindex(waiter)

    def _resume_if_under(self, state: _Peer, now: float) -> list[Outgoing]:
        """A suspended peer back under its share: its waiting requests are served again (those
        a buffered item matches at once, the others indexed for the next insert)."""
        if not state.suspended or self._over_share(state) or state.gone is not None:
            return []
        state.suspended = False
        out: list[Outgoing] = []
        for request_id in sorted(state.waiting):  # oldest first
            waiter = self._waiting.get((state.identity, request_id))
            assert waiter is not None
            if state.suspended:  # over its share again (`_hand_out`): the rest were taken out anew
                break
            if waiter.piece is not None:
                found = self._piece_match(state.identity, waiter.query, waiter.piece)
            else:
                found = self.buffer.best_match(waiter.query)
            if found is None:
                self._waiting.index(waiter)
                continue
            self._drop_waiter(state.identity, request_id)
            if waiter.piece is not None:
                out += self._piece_out(
                    state.identity, request_id, found, waiter.piece, stream=waiter.stream, whole=waiter.whole
                )[0]
            elif waiter.stream:
                out += self._finished_out(state.identity, request_id, found.item, found.matched, whole=waiter.whole)
            else:
                out.append(self._deliver(state.identity, request_id, found.item, found.matched))
        return out

    def _deliver(self, peer: bytes, request_id: int, item: BufferedItem, matched: int) -> Outgoing:
        self.buffer.take(item)
        self._hand_out(peer, item)
        return Outgoing(peer, _deliver_message(request_id, item, matched), item)

    def _restore(self, item: BufferedItem, now: float) -> list[Outgoing]:
        self.counters.returned_items += 1
        if item.parent is not None:
            return self._piece_back(item, now)
        if item.stream is not None:  # its reader left mid-stream: it keeps its layers, waits for another
            item.stream.reader = None
            self.streams.restore(item)
            return self._serve_waiters(item, now)
        self.buffer.restore(item)
        if self.item_ttl_s is not None:  # its time to live may have run out while it was away
            self._add_timer(max(now, item.inserted_at + self.item_ttl_s), _TimerKind.ITEM, item)
        return self._serve_waiters(item, now)

    def _serve_waiters(self, item: BufferedItem, now: float) -> list[Outgoing]:
        """Give `item` to the oldest waiting request it matches, if any (an open stream only to a
        streaming request). A request for a piece the item cannot give (heads it lacks) is
        refused, and the next one is served: a bad waiter holds nobody's item."""
        out: list[Outgoing] = []
        while True:
            served, done = self._serve_one_waiter(item, now)
            out += served
            if done:
                return out

    def _serve_one_waiter(self, item: BufferedItem, now: float) -> tuple[list[Outgoing], bool]:
        """`_serve_waiters` once: what to send, and False when a waiter was refused and the
        item is still there for the next."""
        if self._closed:
            return [], True
        if item.pieces is not None:
            return self._serve_piece_waiters(item), True
        found = self._waiting.oldest_for(item.masked_tokens, open_stream=item.stream is not None)
        if found is None:
            return [], True
        waiter, matched = found
        self._drop_waiter(waiter.peer, waiter.request_id)
        if waiter.piece is not None:
            asked, stream = waiter.piece, waiter.stream
            out, delivered = self._piece_out(
                waiter.peer, waiter.request_id, Match(item, matched), asked, stream=stream, whole=waiter.whole
            )
            if not delivered:
                return out, False
            return out + (self._serve_piece_waiters(item) if item.pieces is not None else []), True
        if item.stream is not None:
            return self._attach(waiter.peer, waiter.request_id, item, matched), True
        if waiter.stream:
            return self._finished_out(waiter.peer, waiter.request_id, item, matched, whole=waiter.whole), True
        return [self._deliver(waiter.peer, waiter.request_id, item, matched)], True

    # -- pieces (head ranges) -----------------------------------------------------------

    def _piece_match(self, peer: bytes, query: np.ndarray | None, asked: PieceAsked) -> Match | None:
        """The item a request for a piece takes from: one that other consumers of its number
        took pieces of already, so that the pieces of one request come from one item; else a
        whole one."""
        return self.buffer.best_piece(query, peer, asked.readers) or self.buffer.best_match(query)

    def _cut_piece(self, peer: bytes, item: BufferedItem, asked: PieceAsked) -> BufferedItem | str:
        """A piece of `item` in flight to `peer`, or why it cannot be cut."""
        pieces = item.pieces
        if pieces is not None and pieces.readers != asked.readers:
            return f"item {item.item_id} is taken by {pieces.readers} readers, this request says {asked.readers}"
        if asked.readers > len(self._peers) and self.item_ttl_s is None:
            # They could never all take theirs: the item would wait for ever for the missing ones.
            # With an item TTL it waits that long at most: readers still connecting (the ranks
            # of a decode group whose first request reaches this producer) take theirs meanwhile.
            return (
                f"{asked.readers} readers asked for, {len(self._peers)} consumers are connected (a producer with "
                "item_ttl_s waits for the others that long)"
            )
        try:
            piece = self._cut(item, asked, self.new_item_id())
        except InvalidInputError as exc:
            return str(exc)
        if pieces is None:
            pieces = item.pieces = Pieces(asked.readers)
            self.buffer.split(item)
        piece.parent = item
        piece.taker = peer
        piece.seq = item.seq
        piece.inserted_at = item.inserted_at
        pieces.takers.add(peer)
        if len(pieces.takers) == pieces.readers:
            self.buffer.pieces_out(item)
        self.buffer.add_taken(piece)
        self._hand_out(peer, piece, also=item.nbytes // pieces.readers)
        return piece

    def _piece_out(
        self, peer: bytes, request_id: int, found: Match, asked: PieceAsked, *, stream: bool, whole: bool = False
    ) -> tuple[list[Outgoing], bool]:
        """Deliver a piece of `found.item` to `peer` (layer by layer for a stream, unless it
        takes it `whole`); or refuse the request (heads the item lacks: the item stays as it
        was). Whether it was delivered."""
        piece = self._cut_piece(peer, found.item, asked)
        if isinstance(piece, str):
            return [self._refuse(peer, request_id, ErrorCode.INVALID, piece)], False
        if stream and not whole:
            return _whole_as_stream(peer, request_id, piece, found.matched), True
        return [Outgoing(peer, _deliver_message(request_id, piece, found.matched), piece)], True

    def _piece_confirmed(self, item: BufferedItem) -> None:
        """A piece of `item` was received for good: the last one frees the item."""
        pieces = item.pieces
        assert pieces is not None
        pieces.confirmed += 1
        if pieces.confirmed == pieces.readers and not pieces.dropped:
            self.buffer.forget(item)

    def _piece_back(self, piece: BufferedItem, now: float) -> list[Outgoing]:
        """A piece was given back, or its consumer left: its bytes go, and its place among the
        item's readers is free again (an item none of whose pieces is out is whole again)."""
        item = piece.parent
        assert item is not None and item.pieces is not None
        pieces = item.pieces
        self.buffer.forget(piece)
        pieces.takers.discard(piece.taker)
        if pieces.dropped or self._closed:
            return []
        if not item.buffered:
            self.buffer.reopen(item)
        if not pieces.takers:
            item.pieces = None
            self.buffer.unsplit(item)
        if self.item_ttl_s is not None:  # its time to live may have run out while its places were all taken
            self._add_timer(max(now, item.inserted_at + self.item_ttl_s), _TimerKind.ITEM, item)
        return self._serve_waiters(item, now)

    def _serve_piece_waiters(self, item: BufferedItem) -> list[Outgoing]:
        """Give pieces of a split item to the oldest waiting requests for pieces that it
        matches, while it has readers' places free."""
        out: list[Outgoing] = []
        passed: list[Waiter] = []  # waiters this item is not for: out of the index meanwhile
        while item.pieces is not None and item.buffered:
            found = self._waiting.oldest_piece_waiter(item.masked_tokens)
            if found is None:
                break
            waiter, matched = found
            assert waiter.piece is not None
            if waiter.peer in item.pieces.takers or waiter.piece.readers != item.pieces.readers:
                self._waiting.unindex(waiter)
                passed.append(waiter)
                continue
            self._drop_waiter(waiter.peer, waiter.request_id)
            asked, stream = waiter.piece, waiter.stream
            out += self._piece_out(waiter.peer, waiter.request_id, Match(item, matched), asked, stream=stream)[0]
        self._waiting.index(*passed)
        return out

    # -- streams ------------------------------------------------------------------------

    def open_stream(self, item: BufferedItem, now: float) -> list[Outgoing]:
        """A prefill starts publishing `item.stream.layers` layers: streaming lookups can take it."""
        assert item.stream is not None
        item.inserted_at = now
        self.streams.add(item)
        return self._serve_waiters(item, now)

    def stream_layer(
        self, item: BufferedItem, key: torch.Tensor, value: torch.Tensor, ready: torch.cuda.Event | None = None
    ) -> list[Outgoing]:
        """The next layer of an open stream (GPU: written once `ready` fired); its reader, if
        any, gets it now."""
        stream = item.stream
        assert stream is not None and len(stream.keys) < stream.layers
        layer = len(stream.keys)
        stream.keys.append(key)
        stream.values.append(value)
        stream.ready.append(ready)
        self.streams.grow(item, int(key.nbytes + value.nbytes))
        if stream.reader is None:
            return []
        return [_layer_outgoing(stream.reader, item.item_id, layer, key, value, ready)]

    def finish_stream(self, item: BufferedItem, whole: BufferedItem, now: float) -> list[Outgoing]:
        """An open stream ended; `whole` is the same request as one complete item (same id).
        Its reader gets the end and confirms it like a delivered item; without a reader it
        becomes an ordinary buffered item."""
        stream = item.stream
        assert stream is not None and whole.item_id == item.item_id
        reader = stream.reader
        if reader is None:
            self.streams.drop(item)
            return self.insert(whole, now)
        self.streams.forget(item)
        whole.inserted_at = item.inserted_at
        self.buffer.add_taken(whole)
        state = self._peers[reader]
        self._take_back(state, item.item_id)
        self._hand_out(reader, whole, lease=item.lease)  # the reader confirms the end under its stream's lease
        return [_end_outgoing(reader, whole)]

    def abort_stream(self, item: BufferedItem, reason: str) -> list[Outgoing]:
        """The prefill behind an open stream failed: its reader learns why; the stream is gone."""
        stream = item.stream
        assert stream is not None
        if stream.reader is None:
            self.streams.drop(item)
            return []
        self._take_back(self._peers[stream.reader], item.item_id)
        self.streams.forget(item)
        return [Outgoing(stream.reader, m.StreamAbort(item_id=item.item_id, reason=reason))]

    def _attach(self, peer: bytes, request_id: int, item: BufferedItem, matched: int) -> list[Outgoing]:
        """A streaming request takes an open stream: its start, then every layer so far."""
        stream = item.stream
        assert stream is not None
        self.streams.take(item)
        stream.reader = peer
        self._hand_out(peer, item)
        out = [Outgoing(peer, _start_message(request_id, item, matched, stream.layers), item)]
        for layer, (key, value, ready) in enumerate(zip(stream.keys, stream.values, stream.ready, strict=True)):
            out.append(_layer_outgoing(peer, item.item_id, layer, key, value, ready))
        return out

    def _finished_out(
        self, peer: bytes, request_id: int, item: BufferedItem, matched: int, *, whole: bool
    ) -> list[Outgoing]:
        """A streaming request takes a finished item: in one `deliver` if it takes it `whole`,
        else layer by layer."""
        if whole:
            return [self._deliver(peer, request_id, item, matched)]
        return self._stream_whole(peer, request_id, item, matched)

    def _stream_whole(self, peer: bytes, request_id: int, item: BufferedItem, matched: int) -> list[Outgoing]:
        """A streaming request takes a complete item: start, every layer, end, at once."""
        self.buffer.take(item)
        self._hand_out(peer, item)
        return _whole_as_stream(peer, request_id, item, matched)

    def _drop_waiter(self, peer: bytes, request_id: int) -> None:
        waiter = self._waiting.drop(peer, request_id)
        if waiter is None:
            return
        state = self._peers[peer]
        state.waiting.discard(request_id)
        state.waiting_bytes -= waiter.nbytes

    def _forget_peer(self, identity: bytes, now: float) -> list[Outgoing]:
        peer = self._peers.get(identity)
        if peer is None:
            return []
        for request_id in list(peer.waiting):
            self._drop_waiter(identity, request_id)
        del self._peers[identity]
        self._departed.append(Departure(identity, peer.transport, tuple(peer.in_flight.values())))
        out: list[Outgoing] = []
        for item in peer.in_flight.values():
            out += self._restore(item, now)
        return out

    def _add_timer(self, when: float, kind: _TimerKind, key: object) -> None:
        heapq.heappush(self._timers, (when, kind, next(self._timer_order), key))


def _whole_as_stream(peer: bytes, request_id: int, item: BufferedItem, matched: int) -> list[Outgoing]:
    """A complete item in flight to `peer` as a stream: start, every layer, end."""
    layers = item.key.shape[0]
    out = [Outgoing(peer, _start_message(request_id, item, matched, layers), item)]
    for layer in range(layers):
        out.append(_layer_outgoing(peer, item.item_id, layer, item.key[layer], item.value[layer], whole=item))
    out.append(_end_outgoing(peer, item))
    return out


def _better(first: Match, second: Match) -> bool:
    """Longest match first, then oldest."""
    return (first.matched, -first.item.seq) > (second.matched, -second.item.seq)


def _start_message(request_id: int, item: BufferedItem, matched: int, layers: int) -> m.StreamStart:
    input_tokens, roi = item.metas[0], item.metas[1]
    assert input_tokens is not None
    return m.StreamStart(
        request_id=request_id,
        item_id=item.item_id,
        matched=matched,
        input_tokens=input_tokens,
        roi=roi,
        layers=layers,
        payload_bytes=_tokens_bytes(item),
        lease=item.lease,
    )


def _tokens_bytes(item: BufferedItem) -> int:
    """The bytes of the tokens and roi at the head of an item's packed buffer."""
    return max(meta_end(meta) for meta in item.metas[:2] if meta is not None)


def _layer_outgoing(
    peer: bytes, item_id: int, layer: int, key: torch.Tensor, value: torch.Tensor,
    ready: torch.cuda.Event | None = None, *, whole: BufferedItem | None = None,
) -> Outgoing:  # fmt: skip
    """A stream's layer: an open stream's (GPU: written once `ready` fired), or a layer of a
    `whole` item (then `item`: the driver waits for the item's storage, `BufferedItem.written`,
    known once its gathers or its fill were queued)."""
    message = m.StreamLayer(item_id=item_id, layer=layer, key=tensor_meta(key), value=tensor_meta(value))
    return Outgoing(peer, message, whole, tensors=(key, value), ready=ready)


def _end_outgoing(peer: bytes, whole: BufferedItem) -> Outgoing:
    """A stream's end, with the whole item's hidden states if it has them (`item` as for a layer)."""
    if whole.hidden is None:
        return Outgoing(peer, m.StreamEnd(item_id=whole.item_id))
    end = m.StreamEnd(item_id=whole.item_id, hidden=tensor_meta(whole.hidden))
    return Outgoing(peer, end, whole, tensors=(whole.hidden,))


BATCH_SEGMENT_BYTES: Final = 256 << 20
"""A batch's hits under this size share transfers of about this size (packed by the sender: a
transfer's host cost, 0.1-0.15 ms a side on an H200 host, is paid once for many small items);
a larger hit travels alone, straight from its own buffer (no packing copy)."""


def batch_segments(hits: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The transfers of a batch whose hits are at these (offset, nbytes), in order."""
    segments: list[tuple[int, int]] = []
    start = end = None
    for offset, nbytes in hits:
        if nbytes == 0:
            continue
        if nbytes >= BATCH_SEGMENT_BYTES:
            if start is not None and end is not None:
                segments.append((start, end - start))
                start = end = None
            segments.append((offset, nbytes))
            continue
        start = offset if start is None else start
        end = offset + nbytes
        if end - start >= BATCH_SEGMENT_BYTES:
            segments.append((start, end - start))
            start = end = None
    if start is not None and end is not None:
        segments.append((start, end - start))
    return segments


def _hit(item: BufferedItem, matched: int, offset: int) -> m.Hit:
    input_tokens, roi, key, value, hidden = item.metas
    assert input_tokens is not None and key is not None and value is not None
    return m.Hit(item.item_id, matched, input_tokens, roi, key, value, hidden, offset, item.nbytes, item.lease)


def _deliver_message(request_id: int, item: BufferedItem, matched: int) -> m.Deliver:
    input_tokens, roi, key, value, hidden = item.metas
    assert input_tokens is not None and key is not None and value is not None
    return m.Deliver(
        request_id=request_id,
        item_id=item.item_id,
        matched=matched,
        input_tokens=input_tokens,
        roi=roi,
        key=key,
        value=value,
        hidden=hidden,
        payload_bytes=item.nbytes,
        segments=item.segments,
        lease=item.lease,
    )
