"""An item's lifecycle: the one table of where an item may go (`TRANSITIONS`), and the one
object that moves it (`Lifecycle`).

An item is buffered, in flight to one consumer under a lease, taken in pieces by several, an
open stream, or done (see `ItemState`). `Lifecycle` is the only code that moves an item from
one state to another, and the only code that writes who holds it (`BufferedItem.holder`),
under which lease and for how many bytes (`lease`, `charged`): each of its methods is one
event of the table, checked against it, and keeps the buffers' byte counts and each
consumer's `Holding` with it. Who gets an item, and what is sent, is the callers' (the
deliveries, the pieces, `ProducerCore`); they ask this object to move it.

A whole item:  NEW -insert-> BUFFERED -take-> OUT -confirm-> DONE
                                  ^-- give back --'
A piece is cut from a BUFFERED item (then SPLIT, until every reader holds one: PIECES_OUT,
done once they all confirmed); an open stream is OPEN, READ by one consumer, and FINISHes
into a whole item handed over to its reader (or buffered, with none).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Final

from kvrt._messages import TensorMeta
from kvrt._protocol.commands import ProducerCounters
from kvrt._protocol.lookup_buffer import BufferedItem, ItemState, LookupBuffer, Pieces
from kvrt._protocol.timers import TimerKind, Timers
from kvrt._protocol.waiting import WaitingRequests
from kvrt._sizes import meta_nbytes

UNCONFIRMED_SHARE: Final = 0.5
"""Most of the buffer's limit one consumer may hold delivered and not confirmed: one that
takes items and never confirms them (alive, pinging) cannot fill the buffer and stall every
insert; past it, it is served again once it confirms or releases some."""


class Event(enum.Enum):
    INSERT = "insert"
    """A new item is buffered."""
    OPEN = "open"
    """A prefill opens a stream."""
    TAKE = "take"
    """A lookup takes a buffered item, or an open stream (as its one reader)."""
    HAND_OVER = "hand over"
    """A finished stream's whole item goes straight to the stream's reader."""
    CUT = "cut"
    """A reader takes a piece of the item."""
    ALL_CUT = "all cut"
    """... and now every reader holds one."""
    PIECE_OUT = "piece out"
    """A piece just cut goes to its reader."""
    CONFIRM = "confirm"
    """Its consumer's receipt, inside its lease."""
    GIVE_BACK = "give back"
    """Released, unsendable, or its consumer left (its lease ended)."""
    PIECE_BACK = "piece back"
    """One of its pieces was given back: its reader's place is free again."""
    WHOLE_AGAIN = "whole again"
    """Every piece came back, none confirmed."""
    PIECE_CONFIRMED = "piece confirmed"
    ALL_CONFIRMED = "all confirmed"
    """Every reader confirmed its piece."""
    DROP = "drop"
    """Evicted, past its time to live, or its bytes can never be sent."""
    FINISH = "finish"
    """Its prefill ended the stream (its whole item replaces it)."""
    ABORT = "abort"
    """Its prefill failed."""


