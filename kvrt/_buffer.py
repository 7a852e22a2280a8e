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

import asyncio
import concurrent.futures
import enum
import heapq
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar, cast

import numpy as np
import torch

from kvrt._messages import TensorMeta

TensorsSum = concurrent.futures.Future[Callable[[], int]]
"""A GPU checksum of a stream's layer or hidden states, queued: its future gives what reads
the result (waiting for the GPU; see `ProducerState.queue_tensors_checksum`)."""

_COMPACT_SLACK = 16
"""A heap is rebuilt once it holds more than twice its live entries plus this many."""


class GathersFailed(Exception):
    """A published item's gathers could not be queued: its bytes will never exist."""


class ChunkGathers(Protocol):
    """How a published item's gathers are queued, one after the other in send order (a chunk
    of layers, or its keys then its values), each followed by its event (`kvrt._producer._gathers`
    makes it)."""

    def prepare(self) -> concurrent.futures.Future[None] | None:
        """Work the launches out (once). None: the caller's thread queues them, one by one,
        through `queue_through`; else a worker thread queues them all (a launch must compile
        first), and the future is done when it did. Raises `GathersFailed`."""

    def queue_through(self, gather: int | None) -> None:
        """Queue now the gathers up to `gather` (None: all) not queued yet; after
        a worker thread queued them, check that it succeeded. Raises `GathersFailed`."""

    @property
    def failed(self) -> bool:
        """Whether working them out or queuing them failed (the item's bytes never come)."""


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
    """One inserted item, owned by the buffer while buffered or in flight to a consumer.

    Its five tensors are views into `storage`, one packed buffer that `metas` describes
    (see `kvrt._tensors.pack`); `nbytes` is the size of that buffer.
    """

    item_id: int
    seq: int
    masked_tokens: np.ndarray
    storage: torch.Tensor
    metas: tuple[TensorMeta | None, ...]
    input_tokens: torch.Tensor
    roi: torch.Tensor | None
    key: torch.Tensor
    value: torch.Tensor
    hidden: torch.Tensor | None
    inserted_at: float = 0.0
    """Loop time of the insert (for ages in listings and for time-to-live)."""
    ready_event: torch.cuda.Event | None = None
    """Recorded on the inserting caller's stream after packing; GPU sends wait on it."""
    segments: list[tuple[int, int]] = field(default_factory=list)
    """(offset, nbytes) ranges the storage travels in, in order (see `Deliver.segments`);
    empty: one transfer of the whole storage."""
    segment_ready: list[torch.cuda.Event] = field(default_factory=list)
    """One per segment when set: a GPU send of that segment waits on it (its gather's end)."""
    segment_gathers: list[int] = field(default_factory=list)
    """With `segment_ready`: the gather (of `gathers`, in their order) that writes each
    segment's bytes."""
    gathers: ChunkGathers | None = None
    """Set for a published item: queues its gathers, which record `segment_ready`. No send
    may read the storage, or wait on those events, before their gathers are queued."""
    stream: StreamState | None = None
    """Set while this is an open stream: a prefill still publishing its layers."""
    fill: Callable[[BufferedItem], None] | None = None
    """Set for a finished stream that its reader received layer by layer: its storage's layers
    are written (and the transports prepare it) only if it must be sent whole after all, when
    the reader left before confirming it. Call it (once) before anything reads the storage."""
    lease: int = 0
    """The number of its current delivery (see `Deliver.lease`); 0 while never delivered."""
    checksum: int | None = None
    """XXH3-64 of its packed storage in host memory, computed once its bytes were written
    when its producer checksums (`Producer(checksum=True)`); sent with every delivery of it."""
    device_checksum: int | None = None
    """The same for an item in GPU memory (`kvrt.kernels.checksum`), computed on the GPU
    before its first delivery leaves."""
    layer_sums: list[TensorsSum] | None = None
    """A finished GPU stream's, when its producer checksums: each layer's checksum, queued as
    it was published (`StreamState.layer_sums`), for its end to carry."""
    charged: int = 0
    """The bytes its consumer was charged when it was delivered (see `UNCONFIRMED_SHARE`)."""
    pieces: Pieces | None = None
    """Set while consumers take it in pieces (head ranges, `DropSelect.heads`): it then waits
    in the buffer's piece index, for pieces only, until each reader has one."""
    parent: BufferedItem | None = None
    """Set for a piece: the item it was cut from (its other heads stay there)."""
    holder: bytes = b""
    """The consumer it is in flight to (`Lifecycle` writes it, with `lease` and `charged`)."""
    state: ItemState = ItemState.NEW
    """Where it is in its lifecycle (`kvrt._protocol.lifecycle.TRANSITIONS` moves it)."""
    first_head: int = 0
    """A piece's first head, in its item's numbering."""
    generation: int = 0
    buffered: bool = False
    node: _Node | None = None

    @property
    def nbytes(self) -> int:
        return int(self.storage.nbytes) + (0 if self.stream is None else self.stream.nbytes)

    @property
    def written(self) -> torch.cuda.Event | None:
        """GPU: the event after which the whole storage holds its bytes: a published item's
        last gather (the gathers run in order on one stream; wait on it only once they are
        queued), else `ready_event`."""
        return self.segment_ready[-1] if self.segment_ready else self.ready_event

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The five tensors in wire order (input_tokens, roi, key, value, hidden)."""
        return (self.input_tokens, self.roi, self.key, self.value, self.hidden)


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
class StreamState:
    """The layers an open stream has published so far ([tokens, heads, head_dim] each), how many
    it will have, and who is reading it. The layers' tensors (`keys`, `values`, `ready`: the
    store) are the producer's driver's to write; the core records their metas."""

    layers: int
    metas: list[tuple[TensorMeta, TensorMeta]] = field(default_factory=list)
    """Per layer published so far, its key's and value's metas as they travel (the record:
    the protocol core writes it)."""
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    ready: list[torch.cuda.Event | None] = field(default_factory=list)
    """GPU: per layer, the event after which its key and value hold their bytes (recorded on
    the prefill's stream); a GPU send of the layer waits on it, the prefill never waits."""
    checksums: list[int] = field(default_factory=list)
    """Per layer, its checksum as `put_layer` wrote it (a producer that checksums)."""
    layer_sums: list[TensorsSum] = field(default_factory=list)
    """The same on a GPU, queued there after the layer's writes: its end carries them
    (`StreamEnd.layer_checksums`), as its layers leave before they are written."""
    reader: bytes | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(tensor.nbytes) for tensor in (*self.keys, *self.values))


