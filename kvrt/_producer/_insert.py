"""`insert`: the caller's tensors copied into a `BufferedItem` and handed to the core, once
the buffer has room (an event, never a poll). Runs in the caller's task.
"""

from __future__ import annotations

import torch

from kvrt import _metrics
from kvrt._buffer import BufferedItem
from kvrt._caller_stream import on_caller_stream
from kvrt._heads import check_heads
from kvrt._item import (
    buffered_item,
    check_item,
    check_timeout,
)
from kvrt._producer._serve import _Serving


class _Inserting(_Serving):
    """`insert`, and buffering an item for the core (also used by publish and streams)."""

    @on_caller_stream
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
        """Buffer one request's KV. Returns once it is buffered; nothing the caller holds is kept.

        Waits while the buffer is over `buffer_bytes`; `timeout` bounds that wait (None: until
        room appears or the producer closes). On a GPU the copy is queued on `stream` (None: the
        caller's current stream, see `kvrt._caller_stream`), after the work that wrote the
        tensors there; sends wait for it on the GPU. Raises `InvalidInputError` for tensors that
        disagree, `KVRTTimeoutError` (phase "insert") and `ClosedError`.
        """
        self._check_open()
        timer = _metrics.Timer("insert")
        check_item(input_tokens, roi, key, value, hidden)
        check_heads(self.heads, key, value, what="insert")
        check_timeout(timeout, what="insert")
        await self._wait_for_room(timeout)
        self._reclaim()
        item = buffered_item(
            (input_tokens, roi, key, value, hidden),
            self.device,
            item_id=self._core.new_item_id(),
            seq=self._core.buffer.next_seq(),
            allocate=self._allocate,
        )
        await self._buffer(item)
        timer.done()

    async def _buffer(self, item: BufferedItem) -> None:
        """Hand a built item to the transports and the core (room was waited for already)."""
        self._prepare(item)
        await self._perform(self._core.insert(item, self._now()))