S, E = ItemState, Event
TRANSITIONS: Final[dict[tuple[ItemState, Event], ItemState]] = {
    (S.NEW, E.INSERT): S.BUFFERED,
    (S.NEW, E.OPEN): S.OPEN,
    (S.NEW, E.HAND_OVER): S.OUT,
    (S.NEW, E.PIECE_OUT): S.PIECE,
    (S.BUFFERED, E.TAKE): S.OUT,
    (S.BUFFERED, E.CUT): S.SPLIT,
    (S.BUFFERED, E.DROP): S.DONE,
    (S.OUT, E.CONFIRM): S.DONE,
    (S.OUT, E.GIVE_BACK): S.BUFFERED,
    (S.OUT, E.DROP): S.DONE,
    (S.SPLIT, E.CUT): S.SPLIT,
    (S.SPLIT, E.ALL_CUT): S.PIECES_OUT,
    (S.SPLIT, E.PIECE_BACK): S.SPLIT,
    (S.SPLIT, E.WHOLE_AGAIN): S.BUFFERED,
    (S.SPLIT, E.PIECE_CONFIRMED): S.SPLIT,
    (S.SPLIT, E.DROP): S.DONE,
    (S.PIECES_OUT, E.PIECE_BACK): S.SPLIT,
    (S.PIECES_OUT, E.PIECE_CONFIRMED): S.PIECES_OUT,
    (S.PIECES_OUT, E.ALL_CONFIRMED): S.DONE,
    (S.PIECE, E.CONFIRM): S.DONE,
    (S.PIECE, E.GIVE_BACK): S.DONE,
    (S.PIECE, E.DROP): S.DONE,
    (S.OPEN, E.TAKE): S.READ,
    (S.OPEN, E.FINISH): S.DONE,
    (S.OPEN, E.ABORT): S.DONE,
    (S.READ, E.GIVE_BACK): S.OPEN,
    (S.READ, E.FINISH): S.DONE,
    (S.READ, E.ABORT): S.DONE,
    # An item dropped while split: the pieces out stay valid, and come back or are confirmed.
    (S.DONE, E.PIECE_BACK): S.DONE,
    (S.DONE, E.PIECE_CONFIRMED): S.DONE,
}
"""Every move an item can make; any other is a bug in the caller (`AssertionError`)."""
del S, E


def _move(item: BufferedItem, event: Event) -> None:
    after = TRANSITIONS.get((item.state, event))
    if after is None:
        raise AssertionError(f"item {item.item_id} cannot {event.value} while {item.state.value}")
    item.state = after


@dataclass(slots=True)
class Holding:
    """What one consumer holds: the items in flight to it (delivered, not yet confirmed)."""

    peer: bytes
    items: dict[int, BufferedItem] = field(default_factory=dict)
    nbytes: int = 0
    """The bytes it was charged for them (`BufferedItem.charged`)."""


