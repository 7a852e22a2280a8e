"""The producer's lookup buffer: buffered items, byte accounting, and the prefix index.

Matching follows vLLM's `SimpleBuffer._matches`, with a selection rule of kvrt's own:

* each side's roi mask is applied to its tokens first;
* an item matches a query when one masked sequence is a prefix of the other, and
  `matched` is the shorter length; a match of length 0 is no match;
* among matches the longest wins, then the oldest (smallest insertion sequence);
* a query of None matches every item; the oldest wins, with `matched` its full length.

The index is a radix tree over the masked tokens. A query walks one root-to-leaf path, so
its cost is O(query length) whatever the number of buffered items:

* items that are a prefix of the query end at nodes on the path (the deepest wins);
* items that have the query as a prefix lie in the subtree where the path ends (the
  oldest of that subtree wins; each node keeps a heap of its subtree for that).

Heaps drop removed items lazily and are rebuilt when stale entries outnumber live ones,
so memory stays proportional to the live items. Nothing here awaits or locks: the
producer's event loop is the only caller.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, cast

import numpy as np

from kvrt._messages import TensorMeta

_COMPACT_SLACK = 16
"""A heap is rebuilt once it holds more than twice its live entries plus this many."""


class ItemState(enum.Enum):
    """Where an item is; `kvrt._protocol.lifecycle` holds the one table of how it moves."""

    NEW = "new"
    """Made, not yet known to the producer's core."""
    BUFFERED = "buffered"
    """In the lookup index: any lookup it matches may take it."""
    OUT = "out"
    """In flight to one consumer under a lease, its bytes still counted, until its receipt."""
    SPLIT = "split"
    """Some readers hold a piece of it (a head range), places are free: only pieces are taken."""
    PIECES_OUT = "pieces out"
    """Every reader holds a piece: it waits, held, for their receipts."""
    PIECE = "piece"
    """A piece in flight to its reader (its parent keeps the other heads)."""
    OPEN = "open"
    """An open stream (its prefill still publishing layers) that no consumer reads yet."""
    READ = "read"
    """An open stream its one reader takes layer by layer."""
    DONE = "done"
    """Delivered for good, dropped or aborted: its bytes no longer count."""


@dataclass(eq=False, slots=True, weakref_slot=True)
class BufferedItem:
    """One inserted item as the protocol core knows it: a record without its bytes, owned by
    the buffer while buffered or in flight to a consumer. Its packed buffer (the five tensors,
    laid out as `metas` says, `packed_bytes` in all) is kept apart by the producer's driver
    (`kvrt._item_bytes.ItemBytes`), as long as this record lives.

    Who writes what: the driver makes it (identity, tokens, metas, sizes, segments, a stream's
    record) and writes `checksum` once its bytes are written; `kvrt._protocol.lifecycle.Lifecycle`
    writes the rest (`state`, `holder`, `lease`, `charged`, `inserted_at`, `pieces`, `parent`).
    """

    item_id: int
    seq: int
    """Its age: the buffer's insertion order (a piece has its item's)."""
    masked_tokens: np.ndarray
    metas: tuple[TensorMeta | None, ...]
    """Its five tensors (input_tokens, roi, key, value, hidden) as they lie in its packed buffer."""
    packed_bytes: int
    """The size of its packed buffer."""
    segments: list[tuple[int, int]] = field(default_factory=list)
    """(offset, nbytes) ranges the packed buffer travels in, in order (see `Deliver.segments`);
    empty: one transfer of the whole buffer."""
    stream: StreamRecord | None = None
    """Set while this is an open stream: a prefill still publishing its layers."""
    checksum: int | None = None
    """XXH3-64 of its packed buffer in host memory, computed once its bytes were written
    when its producer checksums (`Producer(checksum=True)`); sent with every delivery of it."""
    inserted_at: float = 0.0
    """Loop time of the insert (for ages in listings and for time-to-live)."""
    state: ItemState = ItemState.NEW
    """Where it is in its lifecycle (`kvrt._protocol.lifecycle.TRANSITIONS` moves it)."""
    holder: bytes = b""
    """The consumer it is in flight to (`Lifecycle` writes it, with `lease` and `charged`)."""
    lease: int = 0
    """The number of its current delivery (see `Deliver.lease`); 0 while never delivered."""
    charged: int = 0
    """The bytes its consumer was charged when it was delivered (see `UNCONFIRMED_SHARE`)."""
    pieces: Pieces | None = None
    """Set while consumers take it in pieces (head ranges, `DropSelect.heads`): it then waits
    in the buffer's piece index, for pieces only, until each reader has one."""
    parent: BufferedItem | None = None
    """Set for a piece: the item it was cut from (its other heads stay there)."""

    @property
    def nbytes(self) -> int:
        """The bytes it holds: its packed buffer, and an open stream's layers so far."""
        return self.packed_bytes + (0 if self.stream is None else self.stream.nbytes)


