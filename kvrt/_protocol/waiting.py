"""Drop-selects that wait for an insert: one record each, the producer's bounds on them, and the
indexes an insert searches.

A request that finds nothing and may wait is parked here (`WaitingRequests.park`) until an
inserted or returned item matches it, its timeout passes, its peer cancels it or leaves. A
waiter is in one of three indexes by what it takes: plain items, streams (open or finished),
or pieces of an item (a head range); each is searched by walking one path of a radix tree
(`RadixIndex.oldest_match`), not by scanning the waiters. A waiter can be out of its index
and still parked: its peer holds more than its share of unconfirmed bytes (the producer stops
serving it until it confirms), or an item it cannot take is being served to the others.

Plain values only: the protocol core (`kvrt._protocol`) decides who is served; this module
keeps who waits, and says which waiter an item is for.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from kvrt import _messages as m
from kvrt._protocol.lookup_buffer import RadixIndex

MAX_WAITING_REQUESTS: Final = 65536
"""Most drop-selects one producer keeps waiting for an insert, over all consumers."""
MAX_WAITING_PER_PEER: Final = 4096
"""Most drop-selects one consumer keeps waiting: one peer cannot lock the others out."""
MAX_WAITING_QUERY_BYTES_PER_PEER: Final = 64 << 20
"""Most bytes of tokens one consumer's waiting drop-selects hold in the producer."""
MAX_WAITING_QUERY_BYTES: Final = 1 << 30
"""Most bytes of tokens all waiting drop-selects hold in the producer."""