class Lifecycle:
    """The buffered items, the open streams and what each consumer holds; every move of an
    item (see the module's docstring)."""

    def __init__(
        self, counters: ProducerCounters, timers: Timers, waiting: WaitingRequests, *,
        buffer_limit_bytes: int, item_ttl_s: float | None,
    ) -> None:  # fmt: skip
        self.buffer = LookupBuffer()
        self.streams = LookupBuffer()
        """Open streams: prefills still publishing layers, which streaming lookups can take."""
        self.holdings: dict[bytes, Holding] = {}
        self.closed = False
        """Closing: what comes back stays where it is (the buffer closes with the core)."""
        self._counters = counters
        self._timers = timers
        self._waiting = waiting
        self.buffer_limit_bytes = buffer_limit_bytes
        self._item_ttl_s = item_ttl_s
        self._leases = itertools.count(1)

    # -- consumers' holdings ----------------------------------------------------------------

    def hold(self, peer: bytes) -> None:
        """`peer` starts a session: it holds nothing yet."""
        self.holdings[peer] = Holding(peer)

    def leave(self, peer: bytes) -> tuple[BufferedItem, ...]:
        """`peer`'s session ended: what it held, each to `give_back` now."""
        holding = self.holdings.pop(peer, None)
        return () if holding is None else tuple(holding.items.values())

    def held(self, peer: bytes, item_id: int, lease: int = 0) -> BufferedItem | None:
        """The item `item_id` in flight to `peer` (under `lease`, unless 0), else None."""
        holding = self.holdings.get(peer)
        item = None if holding is None else holding.items.get(item_id)
        return None if item is None or (lease and lease != item.lease) else item

    def holds_items(self, peer: bytes) -> bool:
        """Whether anything is in flight to `peer`."""
        holding = self.holdings.get(peer)
        return holding is not None and bool(holding.items)

    def over_share(self, peer: bytes) -> bool:
        holding = self.holdings.get(peer)
        return holding is not None and 0 < self.buffer_limit_bytes * UNCONFIRMED_SHARE < holding.nbytes

    # -- whole items -------------------------------------------------------------------------

    def insert(self, item: BufferedItem, now: float) -> None:
        _move(item, Event.INSERT)
        item.inserted_at = now
        self._counters.inserted_items += 1
        self._counters.inserted_bytes += item.nbytes
        self.buffer.add(item)
        if self._item_ttl_s is not None:
            self._timers.add(now + self._item_ttl_s, TimerKind.ITEM, item)

    def take(self, peer: bytes, item: BufferedItem) -> None:
        """A buffered item, or an open stream (as its reader), goes to `peer`."""
        _move(item, Event.TAKE)
        if item.stream is not None:
            self.streams.take(item)
            item.stream.reader = peer
        else:
            self.buffer.take(item)
        self._hand_out(peer, item)

    def confirm(self, item: BufferedItem) -> None:
        """Its holder confirmed it: delivered for good."""
        self._take_back(item)
        _move(item, Event.CONFIRM)
        self.buffer.forget(item)
        if item.parent is not None:
            self._piece_confirmed(item.parent)
        self._counters.delivered_items += 1
        self._counters.delivered_bytes += item.nbytes

    def give_back(self, item: BufferedItem, now: float, *, counted: bool = True) -> BufferedItem | None:
        """An item in flight comes back (released, unsendable, its holder left); it keeps its
        age. The item that waiting requests may now take (a piece's parent), if any."""
        self._take_back(item)
        _move(item, Event.GIVE_BACK)
        if counted:
            self._counters.returned_items += 1
        if item.parent is not None:
            return self._piece_back(item, now)
        if item.stream is not None:  # its reader left mid-stream: it keeps its layers, waits for another
            item.stream.reader = None
            self.streams.restore(item)
            return item
        self.buffer.restore(item)
        self._live_again(item, now)
        return item

    def drop(self, item: BufferedItem) -> None:
        """A buffered item goes for good (evicted, or its time to live ran out)."""
        _move(item, Event.DROP)
        if item.pieces is not None:  # the pieces out stay valid: they no longer count against it
            item.pieces.dropped = True
        self.buffer.drop(item)

    def expire(self, item: BufferedItem) -> None:
        """Its time to live ran out: dropped if it is still buffered (unclaimed, or some readers'
        pieces never asked for: those out stay valid)."""
        if self.buffer.holds(item):
            self.drop(item)
            self._counters.expired_items += 1

    def discard(self, item: BufferedItem, now: float) -> BufferedItem | None:
        """An item whose bytes can never be sent, buffered or in flight, goes for good; as
        `give_back` for what waiting requests may now take."""
        if self.buffer.holds(item):
            self.drop(item)
            return None
        if item.state not in (ItemState.OUT, ItemState.PIECE) or self.held(item.holder, item.item_id) is not item:
            return None
        self._take_back(item)
        _move(item, Event.DROP)
        if item.parent is not None:
            return self._piece_back(item, now)
        self.buffer.forget(item)
        return None

    # -- pieces ----------------------------------------------------------------------------

    def cut(self, peer: bytes, item: BufferedItem, piece: BufferedItem, readers: int) -> None:
        """`piece`, just cut from `item` for one of its `readers`, goes to `peer`."""
        pieces = item.pieces
        if pieces is None:
            pieces = item.pieces = Pieces(readers)
            self.buffer.split(item)
        _move(item, Event.CUT)
        assert piece.seq == item.seq, "a piece has its item's age"
        piece.parent = item
        piece.inserted_at = item.inserted_at
        pieces.takers.add(peer)
        if len(pieces.takers) == pieces.readers:
            _move(item, Event.ALL_CUT)
            self.buffer.pieces_out(item)
        _move(piece, Event.PIECE_OUT)
        self.buffer.add_taken(piece)
        self._hand_out(peer, piece, also=item.nbytes // pieces.readers)

    def _piece_confirmed(self, item: BufferedItem) -> None:
        """A piece of `item` was received for good: the last one frees the item."""
        pieces = item.pieces
        assert pieces is not None
        pieces.confirmed += 1
        if pieces.confirmed == pieces.readers and not pieces.dropped:
            _move(item, Event.ALL_CONFIRMED)
            self.buffer.forget(item)
        else:
            _move(item, Event.PIECE_CONFIRMED)

    def _piece_back(self, piece: BufferedItem, now: float) -> BufferedItem | None:
        """A piece's bytes go, and its place among the item's readers is free again (an item
        none of whose pieces is out is whole again)."""
        item = piece.parent
        assert item is not None and item.pieces is not None
        pieces = item.pieces
        self.buffer.forget(piece)
        pieces.takers.discard(piece.holder)
        if self.closed:
            return None
        _move(item, Event.PIECE_BACK)
        if pieces.dropped:
            return None
        if not self.buffer.holds(item):
            self.buffer.reopen(item)
        if not pieces.takers:
            _move(item, Event.WHOLE_AGAIN)
            item.pieces = None
            self.buffer.unsplit(item)
        self._live_again(item, now)
        return item

    # -- streams ---------------------------------------------------------------------------

    def open(self, item: BufferedItem, now: float) -> None:
        """A prefill starts publishing `item.stream.layers` layers."""
        _move(item, Event.OPEN)
        item.inserted_at = now
        self.streams.add(item)

    def grew(self, item: BufferedItem, key: TensorMeta, value: TensorMeta) -> tuple[int, bytes | None]:
        """An open stream has one more layer (the driver keeps its tensors beside the record):
        its number, and the stream's reader if any."""
        stream = item.stream
        assert item.state in (ItemState.OPEN, ItemState.READ) and stream is not None
        assert len(stream.metas) < stream.layers
        stream.metas.append((key, value))
        nbytes = meta_nbytes(key) + meta_nbytes(value)
        stream.nbytes += nbytes
        self.streams.grow(item, nbytes)
        return len(stream.metas) - 1, stream.reader

    def finish(self, item: BufferedItem, whole: BufferedItem, now: float) -> bytes | None:
        """An open stream ended; `whole` (same id) is it as one complete item: handed over to
        the stream's reader under the stream's lease (returned), else buffered."""
        stream = item.stream
        assert stream is not None and whole.item_id == item.item_id
        reader = stream.reader
        if reader is None:
            _move(item, Event.FINISH)
            self.streams.drop(item)
            self.insert(whole, now)
            return None
        self._take_back(item)
        _move(item, Event.FINISH)
        self.streams.forget(item)
        _move(whole, Event.HAND_OVER)
        whole.inserted_at = item.inserted_at
        self.buffer.add_taken(whole)
        self._hand_out(reader, whole, lease=item.lease)  # the reader confirms the end under its stream's lease
        return reader

    def abort(self, item: BufferedItem) -> bytes | None:
        """An open stream's prefill failed: the stream goes; its reader, if any."""
        stream = item.stream
        assert stream is not None
        reader = stream.reader
        if reader is None:
            _move(item, Event.ABORT)
            self.streams.drop(item)
            return None
        self._take_back(item)
        _move(item, Event.ABORT)
        self.streams.forget(item)
        return reader

    # -- holder, lease, charge ---------------------------------------------------------------

    def _hand_out(self, peer: bytes, item: BufferedItem, lease: int | None = None, *, also: int = 0) -> None:
        """`item` is in flight to `peer` under a new lease number (or `lease`); a peer that now
        holds more than its share unconfirmed is served no more for now (`UNCONFIRMED_SHARE`).
        `also`: bytes it holds besides (a piece: its share of the item, kept for the other
        readers)."""
        holding = self.holdings[peer]
        item.lease = next(self._leases) if lease is None else lease
        item.holder = peer
        item.charged = item.nbytes + also
        holding.items[item.item_id] = item
        holding.nbytes += item.charged
        if not self._waiting.suspended(peer) and self.over_share(peer):
            self._waiting.suspend(peer)

    def _take_back(self, item: BufferedItem) -> None:
        """`item` leaves its holder's holding (a holder that left has none any more)."""
        holding = self.holdings.get(item.holder)
        if holding is not None and holding.items.get(item.item_id) is item:
            del holding.items[item.item_id]
            holding.nbytes -= item.charged

    def _live_again(self, item: BufferedItem, now: float) -> None:
        if self._item_ttl_s is not None:  # its time to live may have run out while it was away
            self._timers.add(max(now, item.inserted_at + self._item_ttl_s), TimerKind.ITEM, item)