@dataclass(eq=False, slots=True)
class Pieces:
    """An item that several consumers take a piece of each (decode ranks of another TP size).
    It is delivered for good once `readers` pieces were confirmed; a piece given back (or whose
    consumer left) frees its reader's place again."""

    readers: int
    takers: set[bytes] = field(default_factory=set)
    """The consumers that hold a piece of it, or confirmed one: each takes at most one."""
    confirmed: int = 0
    dropped: bool = False
    """Evicted or expired with pieces still out: those no longer count against it."""


@dataclass(eq=False, slots=True)
class StreamRecord:
    """An open stream as the protocol core knows it: the layers published so far (their metas
    as they travel), how many it will have, and who is reading it. `Lifecycle` writes it; the
    layers' tensors are the driver's (`kvrt._item_bytes.StreamStore`)."""

    layers: int
    metas: list[tuple[TensorMeta, TensorMeta]] = field(default_factory=list)
    """Per layer published so far, its key's and value's metas as they travel."""
    nbytes: int = 0
    """The bytes of the layers published so far."""
    reader: bytes | None = None


@dataclass(frozen=True, slots=True)
class Match:
    item: BufferedItem
    matched: int


class Indexed(Protocol):
    """What a radix index keeps an entry by: its masked tokens and its age (`seq`). Its
    bookkeeping (where the entry stands in the tree) is the index's own (`RadixIndex`)."""

    seq: int
    masked_tokens: np.ndarray


T = TypeVar("T", bound=Indexed)

_HeapEntry = tuple[int, int]
"""(seq, generation): an entry's age, and the number the index gave it when it was added
(alive while the index still holds that number; see `RadixIndex._live`). A stale entry left
behind by lazy removal holds two ints, not the entry (a delivered item's bytes go with it)."""


class _Heap:
    """Oldest-first heap of entries with lazy removal and a live count; `alive` is its index's
    entries by generation."""

    __slots__ = ("alive", "entries", "live")

    def __init__(self, alive: dict[int, Indexed], entries: list[_HeapEntry] | None = None, live: int = 0) -> None:
        self.alive = alive
        self.entries: list[_HeapEntry] = entries if entries is not None else []
        self.live = live

    def push(self, seq: int, generation: int) -> None:
        heapq.heappush(self.entries, (seq, generation))
        self.live += 1

    def discard(self) -> None:
        """One of the entries is no longer alive (it is removed lazily)."""
        self.live -= 1
        if len(self.entries) > 2 * self.live + _COMPACT_SLACK:
            alive = self.alive
            self.entries = [entry for entry in self.entries if entry[1] in alive]
            heapq.heapify(self.entries)

    def oldest(self) -> Indexed | None:
        entries, alive = self.entries, self.alive
        while entries and entries[0][1] not in alive:
            heapq.heappop(entries)
        return alive[entries[0][1]] if entries else None

    def copy(self) -> _Heap:
        return _Heap(self.alive, list(self.entries), self.live)


@dataclass(eq=False, slots=True)
class _Node:
    label: np.ndarray
    parent: _Node | None
    own: _Heap
    subtree: _Heap
    children: dict[int, _Node] = field(default_factory=dict)


def _common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = a[:n] != b[:n]
    first = int(differs.argmax())
    return first if differs[first] else n


def prefix_match_length(item_tokens: np.ndarray, query: np.ndarray | None) -> int:
    """`matched` of one item against one query (both masked): 0 when they do not match."""
    if query is None:
        return len(item_tokens)
    n = min(len(item_tokens), len(query))
    if n == 0 or _common_prefix_length(item_tokens[:n], query[:n]) < n:
        return 0
    return n


