"""Consumers' sessions with a producer: who said hello, with which transport, when each was
last heard from, and which messages a peer may send in its state (`ACCEPTS`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from kvrt import _messages as m


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


class Sessions:
    """The producer's consumers by identity, and what a hello is answered."""

    def __init__(self, transports: Sequence[str], *, host: str, same_host_only: frozenset[str]) -> None:
        self.transports = tuple(transports)
        """What this producer can send with, preferred first."""
        self.host = host
        """This producer's machine (see `Hello.host`)."""
        self.same_host_only = same_host_only
        """Transports chosen only for a consumer whose hello names this producer's machine."""
        self.peers: dict[bytes, Session] = {}

    def __len__(self) -> int:
        """Every session, also those dropped and holding items until their lease ends."""
        return len(self.peers)

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

    def transport_for(self, hello: m.Hello) -> str | None:
        """The transport this producer sends to the consumer of `hello` with; None if none fits."""
        offered = hello.capabilities or [m.Capability.TCP.value]
        same_host = bool(self.host) and hello.host == self.host
        return next(
            (name for name in self.transports if name in offered and (same_host or name not in self.same_host_only)),
            None,
        )

    def start(self, peer: bytes, hello: m.Hello, transport: str, now: float) -> None:
        self.peers[peer] = Session(identity=peer, name=hello.name, transport=transport, last_seen=now)
