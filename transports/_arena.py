"""Registered memory: the producer's GPU items live in a few large slabs that each consumer
maps once, so that a delivery over `cuda_ipc` is an offset into a slab already mapped and a
mark, not a new share of a new allocation (opening one costs a new IPC mapping and a mapping
of torch's counter file, ~60 us each on an H200 host, and from 1 MiB up every item is an
allocation of its own in torch's caching allocator, so every item opened anew).

An item's storage is a region of a slab, made a torch storage of its own (through the CUDA
array interface, or numpy's for host memory, whose deleter keeps a Python object of ours alive): when the last tensor
that views the region goes, the region comes back. It is reused only once the GPU work that
wrote it is done (`written`, the event every send of the item waits on), and that is enough
for the consumers' reads too: the producer keeps an item, and so its storage, until the
consumer it was delivered to answers `Received` (after its copies landed), gives it back, or
is forgotten, and it is delivered to one consumer at a time (see `kvrt._protocol`). A consumer
forgotten while it still had copies to queue reads whatever the region holds by then into
buffers it never hands out (its lease ended first, see the lease rule in `docs/reliability.md`).

Slabs are never freed while the arena lives (consumers keep them mapped); once they reach
`limit_bytes` an item that fits in none of them is allocated by torch and shared as before.
The `nixl` transport keeps its memory the same way, on a GPU or the host: the producer's items
and the consumer's receive buffers, each slab registered with the NIXL agent once when made
(`on_slab`), not per transfer.
`Ranges` is the bookkeeping of one slab, without torch, so that it is tested on any host.
"""

from __future__ import annotations

import bisect
import collections
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

REGION_ALIGN_BYTES = 512
"""Every region starts at a multiple of this (torch's own allocations are 512-aligned)."""
SLAB_BYTES = 256 << 20
"""A new slab's size, unless an item needs more (its size, rounded up to 2 MiB)."""
_ROUND_BYTES = 2 << 20


