"""Pieces: consumers that each take some of an item's KV heads (`DropSelect.heads`), as the
ranks of a decode group of another tensor-parallel size do.

An item's readers (`PieceAsked.readers`) each take one piece of it, cut by the driver (`Cut`);
the pieces of one request come from one item, which waits, split, for the readers that have
not taken theirs yet (the lifecycle's SPLIT and PIECES_OUT states).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvrt._errors import ErrorCode, InvalidInputError
from kvrt._protocol.lifecycle import Lifecycle
from kvrt._protocol.lookup_buffer import BufferedItem, Match
from kvrt._protocol.outgoing import Outgoing, Refusals, deliver, whole_as_stream
from kvrt._protocol.waiting import PieceAsked, Waiter, WaitingRequests

Cut = Callable[[BufferedItem, PieceAsked, int], BufferedItem]
"""The driver's: a piece of an item (its heads `heads`, with or without its hidden states) as
the record of a new item with this id and the item's age (`seq`), its bytes allocated beside
it and written before it is sent. Raises `InvalidInputError` for heads the item does not have."""


def no_cut(item: BufferedItem, asked: PieceAsked, item_id: int) -> BufferedItem:
    raise InvalidInputError("this producer does not cut items into pieces")


class PieceDeliveries:
    """Which item a request for a piece takes from, the piece cut and sent, and the waiting
    requests for pieces that an item serves."""

    def __init__(
        self, lifecycle: Lifecycle, waiting: WaitingRequests, refuse: Refusals, *, cut: Cut,
        new_item_id: Callable[[], int], peers: Callable[[], int], waits_for_readers: bool,
    ) -> None:  # fmt: skip
        self._lifecycle = lifecycle
        self._waiting = waiting
        self._refuse = refuse
        self._cut = cut
        self._new_item_id = new_item_id
        self._peers = peers
        self._waits_for_readers = waits_for_readers
        """The producer has an item time to live: an item waits that long at most for readers
        still connecting."""

    def match(self, peer: bytes, query: np.ndarray | None, asked: PieceAsked) -> Match | None:
        """The item a request for a piece takes from: one that other consumers of its number
        took pieces of already, so that the pieces of one request come from one item; else a
        whole one."""
        buffer = self._lifecycle.buffer
        return buffer.best_piece(query, peer, asked.readers) or buffer.best_match(query)

    def cut(self, peer: bytes, item: BufferedItem, asked: PieceAsked) -> BufferedItem | str:
        """A piece of `item` in flight to `peer`, or why it cannot be cut."""
        pieces = item.pieces
        if pieces is not None and pieces.readers != asked.readers:
            return f"item {item.item_id} is taken by {pieces.readers} readers, this request says {asked.readers}"
        connected = self._peers()
        if asked.readers > connected and not self._waits_for_readers:
            # They could never all take theirs: the item would wait for ever for the missing ones.
            # With an item TTL it waits that long at most: readers still connecting (the ranks
            # of a decode group whose first request reaches this producer) take theirs meanwhile.
            return (
                f"{asked.readers} readers asked for, {connected} consumers are connected (a producer with "
                "item_ttl_s waits for the others that long)"
            )
        try:
            piece = self._cut(item, asked, self._new_item_id())
        except InvalidInputError as exc:
            return str(exc)
        self._lifecycle.cut(peer, item, piece, asked.readers)
        return piece

    def out(
        self, peer: bytes, request_id: int, found: Match, asked: PieceAsked, *, stream: bool, whole: bool = False
    ) -> tuple[list[Outgoing], bool]:
        """Deliver a piece of `found.item` to `peer` (layer by layer for a stream, unless it
        takes it `whole`); or refuse the request (heads the item lacks: the item stays as it
        was). Whether it was delivered."""
        piece = self.cut(peer, found.item, asked)
        if isinstance(piece, str):
            return [self._refuse(peer, request_id, ErrorCode.INVALID, piece)], False
        if stream and not whole:
            return whole_as_stream(peer, request_id, piece, found.matched), True
        return [deliver(peer, request_id, piece, found.matched)], True

    def serve_waiters(self, item: BufferedItem) -> list[Outgoing]:
        """Give pieces of a split item to the oldest waiting requests for pieces that it
        matches, while it has readers' places free."""
        out: list[Outgoing] = []
        passed: list[Waiter] = []  # waiters this item is not for: out of the index meanwhile
        while item.pieces is not None and self._lifecycle.buffer.holds(item):
            found = self._waiting.oldest_piece_waiter(item.masked_tokens)
            if found is None:
                break
            waiter, matched = found
            assert waiter.piece is not None
            if waiter.peer in item.pieces.takers or waiter.piece.readers != item.pieces.readers:
                self._waiting.unindex(waiter)
                passed.append(waiter)
                continue
            self._waiting.drop(waiter.peer, waiter.request_id)
            asked, stream = waiter.piece, waiter.stream
            out += self.out(waiter.peer, waiter.request_id, Match(item, matched), asked, stream=stream)[0]
        self._waiting.index(*passed)
        return out
