"""The producer's side of the protocol: `ProducerCore` (see the package's docstring).

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

A consumer whose whole process stops right after a hand-over still has the receipt in it
(libzmq's threads stop too). So one silent past its lease whose connection is still up keeps
its items, served no more, for `SILENT_HOLD_LEASES` leases, unless it confirms, releases or
says hello first; only one whose connection closed (its process died) gives them back when
its lease ends. A stop longer than the hold, landing in that window, is the one case left
where an item can reach two callers.

`ProducerCore` routes each input to the part whose job it is: `Sessions` (who is connected),
`Lifecycle` (every move of an item), `Deliveries` and `PieceDeliveries` (who gets what),
`WaitingRequests` (who waits), `commands` (an operator's questions), `Timers` (what falls due).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Final

from kvrt import _messages as m
from kvrt._errors import ErrorCode, NotFoundError, ProtocolError
from kvrt._protocol import commands
from kvrt._protocol.commands import ProducerCounters
from kvrt._protocol.deliveries import Deliveries
from kvrt._protocol.heartbeats import HEARTBEAT_MISSES
from kvrt._protocol.lifecycle import Lifecycle
from kvrt._protocol.lookup_buffer import BufferedItem, LookupBuffer
from kvrt._protocol.outgoing import Departure, Outgoing, Refusals, end_outgoing, layer_outgoing
from kvrt._protocol.pieces import Cut, PieceDeliveries, no_cut
from kvrt._protocol.sessions import ACCEPTS, PeerState, Sessions
from kvrt._protocol.timers import TimerKind, Timers
from kvrt._protocol.waiting import MAX_WAITING_REQUESTS, WaitingRequests

TICK_FRACTION: Final = 0.25
"""With peers connected, `expire` runs at least every this part of a heartbeat."""
STALL_GAP_FRACTION: Final = 0.5
"""A gap between two `expire` calls over this part of a heartbeat is a stall of this process."""


class ProducerCore:
    """The producer's protocol state: control frames and inserts in, messages to send out."""

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
        cut: Cut = no_cut,
        heads: m.HeadRange | None = None,
        checksum: bool = False,
    ) -> None:
        self.producer_id = producer_id
        self.heads = heads
        """The model's KV heads this producer's items hold, told to consumers in the welcome."""
        self.started_at = started_at
        self.heartbeat_s = heartbeat_s
        self.lease_s = heartbeat_s * HEARTBEAT_MISSES if peer_timeout_s is None else peer_timeout_s
        """How long a consumer keeps what it was delivered after its last message (see the
        module's docstring); also how long it may stay silent before it is forgotten."""
        self.counters = ProducerCounters()
        self.waiting = WaitingRequests(max_waiting)
        """Drop-selects parked until an insert matches them."""
        self._timers = Timers()
        self.lifecycle = Lifecycle(
            self.counters, self._timers, self.waiting, buffer_limit_bytes=buffer_limit_bytes, item_ttl_s=item_ttl_s
        )
        self._refuse = Refusals(self.counters)
        pieces = PieceDeliveries(
            self.lifecycle, self.waiting, self._refuse, cut=cut, new_item_id=self.new_item_id,
            peers=lambda: len(self.sessions), waits_for_readers=item_ttl_s is not None,
        )  # fmt: skip
        self.deliveries = Deliveries(self.lifecycle, self.waiting, pieces, self._timers, self._refuse, self.counters)
        welcome = m.Welcome(
            version=m.PROTOCOL_VERSION, producer_id=producer_id, heartbeat_s=heartbeat_s, lease_s=self.lease_s,
            heads=heads, release=m.RELEASE,
            capabilities=[m.Capability.PROBE_MANY.value, *([m.Capability.CHECKSUM.value] if checksum else [])],
        )  # fmt: skip
        self.sessions = Sessions(
            self.lifecycle, self.deliveries, self.waiting, self._timers, self._refuse, welcome=welcome,
            transports=transports, host=host, same_host_only=same_host_only,
        )  # fmt: skip
        self._next_item_id = 0
        self._last_expire: float | None = None
        self._hold_leases_until = 0.0

    # -- what the driver reads ----------------------------------------------------------

    @property
    def buffer(self) -> LookupBuffer:
        return self.lifecycle.buffer

    @property
    def streams(self) -> LookupBuffer:
        """Open streams: prefills still publishing layers, which streaming lookups can take."""
        return self.lifecycle.streams

    @property
    def buffer_limit_bytes(self) -> int:
        return self.lifecycle.buffer_limit_bytes

    @buffer_limit_bytes.setter
    def buffer_limit_bytes(self, limit: int) -> None:
        self.lifecycle.buffer_limit_bytes = limit

    @property
    def transports(self) -> tuple[str, ...]:
        """What this producer can send with, preferred first."""
        return self.sessions.transports

    @transports.setter
    def transports(self, names: Sequence[str]) -> None:
        self.sessions.transports = tuple(names)

    @property
    def refusals(self) -> dict[str, int]:
        """Error replies sent, by error code (for metrics)."""
        return self._refuse.by_code

    @property
    def peer_timeout_s(self) -> float:
        return self.lease_s

    @property
    def peer_count(self) -> int:
        """Consumers being served (not those dropped and holding items until their lease ends)."""
        return len(self.sessions.served())

    @property
    def waiting_count(self) -> int:
        return len(self.waiting)

    def peers_by_transport(self) -> dict[str, int]:
        """Connected consumers by the transport chosen at their hello."""
        return dict(Counter(session.transport for session in self.sessions.served()))

    def next_deadline(self) -> float | None:
        """When to call `expire` next: the first timer, and with peers connected at least every
        quarter heartbeat (so that a gap between calls tells a stalled loop, see `expire`)."""
        first = self._timers.first
        if self.sessions.peers and self._last_expire is not None:
            tick = self._last_expire + self.heartbeat_s * TICK_FRACTION
            first = tick if first is None else min(first, tick)
        return first

    def new_item_id(self) -> int:
        self._next_item_id += 1
        return self._next_item_id

    def transport_of(self, peer: bytes) -> str | None:
        """The transport chosen at `peer`'s hello (None once it left)."""
        return self.sessions.transport_of(peer)

    def takes(self, peer: bytes, capability: m.Capability) -> bool:
        """Whether `peer`'s hello listed `capability` (False once it left)."""
        return self.sessions.takes(peer, capability)

    def take_departed(self) -> list[Departure]:
        """Peers that left since the last call: the driver releases what their transports held."""
        departed, self.sessions.departed = self.sessions.departed, []
        return departed

    # -- inputs -------------------------------------------------------------------------

    def receive(self, peer: bytes, frame: bytes | memoryview, extra_frames: int, now: float) -> list[Outgoing]:
        """One control frame from `peer` (with `extra_frames` payload frames after it)."""
        try:
            message = m.decode(frame)
        except ProtocolError as exc:
            return [self._refuse(peer, m.peek_request_id(frame), exc.code, str(exc))]
        request_id = getattr(message, "request_id", None)
        session = self.sessions.peers.get(peer)
        state = PeerState.UNKNOWN if session is None else PeerState.READY if session.gone is None else PeerState.GONE
        if not isinstance(message, ACCEPTS[state]):
            if state is not PeerState.READY:
                text = "this producer does not know you (it restarted, or you were silent too long): send hello"
                return [self._refuse(peer, request_id, ErrorCode.UNKNOWN_PEER, text)]
            text = f"a producer never accepts {type(message).__name__}"
            return [self._refuse(peer, request_id, ErrorCode.PROTOCOL, text)]
        if extra_frames:
            text = f"{type(message).__name__} carries no payload frames, got {extra_frames}"
            return [self._refuse(peer, request_id, ErrorCode.PROTOCOL, text)]
        if session is not None:
            session.last_seen = now
        match message:
            case m.Hello():
                return self.sessions.hello(peer, message, now)
            case m.Ping(nonce=nonce):
                return [Outgoing(peer, m.Pong(nonce=nonce))]
            case m.Bye():
                return self.sessions.forget(peer, now)
            case m.DropSelect():
                return self.deliveries.drop_select(peer, message, now)
            case m.DropSelectMany():
                return self.deliveries.drop_select_many(peer, message, now)
            case m.Cancel(request_id=request_id):
                self.waiting.drop(peer, request_id)
                return []
            case m.Received(item_ids=item_ids, leases=leases):
                return self.sessions.received(peer, item_ids, leases, now)
            case m.Release(item_id=item_id, lease=lease):
                return self.sessions.release(peer, item_id, lease, now)
            case m.Health() | m.Stats() | m.Probe() | m.ProbeMany() | m.ListItems() | m.Evict():
                return [self._command(peer, message, now)]
        raise AssertionError(f"unhandled {message!r}")  # the accept table and the match disagree

    def insert(self, item: BufferedItem, now: float) -> list[Outgoing]:
        """Buffer a new item; a waiting request it matches gets it at once."""
        self.lifecycle.insert(item, now)
        return self.deliveries.offer(item)

    def drop(self, item: BufferedItem) -> None:
        """Evict a buffered item (operator's request or its TTL)."""
        self.lifecycle.drop(item)

    def discard(self, item: BufferedItem) -> list[Outgoing]:
        """Forget an item whose bytes can never be sent (its gathers failed to queue), whether
        buffered or in flight: it is not given back to the buffer when its peer leaves."""
        now = self._last_expire or 0.0
        return self.deliveries.offer(self.lifecycle.discard(item, now))

    def peer_unreachable(self, peer: bytes, now: float, reason: str = "unreachable") -> list[Outgoing]:
        """The driver gave up sending to `peer` (it disconnected, or does not read): it is
        served no more, its waiting requests are dropped, and what it holds goes back once its
        lease ends, unless it confirms or releases it first."""
        return self.sessions.unreachable(peer, now, reason)

    def refusal(self, peer: bytes, request_id: int | None, code: ErrorCode, text: str) -> Outgoing:
        """An error reply to `peer`, counted (the driver's, for a frame it could not handle)."""
        return self._refuse(peer, request_id, code, text)

    def unsendable(self, send: Outgoing, reason: str, now: float) -> list[Outgoing]:
        """A message that could not be built: the items it carried go back to the buffer, and
        its request (if it names one) fails with an internal error."""
        out: list[Outgoing] = []
        for item in (send.item, *send.items):
            if item is not None and self.lifecycle.held(send.peer, item.item_id) is item:
                out += self.deliveries.offer(self.lifecycle.give_back(item, now))
        request_id = getattr(send.message, "request_id", None)
        if request_id is not None:
            text = f"the reply could not be built: {reason}"
            out.append(self._refuse(send.peer, request_id, ErrorCode.INTERNAL, text))
        return out

    def expire(self, now: float, connected: Callable[[bytes], bool] = lambda peer: False) -> list[Outgoing]:
        """Answer waiting requests whose timeout passed; forget peers silent for too long.

        A peer silent past its lease that holds items and is still `connected` (the driver's
        answer: its connection is up) is served no more but keeps them for up to
        `SILENT_HOLD_LEASES` leases, asked again each heartbeat (see the module's docstring).

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
        for kind, key in self._timers.due(now):
            if kind is TimerKind.PEER:
                assert isinstance(key, bytes)
                out += self.sessions.lease_due(key, now, self._hold_leases_until, connected)
            elif kind is TimerKind.ITEM:
                assert isinstance(key, BufferedItem)
                self.lifecycle.expire(key)
            else:
                assert isinstance(key, tuple)
                waiter = self.waiting.get(key)
                if waiter is not None and waiter.deadline is not None and waiter.deadline <= now:
                    self.waiting.drop(waiter.peer, waiter.request_id)
                    self.counters.misses += 1
                    out.append(Outgoing(waiter.peer, m.Miss(request_id=waiter.request_id)))
        return out

    def close(self, reason: str) -> list[Outgoing]:
        """Say Bye to every peer. Items in flight return to the buffer (which closes with us)."""
        self.lifecycle.closed = True
        out = [Outgoing(peer, m.Bye(reason=reason)) for peer in self.sessions.peers]
        for identity in list(self.sessions.peers):
            self.sessions.forget(identity, now=0.0)
        self._timers.clear()
        return out

    # -- streams --------------------------------------------------------------------------

    def open_stream(self, item: BufferedItem, now: float) -> list[Outgoing]:
        """A prefill starts publishing `item.stream.layers` layers: streaming lookups can take it."""
        self.lifecycle.open(item, now)
        return self.deliveries.offer(item)

    def stream_layer(self, item: BufferedItem, key: m.TensorMeta, value: m.TensorMeta) -> list[Outgoing]:
        """The next layer of an open stream, its key and value as they travel (the driver put
        their tensors in the stream's store); its reader, if any, gets it now."""
        layer, reader = self.lifecycle.grew(item, key, value)
        return [] if reader is None else [layer_outgoing(reader, item, layer, key, value)]

    def finish_stream(self, item: BufferedItem, whole: BufferedItem, now: float) -> list[Outgoing]:
        """An open stream ended; `whole` is the same request as one complete item (same id).
        Its reader gets the end and confirms it like a delivered item; without a reader it
        becomes an ordinary buffered item."""
        reader = self.lifecycle.finish(item, whole, now)
        if reader is None:
            return self.deliveries.offer(whole)
        return [end_outgoing(reader, whole)]

    def abort_stream(self, item: BufferedItem, reason: str) -> list[Outgoing]:
        """The prefill behind an open stream failed: its reader learns why; the stream is gone."""
        reader = self.lifecycle.abort(item)
        if reader is None:
            return []
        return [Outgoing(reader, m.StreamAbort(item_id=item.item_id, reason=reason))]

    # -- operators -----------------------------------------------------------------------

    def _command(self, peer: bytes, command: commands.Command, now: float) -> Outgoing:
        """An operator's question or command (`kvrt._protocol.commands`), answered at once."""
        try:
            return Outgoing(peer, commands.answer(command, now, self.buffer, self.counters, self._facts, self.drop))
        except (ProtocolError, NotFoundError) as exc:
            return self._refuse(peer, command.request_id, exc.code, str(exc))

    def _facts(self) -> commands.Facts:
        return commands.Facts(
            self.producer_id, self.started_at, self.transports, self.buffer_limit_bytes, len(self.sessions),
            len(self.waiting),
        )  # fmt: skip
