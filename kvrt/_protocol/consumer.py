"""One consumer's side of one producer link: `ConsumerCore` (see the package's docstring).

A link's states and their transitions are in `_CONSUMER_TRANSITIONS`; the events a frame
turns into (`ConsumerEvent`) are what the driver acts on. How the consumer reckons its side of
an item's lease is in `kvrt._protocol.producer`'s docstring.
"""

from __future__ import annotations

import collections
import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from kvrt import _messages as m
from kvrt._errors import ClosedError, ErrorCode, KVRTError, PeerLostError, RemoteProtocolError, error_from_code
from kvrt._protocol.heartbeats import HEARTBEAT_MISSES

MAX_ABANDONED: Final = 4096
"""Requests a consumer link remembers having abandoned, to read their late misses quietly."""


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    LOST = "lost"
    CLOSED = "closed"


_CONSUMER_TRANSITIONS: Final[dict[tuple[LinkState, str], LinkState]] = {
    (LinkState.CONNECTING, "welcome"): LinkState.READY,
    (LinkState.READY, "welcome"): LinkState.READY,
    (LinkState.LOST, "welcome"): LinkState.READY,
    (LinkState.CONNECTING, "silence"): LinkState.LOST,
    (LinkState.READY, "silence"): LinkState.LOST,
    (LinkState.READY, "bye"): LinkState.LOST,
    (LinkState.READY, "unknown_peer"): LinkState.LOST,
    (LinkState.READY, "afresh"): LinkState.CONNECTING,
    (LinkState.LOST, "retry"): LinkState.CONNECTING,
    (LinkState.CONNECTING, "close"): LinkState.CLOSED,
    (LinkState.READY, "close"): LinkState.CLOSED,
    (LinkState.LOST, "close"): LinkState.CLOSED,
}
"""(state, what happened) → next state. Pairs not listed leave the state as it is."""


@dataclass(frozen=True, slots=True)
class Welcomed:
    welcome: m.Welcome


@dataclass(frozen=True, slots=True)
class Replied:
    """The answer to a pending request: Deliver, Miss, or a reply of another operation."""

    request_id: int
    message: m.Message


@dataclass(frozen=True, slots=True)
class Failed:
    request_id: int
    error: KVRTError


@dataclass(frozen=True, slots=True)
class Stray:
    """A Deliver, DeliverMany or StreamStart for a request that is no longer pending: release
    its items (a stream's layers that follow are dropped)."""

    message: m.Deliver | m.DeliverMany | m.StreamStart


@dataclass(frozen=True, slots=True)
class PayloadCame:
    """The frames of a delivery whose header came before them (TCP, large payloads)."""

    message: m.Payload


@dataclass(frozen=True, slots=True)
class Streamed:
    """A layer, the end, or the abort of a stream this link reads (by item id)."""

    message: m.StreamLayer | m.StreamEnd | m.StreamAbort


@dataclass(frozen=True, slots=True)
class Refused:
    """The producer refused a message that had no request id (a hello, a receipt)."""

    error: KVRTError


@dataclass(frozen=True, slots=True)
class Lost:
    """The producer is gone; every pending request failed with `error`."""

    error: KVRTError
    request_ids: tuple[int, ...]


ConsumerEvent = Welcomed | Replied | Failed | Stray | Lost | Refused | Streamed | PayloadCame


LEASE_MARGIN_FRACTION: Final = 0.1
"""The part of its lease a consumer leaves unused, so that the receipt of an item handed over
at the lease's last moment still reaches the producer inside it."""


