"""Consumers' sessions with a producer: who said hello, with which transport, when each was
last heard from, which messages a peer may send in its state (`ACCEPTS`), and how a session
ends (bye, a second hello, silence past its lease, unreachable) with what it held given back.

Receipts and releases are a session's too: they end a delivery's lease, for good or back to
the buffer; a consumer back under its share of unconfirmed bytes is served again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec

from kvrt import _messages as m
from kvrt._errors import ErrorCode
from kvrt._protocol.deliveries import Deliveries
from kvrt._protocol.heartbeats import SILENT_HOLD_LEASES
from kvrt._protocol.lifecycle import Lifecycle
from kvrt._protocol.outgoing import Departure, Outgoing, Refusals
from kvrt._protocol.timers import TimerKind, Timers
from kvrt._protocol.waiting import WaitingRequests


class PeerState(enum.Enum):
    UNKNOWN = "unknown"
    READY = "ready"
    GONE = "gone"
    """Dropped (unreachable, or not reading), holding its items until its lease ends: it may
    still confirm or give them back, or start a new session; nothing else."""


ACCEPTS: Final[dict[PeerState, tuple[type[m.Message], ...]]] = {
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


@dataclass(slots=True)
class Session:
    identity: bytes
    name: str
    transport: str
    last_seen: float
    gone: str | None = None
    """Why it was dropped (see `PeerState.GONE`); None while it is served."""
    capabilities: frozenset[str] = frozenset()
    """What its hello listed (transports, and `Capability` names beyond the base protocol)."""


class Sessions:
    """The producer's consumers by identity: hellos answered, receipts and releases taken,
    sessions ended (see the module's docstring)."""

    def __init__(
        self, lifecycle: Lifecycle, deliveries: Deliveries, waiting: WaitingRequests, timers: Timers,
        refuse: Refusals, *, welcome: m.Welcome, transports: Sequence[str], host: str, same_host_only: frozenset[str],
    ) -> None:  # fmt: skip
        self._lifecycle = lifecycle
        self._deliveries = deliveries
        self._waiting = waiting
        self._timers = timers
        self._refuse = refuse
        self._welcome = welcome
        """What every hello is answered (its transport and capabilities set at the hello)."""
        self.transports = tuple(transports)
        """What this producer can send with, preferred first."""
        self.host = host
        """This producer's machine (see `Hello.host`)."""
        self.same_host_only = same_host_only
        """Transports chosen only for a consumer whose hello names this producer's machine."""
        self.peers: dict[bytes, Session] = {}
        self.departed: list[Departure] = []
        """Peers that left, for the driver to release what their transports held."""

    def __len__(self) -> int:
        """Every session, also those dropped and holding items until their lease ends."""
        return len(self.peers)

    def lease_due(
        self, peer: bytes, now: float, held_until: float, connected: Callable[[bytes], bool]
    ) -> list[Outgoing]:
        """`peer`'s lease timer fell due (see `ProducerCore.expire`): its lease runs on from its
        last message, and not before `held_until` (after a stall of this process); one silent
        past it is forgotten, unless it holds items and is still `connected`, which keeps them,
        served no more, for up to `SILENT_HOLD_LEASES` leases, asked again each heartbeat."""
        session = self.peers.get(peer)
        if session is None:
            return []
        lease_s = self._welcome.lease_s
        expires = max(session.last_seen + lease_s, held_until)
        if expires > now:
            self._timers.add(expires, TimerKind.PEER, peer)
            return []
        hold_until = max(session.last_seen + lease_s * SILENT_HOLD_LEASES, held_until)
        if hold_until > now and self._lifecycle.holds_items(peer) and connected(peer):
            out = self.unreachable(peer, now, "it is silent past its lease, its connection up")
            self._timers.add(min(hold_until, now + self._welcome.heartbeat_s), TimerKind.PEER, peer)
            return out
        return self.forget(peer, now)

    def state(self, peer: bytes) -> PeerState:
        session = self.peers.get(peer)
        if session is None:
            return PeerState.UNKNOWN
        return PeerState.READY if session.gone is None else PeerState.GONE

    def served(self) -> list[Session]:
        """Sessions being served (not those dropped)."""
        return [session for session in self.peers.values() if session.gone is None]

    def transport_of(self, peer: bytes) -> str | None:
        """The transport chosen at `peer`'s hello (None once it left)."""
        session = self.peers.get(peer)
        return None if session is None or session.gone is not None else session.transport

    def takes(self, peer: bytes, capability: m.Capability) -> bool:
        """Whether `peer`'s hello listed `capability` (False once it left)."""
        session = self.peers.get(peer)
        return session is not None and session.gone is None and capability.value in session.capabilities

    # -- a session's messages ---------------------------------------------------------------

    def hello(self, peer: bytes, hello: m.Hello, now: float) -> list[Outgoing]:
        if hello.version != m.PROTOCOL_VERSION:
            text = m.version_mismatch(hello.version, hello.release)
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
        if peer in self.peers:
            # A second hello ends the peer's old session: what it confirmed counts (the receipts
            # its hello repeats, in case one was lost with a broken connection), the rest goes back.
            if hello.received:
                self.received(peer, hello.received, hello.received_leases, now, quiet=True)
            out += self.forget(peer, now)
        self.peers[peer] = Session(
            identity=peer, name=hello.name, transport=transport, last_seen=now, capabilities=frozenset(offered)
        )
        self._lifecycle.hold(peer)
        self._timers.add(now + self._welcome.lease_s, TimerKind.PEER, peer)
        capabilities = [*self.transports, *self._welcome.capabilities]
        welcome = msgspec.structs.replace(self._welcome, transport=transport, capabilities=capabilities)
        out.append(Outgoing(peer, welcome))
        return out

    def received(
        self, peer: bytes, item_ids: list[int], leases: list[int], now: float, *, quiet: bool = False
    ) -> list[Outgoing]:
        """Receipts: the items are delivered for good. `quiet`: receipts repeated by a hello,
        some of them read before: no refusal for those."""
        unknown, open_streams = [], []
        for index, item_id in enumerate(item_ids):
            item = self._lifecycle.held(peer, item_id)
            if item is None or (index < len(leases) and leases[index] != item.lease):
                unknown.append(item_id)  # a receipt whose lease ended: the item went back
            elif item.stream is not None:
                # A stream is confirmed after its end (then its whole item is in flight): before
                # it, its prefill still publishes into it and would grow what was freed.
                open_streams.append(item_id)
            else:
                self._lifecycle.confirm(item)
        out = self._resume_if_under(peer) + self._forget_if_done(peer, now)
        if unknown and not quiet:
            text = f"items {unknown} are not in flight to you (their lease ended, or they were never yours)"
            out.append(self._refuse(peer, None, ErrorCode.NOT_FOUND, text))
        if open_streams and not quiet:
            text = f"streams {open_streams} have not ended: a stream is confirmed after its stream_end"
            out.append(self._refuse(peer, None, ErrorCode.PROTOCOL, text))
        return out

    def release(self, peer: bytes, item_id: int, lease: int, now: float) -> list[Outgoing]:
        item = self._lifecycle.held(peer, item_id, lease)
        if item is None:
            return [self._refuse(peer, None, ErrorCode.NOT_FOUND, f"item {item_id} is not in flight to you")]
        out = self._deliveries.offer(self._lifecycle.give_back(item, now))
        return out + self._resume_if_under(peer) + self._forget_if_done(peer, now)

    # -- a session's end ----------------------------------------------------------------------

    def unreachable(self, peer: bytes, now: float, reason: str) -> list[Outgoing]:
        """Served no more, its waiting requests dropped; what it holds goes back once its lease
        ends, unless it confirms or releases it first."""
        session = self.peers.get(peer)
        if session is None or session.gone is not None:
            return []
        session.gone = reason
        self._waiting.drop_peer(peer)
        return self._forget_if_done(peer, now)

    def forget(self, peer: bytes, now: float) -> list[Outgoing]:
        """The session ends: its waiting requests go, what it held goes back."""
        session = self.peers.pop(peer, None)
        if session is None:
            return []
        self._waiting.drop_peer(peer)
        held = self._lifecycle.leave(peer)
        self.departed.append(Departure(peer, session.transport, held))
        out: list[Outgoing] = []
        for item in held:
            out += self._deliveries.offer(self._lifecycle.give_back(item, now))
        return out

    def _resume_if_under(self, peer: bytes) -> list[Outgoing]:
        if self.state(peer) is not PeerState.READY:
            return []
        return self._deliveries.resume_if_under(peer)

    def _forget_if_done(self, peer: bytes, now: float) -> list[Outgoing]:
        """A dropped peer that holds nothing any more is forgotten now."""
        if self.state(peer) is PeerState.GONE and not self._lifecycle.holds_items(peer):
            return self.forget(peer, now)
        return []