class Ranges:
    """First-fit allocation of byte ranges in `[0, size)`, free ranges kept sorted and merged."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]
        self._ends: list[int] = [size]
        self.used = 0

    def take(self, nbytes: int) -> int | None:
        """The start of a free range of `nbytes` (rounded up to the alignment), or None."""
        nbytes = _aligned(nbytes)
        for index, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= nbytes:
                if end - start == nbytes:
                    del self._starts[index], self._ends[index]
                else:
                    self._starts[index] = start + nbytes
                self.used += nbytes
                return start
        return None

    def give(self, start: int, nbytes: int) -> None:
        """Return a range `take` gave out, merged with free neighbours."""
        nbytes = _aligned(nbytes)
        end = start + nbytes
        index = bisect.bisect_left(self._starts, start)
        if (index < len(self._starts) and self._starts[index] < end) or (index and self._ends[index - 1] > start):
            raise AssertionError(f"range [{start}, {end}) is free already")  # a double free is a bug of ours
        self.used -= nbytes
        merge_left = index > 0 and self._ends[index - 1] == start
        merge_right = index < len(self._starts) and self._starts[index] == end
        if merge_left and merge_right:
            self._ends[index - 1] = self._ends[index]
            del self._starts[index], self._ends[index]
        elif merge_left:
            self._ends[index - 1] = end
        elif merge_right:
            self._starts[index] = start
        else:
            self._starts.insert(index, start)
            self._ends.insert(index, end)

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))


def _aligned(nbytes: int) -> int:
    return max(REGION_ALIGN_BYTES, -(-nbytes // REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES)


@dataclass(eq=False)
class Slab:
    """One registered allocation: its tensor (torch's, shared once per consumer) and its ranges."""

    index: int
    tensor: torch.Tensor
    ranges: Ranges
    share: tuple[Any, ...] | None = None
    """torch's `_share_cuda_` of the slab, made once (by the cuda_ipc sender)."""
    registration: Any = None
    """What the transport that owns the arena registered the slab as (a NIXL registration)."""


@dataclass(eq=False)
class _Region:
    """What the region's storage keeps alive: gives the region back when the storage goes.

    Also the object the CUDA array interface is read from (torch keeps it as the storage's
    owner and drops it in the storage's deleter, on whichever thread frees the storage)."""

    arena: RegisteredArena
    slab: Slab
    start: int
    nbytes: int
    written: torch.cuda.Event | None = None
    __cuda_array_interface__: dict[str, object] = field(default_factory=dict)
    __array_interface__: dict[str, object] = field(default_factory=dict)

    def __del__(self) -> None:
        self.arena._returned.append((self.slab, self.start, self.nbytes, self.written))


class RegisteredArena:
    """The producer's registered GPU memory (see the module's docstring)."""

    def __init__(
        self,
        device: torch.device,
        limit_bytes: int,
        slab_bytes: int = SLAB_BYTES,
        on_slab: Callable[[Slab], None] | None = None,
    ) -> None:
        self.device = device
        self.limit_bytes = limit_bytes
        self.slab_bytes = slab_bytes
        self._on_slab = on_slab
        """Called once per new slab, before any region of it is handed out (NIXL registers it)."""
        self.slabs: list[Slab] = []
        self._by_pointer: weakref.WeakValueDictionary[int, _Region] = weakref.WeakValueDictionary()
        """The regions alive, by address (weakly: each is kept by its storage alone)."""
        self._returned: collections.deque[tuple[Slab, int, int, torch.cuda.Event | None]] = collections.deque()
        """Regions whose storage went (appended from any thread; taken back on the loop's)."""
        self._pending: list[tuple[Slab, int, int, torch.cuda.Event]] = []
        """Regions whose writes may still run on the GPU."""

    @property
    def reserved_bytes(self) -> int:
        """The slabs' bytes: what the arena took of the device."""
        return sum(slab.ranges.size for slab in self.slabs)

    @property
    def used_bytes(self) -> int:
        """Bytes of regions not free for a new item (live, or written to by the GPU still)."""
        return sum(slab.ranges.used for slab in self.slabs)

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """A 1-D uint8 tensor of `nbytes` in a slab (a storage of its own), or None when no slab
        has room and a new one would pass `limit_bytes`."""
        self.collect()
        for slab in self.slabs:
            start = slab.ranges.take(nbytes)
            if start is not None:
                return self._region(slab, start, nbytes)
        size = max(self.slab_bytes, -(-nbytes // _ROUND_BYTES) * _ROUND_BYTES)
        if self.reserved_bytes + size > self.limit_bytes:
            return None
        slab = Slab(len(self.slabs), torch.empty(size, dtype=torch.uint8, device=self.device), Ranges(size))
        if self._on_slab is not None:
            self._on_slab(slab)  # a slab it could not register is not kept
        self.slabs.append(slab)
        start = slab.ranges.take(nbytes)
        assert start is not None  # a new slab holds it
        return self._region(slab, start, nbytes)

    def written(self, storage: torch.Tensor, event: torch.cuda.Event | None) -> None:
        """`storage` (a region's tensor) is written once `event` fires: the region is reused
        only after it did."""
        region = self._by_pointer.get(storage.data_ptr())
        if region is not None:
            region.written = event

    def place(self, tensor: torch.Tensor) -> tuple[Slab, int] | None:
        """The slab and offset in it of a region's tensor (None: not registered memory)."""
        region = self._by_pointer.get(tensor.untyped_storage().data_ptr())
        if region is None:
            return None
        return region.slab, region.start + int(tensor.storage_offset()) * tensor.element_size()

    def _region(self, slab: Slab, start: int, nbytes: int) -> torch.Tensor:
        pointer = slab.tensor.data_ptr() + start
        region = _Region(self, slab, start, nbytes)
        if self.device.type == "cpu":
            # numpy's view keeps the region as its base, and torch keeps the view with the storage.
            region.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3}
            tensor = torch.from_numpy(np.asarray(region))
        else:
            region.__cuda_array_interface__ = {
                "shape": (nbytes,),
                "typestr": "|u1",
                "data": (pointer, False),
                "version": 3,
                "stream": None,  # nothing to wait for: the region is free
            }
            tensor = torch.as_tensor(region, device=self.device)
        assert tensor.data_ptr() == pointer  # zero-copy, or it is not registered memory
        self._by_pointer[pointer] = region  # the storage's owner holds it; the index only looks
        del region
        return tensor

    def collect(self) -> None:
        """Regions whose storage went are free once their writes are done on the GPU (done
        before every allocation)."""
        while self._returned:
            slab, start, nbytes, written = self._returned.popleft()
            if written is None or written.query():
                slab.ranges.give(start, nbytes)
            else:
                self._pending.append((slab, start, nbytes, written))
        if self._pending:
            still = []
            for slab, start, nbytes, event in self._pending:
                if event.query():
                    slab.ranges.give(start, nbytes)
                else:
                    still.append((slab, start, nbytes, event))
            self._pending = still
