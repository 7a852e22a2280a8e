"""`register_pools` and `publish`: a request's KV taken from paged pools by slot, looked up by
its tokens, gathered off the loop in chunks as consumers pull it. Runs in the caller's task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvrt._errors import (
    InvalidInputError,
    KVRTError,
)
from kvrt._item import (
    check_timeout,
    check_tokens,
    item_from_packed,
    masked_tokens,
)
from kvrt._item_bytes import GathersFailed, all_gathers_queued
from kvrt._pools import Part, PoolTable, check_indices, checked_indexes, index_ranges, per_token, ranges_fit
from kvrt._producer._gathers import _Gathers
from kvrt._producer._parts import DEFAULT_CHUNK_BYTES, Gate, ItemKeeper, RegisteredPools, Workers
from kvrt._producer._serve import Inserter, ServeLoop
from kvrt._protocol import ProducerCore
from kvrt._tensors import chunk_plan, copy_into, layer_segments, pack_empty

if TYPE_CHECKING:  # the kernels import Triton: only when pools are used
    from kvrt.kernels.paged_kv import PreparedGather


def _lookup_key_and(
    input_tokens: torch.Tensor, roi: torch.Tensor | None, values: torch.Tensor | None
) -> Callable[[], tuple[np.ndarray, list[int]]]:
    """The lookup key (the tokens the roi selects, on the host) and a few int64 device values
    (or none), read back together (one wait for the device, not two): queued now, the call
    that returns waits for them, so that the host can work out other things while they
    travel. Tokens on the host cost no read back."""
    tokens = input_tokens.detach()
    if values is None and tokens.device.type == "cpu":
        key = masked_tokens(input_tokens, roi)
        return lambda: (key, [])
    if values is not None and tokens.device != values.device:
        key, read_values = masked_tokens(input_tokens, roi), _to_host(values)
        return lambda: (key, read_values().tolist())
    parts = [tokens.to(torch.int64)]
    if roi is not None:  # applied on the host: a boolean mask on the device would wait too
        parts.append(roi.to(device=tokens.device, dtype=torch.int64))
    if values is not None:
        parts.append(values)
    read = _to_host(torch.cat(parts))
    count = tokens.numel()
    values_at = count if roi is None else 2 * count

    def result() -> tuple[np.ndarray, list[int]]:
        host = read()
        key = host[:count] if roi is None else host[:count][host[count:values_at].astype(bool)]
        return key, host[values_at:].tolist()

    return result


def _to_host(values: torch.Tensor) -> Callable[[], np.ndarray]:
    """`values` on the host, the copy queued now: the call that returns waits for the device's
    stream once. A GPU copy lands in pinned memory (a pageable copy of a long prompt's tokens
    costs the loop a synchronous staging copy)."""
    if values.device.type != "cuda":
        return values.numpy
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)  # cached by torch once freed
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(values.device))

    def result() -> np.ndarray:
        copied.synchronize()
        return host.numpy().copy()  # the pinned block goes back to torch's cache; the key may live long

    return result


class Publisher:
    """Publishing from paged pools."""

    def __init__(
        self, core: ProducerCore, gate: Gate, items: ItemKeeper, workers: Workers, registered: RegisteredPools,
        inserter: Inserter, serving: ServeLoop,
    ) -> None:  # fmt: skip
        self._core = core
        self._gate = gate
        self._items = items
        self._workers = workers
        self._registered = registered
        self._inserter = inserter
        self._serving = serving

    def register_pools(self, pools: PoolTable, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, taper: bool = False) -> None:
        """See `Producer.register_pools`."""
        if pools.device != self._items.device:
            raise InvalidInputError(f"the pools are on {pools.device}, this producer is on {self._items.device}")
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise InvalidInputError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self._registered.pools = pools
        self._registered.chunk_bytes = chunk_bytes
        self._registered.taper = bool(taper)

    async def publish(
        self,
        input_tokens: torch.Tensor,
        slots: torch.Tensor,
        replica: torch.Tensor | int = 0,
        roi: torch.Tensor | None = None,
        *,
        timeout: float | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """See `Producer.publish`."""
        pools = self._registered.pools
        if pools is None:
            raise InvalidInputError("publish needs pools: call register_pools first")
        check_tokens(input_tokens, roi, what="publish")
        from kvrt.kernels.paged_kv import gather_into_any, prepare_gather_into

        replicas = per_token(replica, slots)
        if slots.numel() != input_tokens.numel():
            raise InvalidInputError(f"publish: {slots.numel()} slots for {input_tokens.numel()} tokens")
        self._gate.check_open()
        check_timeout(timeout, what="publish")
        await self._gate.wait_for_room(timeout)
        self._serving.reclaim()
        read_back = None
        if self._items.device.type == "cuda":
            ranges = None
            if slots.device.type == "cpu" and replicas.device.type == "cpu":
                # Indexes on the host, as an engine's scheduler holds a request's pages: checked
                # here, with no device round trip, and copied to the pools' device on the
                # caller's stream, which the gathers run after.
                replicas, slots = checked_indexes(pools, replicas, slots)
            else:
                ranges = index_ranges(pools, replicas, slots)
            # The lookup key (and the index ranges) come back in one read, queued first: the
            # item's layout and its gathers' plan are worked out while they travel. Nothing is
            # launched on the pools, or buffered, before the indexes are known to be in range.
            read_back = _lookup_key_and(input_tokens, roi, ranges)
        # The item's buffer is laid out first and the KV gathered straight into it: one pass
        # over the bytes, no staging copy.
        g, tokens = pools.geometry, slots.numel()
        kv_shape = (pools.layers, tokens, g.heads, g.head_dim)
        value_shape = kv_shape if g.kv == 2 else (pools.layers, tokens, 1, 0)
        packed = pack_empty(
            [(input_tokens.shape, input_tokens.dtype), None if roi is None else (roi.shape, roi.dtype),
             (kv_shape, pools.dtype), (value_shape, pools.dtype), None],
            self._items.device,
            self._items.allocate,
        )  # fmt: skip
        item_tokens, item_roi, key, value, _ = packed.tensors
        _, _, key_meta, value_meta, _ = packed.metas
        assert item_tokens is not None and key is not None and value is not None
        assert key_meta is not None and value_meta is not None
        for into, source in ((item_tokens, input_tokens), (item_roi, roi)):
            if into is not None and source is not None:
                copy_into(into, source)
        layer_bytes = (key.nbytes + value.nbytes) // max(1, pools.layers)
        per_chunk = max(1, self._registered.chunk_bytes // max(1, layer_bytes))
        chunks = chunk_plan(pools.layers, per_chunk, small_last=self._registered.taper)
        segments, segment_chunks = layer_segments(key_meta, value_meta, packed.storage.numel(), chunks)
        gathers: _Gathers | None = None
        if read_back is not None:
            # A chunk's keys and values are gathered apart, each before its own segment (the
            # values follow the keys in the payload): the first segment leaves once the first
            # chunk's keys are gathered, half of the first gather.
            parts: list[Part] = ["key", "value"] if g.kv == 2 else ["key"]
            segment_gathers = [
                chunk * len(parts) + (1 if len(parts) == 2 and offset >= value_meta.offset else 0)
                for (offset, _), chunk in zip(segments, segment_chunks, strict=True)
            ]

            def plan(replicas: torch.Tensor = replicas, slots: torch.Tensor = slots) -> list[PreparedGather]:
                """Planned once for every layer; a chunk only moves the grid (no new checks,
                views or compilation per chunk)."""
                whole = [prepare_gather_into(pools, replicas, slots, key, value, part=part) for part in parts]
                return [part.for_layers(first, end) for first, end in chunks for part in whole]

            ready = [torch.cuda.Event() for _ in range(len(chunks) * len(parts))]
            # The send path queues each gather right before the sends of its bytes, once the
            # Deliver header has left (the consumer posts its receives meanwhile); a first
            # launch compiles, for about a second, in a worker thread. They are planned now
            # while index ranges travel back from the device, else after the header left.
            gathers = _Gathers(plan, ready, torch.cuda.current_stream(self._items.device), self._workers.gather_thread)
            if ranges is not None:
                gathers.plan()
            masked, read_ranges = read_back()
            if read_ranges and not ranges_fit(pools, read_ranges):
                check_indices(pools, replicas, slots)  # raises, naming the index
        else:
            masked = masked_tokens(input_tokens, roi)
            # On the gather thread, as a stream's layers are (see `gathered_layer`).
            await asyncio.wrap_future(
                self._workers.gather_thread().submit(gather_into_any, pools, replicas, slots, key, value)
            )
        item = item_from_packed(
            packed, item_id=self._core.new_item_id(), seq=self._core.buffer.next_seq(), masked=masked,
            segments=segments,
        )  # fmt: skip
        if gathers is not None:
            item.bytes.segment_ready = [ready[gather] for gather in segment_gathers]
            item.bytes.segment_gathers = segment_gathers
            item.bytes.gathers = gathers
        # Buffered before the other gathers are queued: a waiting pull gets its Deliver header
        # first and posts its receives while they are queued.
        await self._inserter.buffer(item)
        if gathers is not None:
            try:
                await all_gathers_queued(item.bytes)
            except GathersFailed as failed:
                await self._serving.perform(self._core.discard(item.record))
                raise KVRTError(f"publish: queuing the gathers on {self._items.device} failed: {failed}") from failed