class RadixIndex(Generic[T]):
    """Entries by masked tokens in a radix tree (see the module's docstring): a lookup walks
    one root-to-leaf path, whatever the number of entries."""

    def __init__(self) -> None:
        self._live: dict[int, Indexed] = {}
        """The entries held, by the generation each was added under."""
        self._places: dict[T, tuple[int, _Node]] = {}
        """Each entry held: its generation, and the node it ends at."""
        self._generations = itertools.count(1)
        self._root = self._node(np.empty(0, dtype=np.int64), None)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __contains__(self, entry: T) -> bool:
        return entry in self._places

    def add(self, entry: T) -> None:
        self._index(entry)

    def remove(self, entry: T) -> None:
        self._unindex(entry)

    def oldest(self) -> T | None:
        return cast("T | None", self._root.subtree.oldest())

    def entries(self) -> list[T]:
        """Every entry, oldest first (O(n log n))."""
        alive = self._live
        live = [alive[generation] for _, generation in self._root.subtree.entries if generation in alive]
        return sorted(cast(list[T], live), key=lambda entry: entry.seq)

    def best_match(self, query: np.ndarray | None) -> tuple[T, int] | None:
        """The entry a drop-select with this (masked) query takes: the longest match, then the
        oldest; with its matched length."""
        if query is None:
            oldest = self.oldest()
            return None if oldest is None else (oldest, len(oldest.masked_tokens))
        length = len(query)
        if length == 0:
            return None
        node, depth = self._root, 0
        deepest_prefix: tuple[_Node, int] | None = None
        while depth < length:
            child = node.children.get(int(query[depth]))
            if child is None:
                break
            common = _common_prefix_length(child.label, query[depth:])
            if depth + common == length:
                # The query ends on this edge: every entry below has it as a prefix.
                below = cast("T | None", child.subtree.oldest())
                return None if below is None else (below, length)
            if common < len(child.label):
                break
            node, depth = child, depth + common
            if node.own.live:
                deepest_prefix = (node, depth)
        if deepest_prefix is None:
            return None
        prefix_node, matched = deepest_prefix
        own = cast("T | None", prefix_node.own.oldest())
        return None if own is None else (own, matched)

    def oldest_match(self, tokens: np.ndarray) -> tuple[T, int] | None:
        """The oldest entry that `tokens` match (either is a prefix of the other, length > 0),
        with the matched length: who gets a new item, among waiting queries."""
        length = len(tokens)
        if length == 0:
            return None
        best: tuple[Indexed, int] | None = None
        node, depth = self._root, 0
        while depth < length:
            child = node.children.get(int(tokens[depth]))
            if child is None:
                break
            common = _common_prefix_length(child.label, tokens[depth:])
            if depth + common == length:  # entries below have `tokens` as a prefix
                candidate = child.subtree.oldest()
                if candidate is not None and (best is None or candidate.seq < best[0].seq):
                    best = (candidate, length)
                break
            if common < len(child.label):
                break
            node, depth = child, depth + common
            if node.own.live:  # entries that are a prefix of `tokens`
                candidate = node.own.oldest()
                if candidate is not None and (best is None or candidate.seq < best[0].seq):
                    best = (candidate, depth)
        return cast("tuple[T, int] | None", best)

    # -- the radix tree -------------------------------------------------------------------

    def _node(self, label: np.ndarray, parent: _Node | None, subtree: _Heap | None = None) -> _Node:
        live = self._live
        return _Node(label, parent, own=_Heap(live), subtree=_Heap(live) if subtree is None else subtree)

    def _index(self, item: T) -> None:
        assert item not in self._places, "entry is indexed already"
        generation = next(self._generations)
        tokens = item.masked_tokens
        node, depth = self._root, 0
        path = [node]
        while depth < len(tokens):
            first = int(tokens[depth])
            child = node.children.get(first)
            if child is None:
                child = self._node(tokens[depth:], node)
                node.children[first] = child
                node, depth = child, len(tokens)
            else:
                common = _common_prefix_length(child.label, tokens[depth:])
                if common < len(child.label):
                    child = self._split(child, common)
                node, depth = child, depth + common
            path.append(node)
        self._live[generation] = item
        self._places[item] = (generation, node)
        node.own.push(item.seq, generation)
        for ancestor in path:
            ancestor.subtree.push(item.seq, generation)
        self.count += 1

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` tokens; return the new node standing at the cut."""
        parent = child.parent
        assert parent is not None  # the root has no edge and is never split
        middle = self._node(child.label[:at], parent, subtree=child.subtree.copy())
        parent.children[int(middle.label[0])] = middle
        child.label = child.label[at:]
        child.parent = middle
        middle.children[int(child.label[0])] = child
        return middle

    def _unindex(self, item: T) -> None:
        place = self._places.pop(item, None)
        assert place is not None, "entry is not indexed"
        generation, node = place
        del self._live[generation]
        self.count -= 1
        node.own.discard()
        walker: _Node | None = node
        while walker is not None:
            walker.subtree.discard()
            walker = walker.parent
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Drop empty nodes from `node` up, then merge a node left with one child and no entries."""
        while node.parent is not None and node.subtree.live == 0:
            parent = node.parent
            del parent.children[int(node.label[0])]
            node = parent
        if node.parent is not None and node.own.live == 0 and len(node.children) == 1:
            (only_child,) = node.children.values()
            only_child.label = np.concatenate((node.label, only_child.label))
            only_child.parent = node.parent
            node.parent.children[int(only_child.label[0])] = only_child


class LookupBuffer:
    """Buffered items by masked tokens, with the bytes they hold.

    `nbytes` counts items in the index and items handed out but not yet confirmed
    (`hold` / `release` / `forget`), because their memory is still held.
    """

    def __init__(self) -> None:
        self._index: RadixIndex[BufferedItem] = RadixIndex()
        self._split: RadixIndex[BufferedItem] = RadixIndex()
        """Items some consumers took a piece of (`BufferedItem.pieces`), until every reader has
        one: only requests for pieces see them (kept by id in `_by_id` meanwhile, so that an
        operator can list and evict them)."""
        self._seq = itertools.count()
        self._by_id: dict[int, BufferedItem] = {}
        self.nbytes = 0
        self.held = 0

    def __len__(self) -> int:
        return len(self._index) + len(self._split)

    def holds(self, item: BufferedItem) -> bool:
        """Whether `item` is buffered here (whole, or split and taken in pieces)."""
        return item in self._index or item in self._split

    @property
    def buffered(self) -> int:
        return len(self)

    def next_seq(self) -> int:
        return next(self._seq)

    # -- adding and removing ------------------------------------------------------------

    def add(self, item: BufferedItem) -> None:
        """Buffer a new item (its bytes start counting)."""
        self.nbytes += item.nbytes
        self._add(item)

    def restore(self, item: BufferedItem) -> None:
        """Buffer again an item that was held (handed out and given back); it keeps its age."""
        self.held -= 1
        self._add(item)

    def take(self, item: BufferedItem) -> None:
        """Remove a buffered item from the index; its bytes still count until `forget`."""
        self._remove(item)
        self.held += 1

    def grow(self, item: BufferedItem, nbytes: int) -> None:
        """An open stream that this buffer holds (buffered or taken) grew by `nbytes`."""
        self.nbytes += nbytes

    def add_taken(self, item: BufferedItem) -> None:
        """Count an item that goes straight to a consumer, never buffered (a finished stream)."""
        self.nbytes += item.nbytes
        self.held += 1

    def forget(self, item: BufferedItem) -> None:
        """A held item was delivered for good: its bytes stop counting."""
        self.held -= 1
        self.nbytes -= item.nbytes

    def drop(self, item: BufferedItem) -> None:
        """Remove a buffered item for good (evicted or expired)."""
        if item.pieces is not None:
            self._split.remove(item)
            del self._by_id[item.item_id]
        else:
            self._remove(item)
        self.nbytes -= item.nbytes

    # -- items taken in pieces ----------------------------------------------------------

    def split(self, item: BufferedItem) -> None:
        """A buffered item's first piece is taken: from now on only pieces are taken of it."""
        self._index.remove(item)
        self._split.add(item)

    def unsplit(self, item: BufferedItem) -> None:
        """Every piece of a split item came back, none confirmed: it is whole again."""
        self._split.remove(item)
        self._index.add(item)

    def pieces_out(self, item: BufferedItem) -> None:
        """Every reader of a split item holds a piece: it waits, held, for their receipts."""
        self._split.remove(item)
        del self._by_id[item.item_id]  # in flight, as a whole item is: its pieces keep it
        self.held += 1

    def reopen(self, item: BufferedItem) -> None:
        """A piece of an item whose readers all held one came back: its reader may take anew."""
        self.held -= 1
        self._split.add(item)
        self._by_id[item.item_id] = item

    def best_piece(self, query: np.ndarray | None, taker: bytes, readers: int) -> Match | None:
        """The split item a request for a piece takes from first (so one request's pieces
        come from one item), unless `taker` has a piece of it already or its readers are
        another number (another group's item: the request takes a whole one instead)."""
        found = self._split.best_match(query)
        if found is None or (pieces := found[0].pieces) is None or taker in pieces.takers or pieces.readers != readers:
            return None
        return Match(*found)

    def get(self, item_id: int) -> BufferedItem | None:
        """The buffered item with this id (None if taken, dropped, or never inserted)."""
        return self._by_id.get(item_id)

    def items(self) -> list[BufferedItem]:
        """Every buffered item, those taken in pieces too, oldest first (for listing; O(n log n))."""
        return sorted(self._index.entries() + self._split.entries(), key=lambda item: item.seq)

    # -- lookup ---------------------------------------------------------------------------

    def best_match(self, query: np.ndarray | None) -> Match | None:
        """The item a drop-select with this (masked) query takes, without removing it."""
        found = self._index.best_match(query)
        return None if found is None else Match(*found)

    def held_match(self, query: np.ndarray | None) -> Match | None:
        """What a probe reports: the best match among the items held, whole or split (a split
        item still holds the pieces its other readers have not taken; releasing it by its id
        frees them)."""
        found = [match for match in (self._index.best_match(query), self._split.best_match(query)) if match]
        if not found:
            return None
        item, matched = max(found, key=lambda match: (match[1], -match[0].seq))
        return Match(item, matched)

    def _add(self, item: BufferedItem) -> None:
        self._index.add(item)
        self._by_id[item.item_id] = item

    def _remove(self, item: BufferedItem) -> None:
        self._index.remove(item)
        del self._by_id[item.item_id]