class ConsumerCore:
    """One consumer's link to one producer: handshake, heartbeats, pending request ids, and the
    lease under which delivered items may be handed to callers.

    The lease runs from the send time of the last message the producer answered (a request,
    a ping, the hello) for the `lease_s` its welcome named: the producer's own reckoning
    starts later (when it received a message), so while this side's lease holds, the producer
    has given none of this link's items to anyone else. Past it the session is lost: pending
    calls fail, items that arrive are not handed over, and the link says hello again.
    """

    def __init__(
        self, *, endpoint: str, name: str, heartbeat_s: float, transports: Sequence[str] = ("tcp",), host: str = ""
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.transports = tuple(transports)
        """What this consumer can receive with, preferred first (sent in hello)."""
        self.host = host
        """This consumer's machine (see `Hello.host`)."""
        self.heartbeat_s = heartbeat_s
        self.state = LinkState.CONNECTING
        self.producer_id: str | None = None
        self.producer_release = ""
        """The producer's kvrt release, from its welcome ("" from a release before 0.3)."""
        self.transport: str | None = None
        self.heads: m.HeadRange | None = None
        self.producer_capabilities: frozenset[str] = frozenset()
        """What the producer's welcome lists: its transports and the operations it answers
        beyond the base protocol (`m.Capability`)."""
        """The model's KV heads the producer's items hold, if it was told (from its welcome)."""
        self.lease_s = heartbeat_s * HEARTBEAT_MISSES
        """The producer's lease (from its welcome; this side's default until then)."""
        self._request_ids = itertools.count(1)
        self._pending: dict[int, float] = {}
        self._abandoned: collections.OrderedDict[int, None] = collections.OrderedDict()
        """Requests abandoned lately (the last `MAX_ABANDONED`): their misses may still come."""
        """Request ids waiting for their answer, with the time each was sent."""
        self._pings: dict[int, float] = {}
        """Pings waiting for their pong, by nonce, with the time each was sent."""
        self._ping_nonces = itertools.count(1)
        self._hello_sent_at = 0.0
        self._answered_at = 0.0
        """Send time of the last message the producer answered: the lease runs from it."""
        self._lost_because = ""
        self._next_ping = 0.0
        self._sent_receipts: collections.deque[tuple[int, int]] = collections.deque(maxlen=m.MAX_RECEIPTS)
        """(item id, lease) of the receipts sent in this session (the last `MAX_RECEIPTS`), for
        the hello of the next one to repeat."""

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def timeout_s(self) -> float:
        return self.lease_s

    @property
    def lease_ends(self) -> float:
        """When this side's lease ends (see the class docstring), with its margin taken off."""
        return self._answered_at + self.lease_s * (1 - LEASE_MARGIN_FRACTION)

    def lease_holds(self, now: float) -> bool:
        """Whether an item delivered in this session may be handed to a caller at `now`."""
        return self.state is LinkState.READY and now < self.lease_ends

    def _answered(self, sent_at: float | None) -> None:
        if sent_at is not None and sent_at > self._answered_at:
            self._answered_at = sent_at

    def _move(self, event: str) -> None:
        self.state = _CONSUMER_TRANSITIONS.get((self.state, event), self.state)

    def connect(self, now: float) -> m.Hello:
        """The hello to send now (at start, and on each retry while the producer is lost),
        repeating the receipts sent in the session it ends (see `Hello.received`): one that
        travelled on a connection that broke may never have been read."""
        self._hello_sent_at = now
        self._next_ping = now + self.heartbeat_s
        sent = self._sent_receipts
        capabilities = list(self.transports)
        if m.Capability.TCP in capabilities:
            capabilities.append(m.Capability.TCP_FRAMES.value)
        return m.Hello(
            version=m.PROTOCOL_VERSION, name=self.name, capabilities=capabilities, host=self.host,
            received=[item_id for item_id, _ in sent], received_leases=[lease for _, lease in sent],
            release=m.RELEASE,
        )  # fmt: skip

    def receipts_sent(self, receipts: Sequence[tuple[int, int]]) -> None:
        """(item id, lease) receipts just sent: the next session's hello repeats them."""
        self._sent_receipts.extend(receipts)

    def start_request(self, build: Callable[[int], m.Message], now: float) -> tuple[int, m.Message]:
        """Reserve a request id and build the message carrying it, sent at `now`; fails if not
        connected."""
        if self.state is not LinkState.READY:
            raise self._not_ready_error()
        request_id = next(self._request_ids)
        self._pending[request_id] = now
        return request_id, build(request_id)

    def is_pending(self, request_id: int) -> bool:
        """Whether `request_id` still waits for its answer."""
        return request_id in self._pending

    def abandon(self, request_id: int) -> m.Cancel | None:
        """The caller stopped waiting (cancelled): the Cancel to send, if still pending."""
        if self._pending.pop(request_id, None) is not None:
            self._abandoned[request_id] = None
            if len(self._abandoned) > MAX_ABANDONED:
                self._abandoned.popitem(last=False)
            return m.Cancel(request_id=request_id) if self.state is LinkState.READY else None
        return None

    def receive(self, frame: bytes | memoryview, now: float) -> ConsumerEvent | None:
        """One frame from the producer. Raises `RemoteProtocolError` for one that does not
        decode; the caller drops that frame and goes on."""
        message = m.decode(frame)
        match message:
            case m.Welcome():
                restarted = self.producer_id is not None and message.producer_id != self.producer_id
                self._answered(self._hello_sent_at)
                self._accept_welcome(message)
                if restarted and self._pending:
                    return self._lose(PeerLostError(f"producer at {self.endpoint} restarted"), "welcome")
                return Welcomed(message)
            case m.Pong(nonce=nonce):
                self._answered(self._pings.pop(nonce, None))
                return None
            case m.Bye(reason=reason):
                return self._lose(PeerLostError(f"producer at {self.endpoint} closed ({reason})"), "bye")
            case (
                m.Deliver(request_id=request_id)
                | m.DeliverMany(request_id=request_id)
                | m.StreamStart(request_id=request_id)
            ):
                if request_id in self._pending:
                    self._answered(self._pending.pop(request_id))
                    return Replied(request_id, message)
                return Stray(message)
            case m.StreamLayer() | m.StreamEnd() | m.StreamAbort():
                return Streamed(message)
            case m.Payload():
                return PayloadCame(message)
            case m.ErrorReply(request_id=request_id, code=code, message=said):
                text = m.quoted(said)
                if code is ErrorCode.UNKNOWN_PEER:
                    return self._lose(PeerLostError(f"producer at {self.endpoint}: {text}"), "unknown_peer")
                if request_id is not None and request_id in self._pending:
                    self._answered(self._pending.pop(request_id))
                    return Failed(request_id, error_from_code(code, f"producer at {self.endpoint}: {text}"))
                if code is ErrorCode.VERSION:
                    text += f" (this consumer: kvrt {m.RELEASE}, protocol version {m.PROTOCOL_VERSION})"
                return Refused(error_from_code(code, f"producer at {self.endpoint} refused: {text}"))
            case _:
                request_id = getattr(message, "request_id", None)
                if isinstance(request_id, int) and request_id in self._pending:
                    self._answered(self._pending.pop(request_id))
                    return Replied(request_id, message)
                if isinstance(message, m.Miss) and self._abandoned.pop(message.request_id, 0) is None:
                    return None  # the answer to a request this side stopped waiting for, already on its way
                raise RemoteProtocolError(f"unexpected {type(message).__name__} from producer at {self.endpoint}")

    def next_deadline(self) -> float | None:
        if self.state is LinkState.CLOSED:
            return None
        if self.state is LinkState.READY:
            return min(self._next_ping, self.lease_ends)
        if self.state is LinkState.CONNECTING:
            return min(self._next_ping, self._hello_sent_at + self.lease_s)
        return self._next_ping

    def expire(self, now: float) -> tuple[list[m.Message], Lost | None]:
        """Messages due now (a ping, or a hello while lost) and a Lost event if the lease ended
        (the producer answered nothing for it) or a hello went unanswered as long.

        A link found lost here says hello again one heartbeat later, and every heartbeat after.
        """
        unanswered = (self.state is LinkState.READY and now >= self.lease_ends) or (
            self.state is LinkState.CONNECTING and now >= self._hello_sent_at + self.lease_s
        )
        if unanswered:
            self._next_ping = now + self.heartbeat_s
            error = PeerLostError(
                f"producer at {self.endpoint} answered nothing for {self.lease_s:.1f} s, so what it delivered "
                "is no longer this consumer's; is it running and reachable?"
            )
            return [], self._lose(error, "silence")
        if now < self._next_ping:
            return [], None
        self._next_ping = now + self.heartbeat_s
        if self.state is LinkState.LOST:
            self._move("retry")
            return [self.connect(now)], None
        if self.state is LinkState.READY:
            nonce = next(self._ping_nonces)
            self._pings[nonce] = now
            if len(self._pings) > HEARTBEAT_MISSES * 2:  # pongs that will never come
                self._pings.pop(next(iter(self._pings)))
            return [m.Ping(nonce=nonce)], None
        return [], None

    def disconnected(self, reason: str) -> Lost | None:
        """The connection to the producer closed (it exited, or stopped answering ZeroMQ's
        heartbeats): every pending request fails now; the link says hello once it reconnects."""
        if self.state is not LinkState.READY and self.state is not LinkState.CONNECTING:
            return None
        return self._lose(PeerLostError(f"the connection to the producer at {self.endpoint} closed: {reason}"))

    def reconnected(self, now: float) -> m.Hello | None:
        """The connection is back: the hello to send at once if the link is lost."""
        if self.state is LinkState.LOST:
            self._move("retry")
            return self.connect(now)
        return None

    def close(self) -> Lost:
        return self._lose(ClosedError("the consumer was closed while the call was pending"), "close")

    def start_afresh(self, error: KVRTError, now: float) -> tuple[Lost, m.Hello]:
        """This side can no longer trust the session (a transfer it could not take left an
        out-of-band pair out of step): every pending request fails with `error`, and the
        hello to send starts a new session, in which the producer takes back what the old
        one held and pairs anew."""
        lost = self._lose(error, "afresh")
        return lost, self.connect(now)

    def _accept_welcome(self, welcome: m.Welcome) -> None:
        self._sent_receipts.clear()  # the hello it answers settled them
        self.producer_id = welcome.producer_id
        self.producer_release = welcome.release
        self.transport = welcome.transport
        self.heads = welcome.heads
        self.producer_capabilities = frozenset(welcome.capabilities)
        self.heartbeat_s = min(self.heartbeat_s, welcome.heartbeat_s)
        if welcome.lease_s > 0:
            self.lease_s = welcome.lease_s
        self._move("welcome")

    def _lose(self, error: KVRTError, event: str = "silence") -> Lost:
        self._lost_because = str(error)
        pending = tuple(self._pending)
        self._pending.clear()
        self._pings.clear()
        self._move(event)
        return Lost(error, pending)

    def _not_ready_error(self) -> KVRTError:
        if self.state is LinkState.CLOSED:
            return ClosedError("the consumer is closed")
        because = f": {self._lost_because}" if self._lost_because else ""
        return PeerLostError(
            f"producer at {self.endpoint} is not connected ({self.state.value}){because}; the link retries by itself"
        )