_NO_TOKENS: Final = np.empty(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class PieceAsked:
    """What a request for a piece of an item names (`DropSelect.heads`, `readers`, `hidden`)."""

    heads: m.HeadRange
    readers: int
    hidden: bool

    @staticmethod
    def of(request: m.DropSelect | m.DropSelectMany) -> PieceAsked | None:
        if request.heads is None:
            return None
        return PieceAsked(request.heads, request.readers, request.hidden)


@dataclass(eq=False, slots=True)
class Waiter:
    """A drop-select waiting for an insert; indexed by its query (see `_Index`)."""

    peer: bytes
    request_id: int
    query: np.ndarray | None
    deadline: float | None
    stream: bool
    seq: int
    """Its place in the order of arrival: the oldest matching waiter is served first."""
    piece: PieceAsked | None = None
    whole: bool = False
    """A streaming request that takes a finished item as one `deliver` (`DropSelect.whole`)."""
    masked_tokens: np.ndarray = field(default_factory=lambda: _NO_TOKENS)

    @property
    def nbytes(self) -> int:
        return 0 if self.query is None else int(self.query.nbytes)


class _Index:
    """Waiters of one kind by query, so that an insert finds the oldest one its item matches by
    walking one path (`RadixIndex.oldest_match`), not by scanning them all."""

    def __init__(self) -> None:
        self.by_query: RadixIndex[Waiter] = RadixIndex()
        self.takers: dict[tuple[bytes, int], Waiter] = {}
        """Waiters with no query (they take any item), oldest first."""

    def add(self, waiter: Waiter) -> None:
        if waiter.query is None:
            self.takers[(waiter.peer, waiter.request_id)] = waiter
        else:
            waiter.masked_tokens = waiter.query
            self.by_query.add(waiter)

    def remove(self, waiter: Waiter) -> None:
        if waiter.query is None:
            self.takers.pop((waiter.peer, waiter.request_id), None)
        elif waiter in self.by_query:
            self.by_query.remove(waiter)

    def reorder_takers(self) -> None:
        """Waiters with no query oldest first again (after some were taken out and put back)."""
        self.takers = dict(sorted(self.takers.items(), key=lambda entry: entry[1].seq))

    def oldest_match(self, tokens: np.ndarray) -> tuple[Waiter, int] | None:
        found = self.by_query.oldest_match(tokens)
        if self.takers and len(tokens):
            taker = next(iter(self.takers.values()))
            if found is None or taker.seq < found[0].seq:
                return taker, len(tokens)
        return found


def _older(found: tuple[Waiter, int] | None, other: tuple[Waiter, int] | None) -> tuple[Waiter, int] | None:
    if other is not None and (found is None or other[0].seq < found[0].seq):
        return other
    return found


class WaitingRequests:
    """Every parked drop-select of a producer, by (peer, request id) and by peer, and the
    indexes an item is matched against; which peers are not served for now (`suspend`)."""

    def __init__(self, max_waiting: int = MAX_WAITING_REQUESTS) -> None:
        self._max_waiting = max_waiting
        self._by_key: dict[tuple[bytes, int], Waiter] = {}
        self._by_peer: dict[bytes, dict[int, Waiter]] = {}
        self._peer_bytes: dict[bytes, int] = {}
        self._suspended: set[bytes] = set()
        self._plain = _Index()
        self._streams = _Index()
        self._pieces = _Index()
        """Requests for a piece of an item (plain or streamed)."""
        self._seq = itertools.count()
        self.nbytes = 0
        """Bytes of tokens all waiting requests hold."""

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: tuple[bytes, int]) -> bool:
        return key in self._by_key

    def get(self, key: tuple[bytes, int]) -> Waiter | None:
        return self._by_key.get(key)

    def refusal(self, peer: bytes, query_bytes: int) -> str | None:
        """Why one more waiting request of `query_bytes` from `peer` is over a bound; None
        when it fits."""
        peer_waiting = len(self._by_peer.get(peer, ()))
        peer_bytes = self._peer_bytes.get(peer, 0)
        if peer_waiting >= MAX_WAITING_PER_PEER:
            return f"you have {peer_waiting} requests waiting on this producer already"
        if peer_bytes + query_bytes > MAX_WAITING_QUERY_BYTES_PER_PEER:
            return f"your waiting requests hold {peer_bytes} bytes of tokens already"
        if len(self._by_key) >= self._max_waiting or self.nbytes + query_bytes > MAX_WAITING_QUERY_BYTES:
            return f"{len(self._by_key)} requests already wait on this producer"
        return None

    def park(self, peer: bytes, request: m.DropSelect, query: np.ndarray | None, deadline: float | None) -> Waiter:
        """Keep `request` waiting (the caller checked `refusal`); in its index unless its peer
        is not served for now (`suspend`)."""
        waiter = Waiter(
            peer, request.request_id, query, deadline, request.stream, next(self._seq), PieceAsked.of(request),
            whole=request.whole,
        )  # fmt: skip
        self._by_key[(peer, request.request_id)] = waiter
        self._by_peer.setdefault(peer, {})[request.request_id] = waiter
        self._peer_bytes[peer] = self._peer_bytes.get(peer, 0) + waiter.nbytes
        self.nbytes += waiter.nbytes
        if peer not in self._suspended:
            self._index_of(waiter).add(waiter)
        return waiter

    def drop(self, peer: bytes, request_id: int) -> Waiter | None:
        """Forget a waiting request (served, timed out, cancelled, its peer gone)."""
        waiter = self._by_key.pop((peer, request_id), None)
        if waiter is not None:
            self._index_of(waiter).remove(waiter)
            self.nbytes -= waiter.nbytes
            mine = self._by_peer[peer]
            del mine[request_id]
            if mine:
                self._peer_bytes[peer] -= waiter.nbytes
            else:
                del self._by_peer[peer], self._peer_bytes[peer]
        return waiter

    def of_peer(self, peer: bytes) -> list[Waiter]:
        """`peer`'s waiting requests, by request id (oldest first)."""
        return sorted(self._by_peer.get(peer, {}).values(), key=lambda waiter: waiter.request_id)

    def drop_peer(self, peer: bytes) -> None:
        """`peer` left: its waiting requests go."""
        for waiter in self.of_peer(peer):
            self.drop(peer, waiter.request_id)
        self._suspended.discard(peer)

    def suspended(self, peer: bytes) -> bool:
        return peer in self._suspended

    def suspend(self, peer: bytes) -> None:
        """Serve `peer` no more for now: its waiting requests leave the indexes, still waiting."""
        self._suspended.add(peer)
        for waiter in self._by_peer.get(peer, {}).values():
            self._index_of(waiter).remove(waiter)

    def resume(self, peer: bytes) -> list[Waiter]:
        """Serve `peer` again: its waiting requests, oldest first, each for the caller to serve
        or to put back in its index (`index`); until it is suspended again."""
        self._suspended.discard(peer)
        return self.of_peer(peer)

    def unindex(self, waiter: Waiter) -> None:
        """Out of its index, still waiting: no item is matched against it until `index`."""
        self._index_of(waiter).remove(waiter)

    def index(self, *waiters: Waiter) -> None:
        """Back in their indexes, in their order of arrival among the others."""
        reordered: dict[int, _Index] = {}
        for waiter in waiters:
            index = self._index_of(waiter)
            index.add(waiter)
            if waiter.query is None:  # a taker of any item goes back among the others by age
                reordered[id(index)] = index
        for index in reordered.values():
            index.reorder_takers()

    def oldest_for(self, item_tokens: np.ndarray, *, open_stream: bool) -> tuple[Waiter, int] | None:
        """The oldest waiter an item of `item_tokens` matches, and how many tokens: any kind
        for a buffered item, only a streaming request for an open stream (pieces are cut from
        inserted items only)."""
        found = self._streams.oldest_match(item_tokens)
        if open_stream:
            return found
        found = _older(found, self._pieces.oldest_match(item_tokens))
        return _older(found, self._plain.oldest_match(item_tokens))

    def oldest_piece_waiter(self, item_tokens: np.ndarray) -> tuple[Waiter, int] | None:
        """The oldest request for a piece that an item of `item_tokens` matches."""
        return self._pieces.oldest_match(item_tokens)

    def _index_of(self, waiter: Waiter) -> _Index:
        if waiter.piece is not None:
            return self._pieces
        return self._streams if waiter.stream else self._plain
