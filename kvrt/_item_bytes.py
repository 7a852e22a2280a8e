"""An item's bytes, as the producer's driver keeps them beside the protocol core's record of
it (`kvrt._protocol.lookup_buffer.BufferedItem`): its packed buffer and the five tensors viewed in it,
the events after which a GPU wrote them, a published item's gathers, an open stream's layers,
the fill of an item written only when it is sent, and GPU checksums.

The driver (`kvrt._producer`) makes them with the record and keeps them as long as the record
lives; transports are handed these, never the record (`kvrt.transports.Transfer`). Nothing here
awaits but the gathers' queuing, which the send path asks for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvrt._protocol.lookup_buffer import BufferedItem

TensorsSum = concurrent.futures.Future[Callable[[], int]]
"""A GPU checksum of a stream's layer or hidden states, queued: its future gives what reads
the result (waiting for the GPU; see `ItemKeeper.queue_tensors_checksum` in `kvrt._producer._parts`)."""


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


Fill = Callable[["BufferedItem", "ItemBytes"], None]
"""Writes an item's bytes when it is first sent (a piece, a finished stream read layer by
layer): given its record and its bytes, never holding either."""


@dataclass(eq=False, slots=True)
class StreamStore:
    """The layers an open stream has published so far ([tokens, heads, head_dim] each), as the
    driver keeps them for the send path (the core records their metas: `StreamRecord`)."""

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

    def release(self) -> None:
        """Free an ended stream's own copies of its layers, though the caller may keep its
        handle (a transfer still reading one holds it until it ran)."""
        self.keys.clear()
        self.values.clear()
        self.ready.clear()


@dataclass(eq=False, slots=True, weakref_slot=True)
class ItemBytes:
    """One item's bytes: its five tensors are views into `storage`, one packed buffer that its
    record's metas describe (see `kvrt._tensors.pack`). The driver writes every field; a
    transport reads them (and keeps what it built for an item, weakly keyed on this)."""

    item_id: int
    storage: torch.Tensor
    input_tokens: torch.Tensor
    roi: torch.Tensor | None
    key: torch.Tensor
    value: torch.Tensor
    hidden: torch.Tensor | None
    ready_event: torch.cuda.Event | None = None
    """Recorded on the inserting caller's stream after packing; GPU sends wait on it."""
    segment_ready: list[torch.cuda.Event] = field(default_factory=list)
    """One per segment (`BufferedItem.segments`) when set: a GPU send of that segment waits on
    it (its gather's end)."""
    segment_gathers: list[int] = field(default_factory=list)
    """With `segment_ready`: the gather (of `gathers`, in their order) that writes each
    segment's bytes."""
    gathers: ChunkGathers | None = None
    """Set for a published item: queues its gathers, which record `segment_ready`. No send
    may read the storage, or wait on those events, before their gathers are queued."""
    store: StreamStore | None = None
    """Set while this is an open stream: the layers its prefill published so far."""
    fill: Fill | None = None
    """Set for an item whose bytes are written only when it is sent: a piece (cut from its
    item's bytes), or a finished stream that its reader received layer by layer (written, and
    the transports prepare it, only if it must be sent whole after all, when the reader left
    before confirming it). Call it (once) before anything reads the storage."""
    device_checksum: int | None = None
    """The checksum of an item in GPU memory (`kvrt.kernels.checksum`), computed on the GPU
    before its first delivery leaves."""
    layer_sums: list[TensorsSum] | None = None
    """A finished GPU stream's, when its producer checksums: each layer's checksum, queued as
    it was published (`StreamStore.layer_sums`), for its end to carry."""

    @property
    def nbytes(self) -> int:
        """The bytes of its packed buffer."""
        return int(self.storage.nbytes)

    @property
    def written(self) -> torch.cuda.Event | None:
        """GPU: the event after which the whole storage holds its bytes: a published item's
        last gather (the gathers run in order on one stream; wait on it only once they are
        queued), else `ready_event`."""
        return self.segment_ready[-1] if self.segment_ready else self.ready_event

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The five tensors in wire order (input_tokens, roi, key, value, hidden)."""
        return (self.input_tokens, self.roi, self.key, self.value, self.hidden)


async def gathers_prepared(item: ItemBytes) -> None:
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


async def all_gathers_queued(item: ItemBytes) -> None:
    """Every gather of a published item queued (at once for other items): before anything
    reads the whole storage, or waits on `ItemBytes.written`. Raises `GathersFailed`."""
    await gathers_prepared(item)
    if item.gathers is not None:
        item.gathers.queue_through(None)
