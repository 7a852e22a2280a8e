"""Deliveries: which lookup gets which item, and when.

A drop-select takes the best match now, or waits (`WaitingRequests`) until an inserted or
returned item matches it (`offer`); a batch (`DropSelectMany`) takes what is there, one hit or
miss per query. Streaming lookups take open streams, or finished items layer by layer; requests
for pieces go to `PieceDeliveries`. A consumer that holds more than its share unconfirmed is
served no more until it confirms or releases enough (`resume_if_under`). Every item moved here
is moved by the `Lifecycle`.
"""

from __future__ import annotations

import numpy as np

from kvrt import _messages as m
from kvrt._errors import ErrorCode, ProtocolError
from kvrt._protocol.commands import ProducerCounters
from kvrt._protocol.lifecycle import UNCONFIRMED_SHARE, Lifecycle
from kvrt._protocol.lookup_buffer import BufferedItem, Match
from kvrt._protocol.outgoing import (
    Outgoing,
    Refusals,
    batch_segments,
    deliver,
    hit,
    layer_outgoing,
    start_message,
    whole_as_stream,
)
from kvrt._protocol.pieces import PieceDeliveries
from kvrt._protocol.timers import TimerKind, Timers
from kvrt._protocol.waiting import PieceAsked, WaitingRequests