@dataclass(frozen=True, slots=True)
class Match:
    item: BufferedItem
    matched: int


class Indexed(Protocol):
    """What a radix index keeps of an entry: its masked tokens, its age (`seq`), and the
    bookkeeping the index writes (`generation`, `buffered`, `node`)."""

    seq: int
    masked_tokens: np.ndarray
    generation: int
    buffered: bool
    node: _Node | None


T = TypeVar("T", bound=Indexed)

_HeapEntry = tuple[int, int, weakref.ref[Indexed]]
"""(seq, generation, entry). Weak: an entry left behind by lazy removal must not keep a
delivered item's tensors alive (GPU items hold gigabytes) until the next compaction."""


def _alive(entry: _HeapEntry) -> bool:
    _, generation, ref = entry
    item = ref()
    return item is not None and item.buffered and item.generation == generation


class _Heap:
    """Oldest-first heap of entries with lazy removal and a live count."""

    __slots__ = ("entries", "live")

    def __init__(self, entries: list[_HeapEntry] | None = None, live: int = 0) -> None:
        self.entries: list[_HeapEntry] = entries if entries is not None else []
        self.live = live

    def push(self, item: Indexed) -> None:
        heapq.heappush(self.entries, (item.seq, item.generation, weakref.ref(item)))
        self.live += 1

    def discard(self) -> None:
        """One of the entries is no longer alive (it is removed lazily)."""
        self.live -= 1
        if len(self.entries) > 2 * self.live + _COMPACT_SLACK:
            self.entries = [entry for entry in self.entries if _alive(entry)]
            heapq.heapify(self.entries)

    def oldest(self) -> Indexed | None:
        entries = self.entries
        while entries and not _alive(entries[0]):
            heapq.heappop(entries)
        return entries[0][2]() if entries else None

    def copy(self) -> _Heap:
        return _Heap(list(self.entries), self.live)


@dataclass(eq=False, slots=True)
class _Node:
    label: np.ndarray
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    own: _Heap = field(default_factory=_Heap)
    subtree: _Heap = field(default_factory=_Heap)


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
        self._root = _Node(label=np.empty(0, dtype=np.int64), parent=None)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, entry: T) -> None:
        self._index(entry)

    def remove(self, entry: T) -> None:
        self._unindex(entry)

    def oldest(self) -> T | None:
        return cast("T | None", self._root.subtree.oldest())

    def entries(self) -> list[T]:
        """Every entry, oldest first (O(n log n))."""
        live = [entry for heap_entry in self._root.subtree.entries if _alive(heap_entry) and (entry := heap_entry[2]())]
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

    def _index(self, item: T) -> None:
        item.generation += 1
        item.buffered = True
        tokens = item.masked_tokens
        node, depth = self._root, 0
        path = [node]
        while depth < len(tokens):
            first = int(tokens[depth])
            child = node.children.get(first)
            if child is None:
                child = _Node(label=tokens[depth:], parent=node)
                node.children[first] = child
                node, depth = child, len(tokens)
            else:
                common = _common_prefix_length(child.label, tokens[depth:])
                if common < len(child.label):
                    child = self._split(child, common)
                node, depth = child, depth + common
            path.append(node)
        item.node = node
        node.own.push(item)
        for ancestor in path:
            ancestor.subtree.push(item)
        self.count += 1

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` tokens; return the new node standing at the cut."""
        parent = child.parent
        assert parent is not None  # the root has no edge and is never split
        middle = _Node(label=child.label[:at], parent=parent, subtree=child.subtree.copy())
        parent.children[int(middle.label[0])] = middle
        child.label = child.label[at:]
        child.parent = middle
        middle.children[int(child.label[0])] = child
        return middle

    def _unindex(self, item: T) -> None:
        node = item.node
        assert node is not None and item.buffered, "entry is not indexed"
        item.buffered = False
        item.node = None
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
            item.pieces.dropped = True
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


async def gathers_prepared(item: BufferedItem) -> None:
    """A published item's gathers queued already if a worker thread queues them (at once for
    other items). Raises `GathersFailed`."""
    if item.gathers is None:
        return
    in_thread = item.gathers.prepare()
    if in_thread is not None:
        try:
            await asyncio.wrap_future(in_thread)
        except Exception as exc:
            raise GathersFailed(str(exc)) from exc


async def all_gathers_queued(item: BufferedItem) -> None:
    """Every gather of a published item queued (at once for other items): before anything
    reads the whole storage, or waits on `BufferedItem.written`. Raises `GathersFailed`."""
    await gathers_prepared(item)
    if item.gathers is not None:
        item.gathers.queue_through(None)
