"""`insert`: the caller's tensors copied into an item's bytes, its record handed to the core,
once the buffer has room (an event, never a poll). Runs in the caller's task.
"""

from __future__ import annotations

import torch

from kvrt import _metrics
from kvrt._heads import check_heads
from kvrt._item import NewItem, check_item, check_timeout, item_from_packed, masked_tokens
from kvrt._messages import HeadRange
from kvrt._producer._parts import Gate, ItemKeeper, loop_time
from kvrt._producer._serve import ServeLoop
from kvrt._protocol import ProducerCore
from kvrt._tensors import Allocate, pack


class Inserter:
    """`insert`, and buffering an item for the core (also used by publish and streams)."""

    def __init__(
        self, core: ProducerCore, gate: Gate, items: ItemKeeper, serving: ServeLoop, *, heads: HeadRange | None
    ) -> None:
        self._core = core
        self._gate = gate
        self._items = items
        self._serving = serving
        self._heads = heads

    async def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor | None,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor | None = None,
        *,
        timeout: float | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """See `Producer.insert`."""
        self._gate.check_open()
        timer = _metrics.Timer("insert")
        check_item(input_tokens, roi, key, value, hidden)
        check_heads(self._heads, key, value, what="insert")
        check_timeout(timeout, what="insert")
        await self._gate.wait_for_room(timeout)
        self._serving.reclaim()
        item = buffered_item(
            (input_tokens, roi, key, value, hidden),
            self._items.device,
            item_id=self._core.new_item_id(),
            seq=self._core.buffer.next_seq(),
            allocate=self._items.allocate,
        )
        await self.buffer(item)
        timer.done()

    async def buffer(self, item: NewItem) -> None:
        """Hand a built item to the transports and the core (room was waited for already); its
        bytes are kept beside its record."""
        record = self._items.keep(item)
        self._items.prepare(record, item.bytes)
        await self._serving.perform(self._core.insert(record, loop_time()))


def buffered_item(
    tensors: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None],
    device: torch.device, *, item_id: int, seq: int, allocate: Allocate | None = None,
) -> NewItem:  # fmt: skip
    """An item for the buffer: the five tensors (already checked) packed into one new buffer
    on `device` (the one copy insert makes), with its lookup key: read from the caller's
    tokens when they are on the host (from the packed copy on a GPU, the read would wait for
    everything queued on the caller's stream, a whole prefill's work)."""
    input_tokens, roi = tensors[0], tensors[1]
    on_host = input_tokens.device.type == "cpu" and (roi is None or roi.device.type == "cpu")
    masked = masked_tokens(input_tokens, roi).copy() if on_host else None  # the caller may change its tokens
    return item_from_packed(pack(tensors, device, allocate), item_id=item_id, seq=seq, masked=masked)