class Deliveries:
    """Lookups answered, parked and served (see the module's docstring)."""

    def __init__(
        self, lifecycle: Lifecycle, waiting: WaitingRequests, pieces: PieceDeliveries, timers: Timers,
        refuse: Refusals, counters: ProducerCounters,
    ) -> None:  # fmt: skip
        self._lifecycle = lifecycle
        self._waiting = waiting
        self._pieces = pieces
        self._timers = timers
        self._refuse = refuse
        self._counters = counters

    def drop_select(self, peer: bytes, request: m.DropSelect, now: float) -> list[Outgoing]:
        try:
            query = None if request.tokens is None else m.tokens_from_bytes(request.tokens)
        except ProtocolError as exc:
            return [self._refuse(peer, request.request_id, exc.code, str(exc))]
        if self._waiting.suspended(peer):
            if request.timeout_s == 0.0:
                return [self._refuse(peer, request.request_id, ErrorCode.CAPACITY, self._over_share(peer))]
            return self._park(peer, request, query, now)
        asked = PieceAsked.of(request)
        buffer = self._lifecycle.buffer
        if asked is not None:
            found = self._pieces.match(peer, query, asked)
            if found is not None:
                stream, whole = request.stream, request.whole
                return self._pieces.out(peer, request.request_id, found, asked, stream=stream, whole=whole)[0]
        else:
            found = buffer.best_match(query)
            if request.stream:
                opened = self._lifecycle.streams.best_match(query)
                if opened is not None and (found is None or _better(opened, found)):
                    return self._attach(peer, request.request_id, opened.item, opened.matched)
                if found is not None:
                    return self._finished_out(peer, request.request_id, found, whole=request.whole)
            elif found is not None:
                return [self._deliver(peer, request.request_id, found)]
        if request.timeout_s == 0.0:
            self._counters.misses += 1
            return [Outgoing(peer, m.Miss(request_id=request.request_id))]
        return self._park(peer, request, query, now)

    def drop_select_many(self, peer: bytes, request: m.DropSelectMany, now: float) -> list[Outgoing]:
        if self._waiting.suspended(peer):
            return [self._refuse(peer, request.request_id, ErrorCode.CAPACITY, self._over_share(peer))]
        try:
            queries = [None if tokens is None else m.tokens_from_bytes(tokens) for tokens in request.queries]
        except ProtocolError as exc:
            return [self._refuse(peer, request.request_id, exc.code, str(exc))]
        hits: list[m.Hit | None] = []
        items: list[BufferedItem] = []
        offset = 0
        asked = PieceAsked.of(request)
        for query in queries:
            if asked is None:
                found = self._lifecycle.buffer.best_match(query)
            else:
                found = self._pieces.match(peer, query, asked)
            if found is None:
                self._counters.misses += 1
                hits.append(None)
                continue
            if asked is None:
                item = found.item
                self._lifecycle.take(peer, item)
            else:
                piece = self._pieces.cut(peer, found.item, asked)
                if isinstance(piece, str):
                    out: list[Outgoing] = []
                    for taken in items:  # the batch fails whole: its pieces go back
                        out += self.offer(self._lifecycle.give_back(taken, now, counted=False))
                    return [self._refuse(peer, request.request_id, ErrorCode.INVALID, piece), *out]
                item = piece
            offset = -(-offset // m.BATCH_ALIGNMENT) * m.BATCH_ALIGNMENT
            hits.append(hit(item, found.matched, offset))
            items.append(item)
            offset += item.nbytes
        segments = batch_segments([(hit.offset, hit.payload_bytes) for hit in hits if hit is not None])
        reply = m.DeliverMany(request_id=request.request_id, hits=hits, payload_bytes=offset, segments=segments)
        return [Outgoing(peer, reply, items=tuple(items))]

    def offer(self, item: BufferedItem | None) -> list[Outgoing]:
        """Give `item` (buffered, or an open stream, again or for the first time) to the oldest
        waiting request it matches, if any (an open stream only to a streaming request). A
        request for a piece the item cannot give (heads it lacks) is refused, and the next one
        is served: a bad waiter holds nobody's item."""
        out: list[Outgoing] = []
        while item is not None and not self._lifecycle.closed:
            served, done = self._offer_once(item)
            out += served
            if done:
                break
        return out

    def resume_if_under(self, peer: bytes) -> list[Outgoing]:
        """A suspended peer back under its share: its waiting requests are served again (those
        a buffered item matches at once, the others indexed for the next insert)."""
        if not self._waiting.suspended(peer) or self._lifecycle.over_share(peer):
            return []
        out: list[Outgoing] = []
        for waiter in self._waiting.resume(peer):
            if self._waiting.suspended(peer):  # over its share again: the rest were taken out anew
                break
            if waiter.piece is not None:
                found = self._pieces.match(peer, waiter.query, waiter.piece)
            else:
                found = self._lifecycle.buffer.best_match(waiter.query)
            if found is None:
                self._waiting.index(waiter)
                continue
            self._waiting.drop(peer, waiter.request_id)
            if waiter.piece is not None:
                asked, stream, whole = waiter.piece, waiter.stream, waiter.whole
                out += self._pieces.out(peer, waiter.request_id, found, asked, stream=stream, whole=whole)[0]
            elif waiter.stream:
                out += self._finished_out(peer, waiter.request_id, found, whole=waiter.whole)
            else:
                out.append(self._deliver(peer, waiter.request_id, found))
        return out

    # -- helpers ----------------------------------------------------------------------------

    def _park(self, peer: bytes, request: m.DropSelect, query: np.ndarray | None, now: float) -> list[Outgoing]:
        """Keep a drop-select waiting for an insert (within the per-peer and global bounds); out
        of the indexes while its peer is suspended."""
        if (peer, request.request_id) in self._waiting:
            text = f"request id {request.request_id} is already waiting"
            return [self._refuse(peer, request.request_id, ErrorCode.PROTOCOL, text)]
        full = self._waiting.refusal(peer, 0 if query is None else int(query.nbytes))
        if full is not None:
            return [self._refuse(peer, request.request_id, ErrorCode.CAPACITY, f"{full}; retry with timeout=0")]
        deadline = None if request.timeout_s is None else now + request.timeout_s
        self._waiting.park(peer, request, query, deadline)
        if deadline is not None:
            self._timers.add(deadline, TimerKind.WAITER, (peer, request.request_id))
        return []

    def _over_share(self, peer: bytes) -> str:
        holding = self._lifecycle.holdings[peer]
        return (
            f"you hold {holding.nbytes} bytes delivered and not confirmed, more than "
            f"{UNCONFIRMED_SHARE:.0%} of this producer's buffer: confirm (or release) items first"
        )

    def _offer_once(self, item: BufferedItem) -> tuple[list[Outgoing], bool]:
        """`offer` once: what to send, and False when a waiter was refused and the item is
        still there for the next."""
        if item.pieces is not None:
            return self._pieces.serve_waiters(item), True
        found = self._waiting.oldest_for(item.masked_tokens, open_stream=item.stream is not None)
        if found is None:
            return [], True
        waiter, matched = found
        self._waiting.drop(waiter.peer, waiter.request_id)
        if waiter.piece is not None:
            asked, stream, whole = waiter.piece, waiter.stream, waiter.whole
            out, delivered = self._pieces.out(
                waiter.peer, waiter.request_id, Match(item, matched), asked, stream=stream, whole=whole
            )
            if not delivered:
                return out, False
            return out + (self._pieces.serve_waiters(item) if item.pieces is not None else []), True
        if item.stream is not None:
            return self._attach(waiter.peer, waiter.request_id, item, matched), True
        if waiter.stream:
            return self._finished_out(waiter.peer, waiter.request_id, Match(item, matched), whole=waiter.whole), True
        return [self._deliver(waiter.peer, waiter.request_id, Match(item, matched))], True

    def _deliver(self, peer: bytes, request_id: int, found: Match) -> Outgoing:
        self._lifecycle.take(peer, found.item)
        return deliver(peer, request_id, found.item, found.matched)

    def _finished_out(self, peer: bytes, request_id: int, found: Match, *, whole: bool) -> list[Outgoing]:
        """A streaming request takes a finished item: in one `deliver` if it takes it `whole`,
        else layer by layer (start, every layer, end, at once)."""
        if whole:
            return [self._deliver(peer, request_id, found)]
        self._lifecycle.take(peer, found.item)
        return whole_as_stream(peer, request_id, found.item, found.matched)

    def _attach(self, peer: bytes, request_id: int, item: BufferedItem, matched: int) -> list[Outgoing]:
        """A streaming request takes an open stream: its start, then every layer so far."""
        stream = item.stream
        assert stream is not None
        self._lifecycle.take(peer, item)
        out = [Outgoing(peer, start_message(request_id, item, matched, stream.layers), item)]
        for layer, (key, value) in enumerate(stream.metas):
            out.append(layer_outgoing(peer, item, layer, key, value))
        return out


def _better(first: Match, second: Match) -> bool:
    """Longest match first, then oldest."""
    return (first.matched, -first.item.seq) > (second.matched, -second.item.seq)
