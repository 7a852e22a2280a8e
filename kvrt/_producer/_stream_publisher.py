"""`open_stream` on the producer: a request's KV sent a layer at a time while prefill runs,
each layer gathered off the loop and offered to the consumer that holds the stream.
"""

from __future__ import annotations

import asyncio

import torch

from kvrt import _messages as m
from kvrt._checksum import tensors_checksum
from kvrt._errors import (
    InvalidInputError,
)
from kvrt._item import (
    check_timeout,
    check_tokens,
    item_from_packed,
    item_from_tokens,
)
from kvrt._item_bytes import ItemBytes
from kvrt._pools import checked_indexes, per_token
from kvrt._producer._parts import Gate, ItemKeeper, RegisteredPools, Workers, loop_time
from kvrt._producer._serve import ServeLoop
from kvrt._protocol import ProducerCore
from kvrt._protocol.lookup_buffer import BufferedItem
from kvrt._streams import Placement, ProducerStream
from kvrt._tensors import copy_into, pack, pack_empty, tensor_meta
from kvrt._threads import launch_on


class StreamPublisher:
    """Streams of layers, opened by the prefill engine."""

    def __init__(
        self, core: ProducerCore, gate: Gate, items: ItemKeeper, workers: Workers, registered: RegisteredPools,
        serving: ServeLoop,
    ) -> None:  # fmt: skip
        self._core = core
        self._gate = gate
        self._items = items
        self._registered = registered
        self._serving = serving
        self.device = items.device
        self.gather_thread = workers.gather_thread

    async def open_stream(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor | None = None,
        *,
        layers: int | None = None,
        slots: torch.Tensor | None = None,
        replica: torch.Tensor | int = 0,
        timeout: float | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> ProducerStream:
        """See `Producer.open_stream`."""
        self._gate.check_open()
        check_tokens(input_tokens, roi, what="open_stream")
        check_timeout(timeout, what="open_stream")
        placement = None
        if slots is not None:
            placement = self._placement(input_tokens, slots, replica)
            if layers is not None and layers != placement.pools.layers:
                raise InvalidInputError(f"a stream of the pools has its {placement.pools.layers} layers, not {layers}")
            layers = placement.pools.layers
        if not isinstance(layers, int) or not 0 < layers <= m.MAX_LAYERS:
            raise InvalidInputError(f"layers must be an int in [1, {m.MAX_LAYERS}], got {layers!r}")
        await self._gate.wait_for_room(timeout)
        packed = pack((input_tokens, roi), torch.device("cpu"))
        item_id, seq = self._core.new_item_id(), self._core.buffer.next_seq()
        item = self._items.keep(item_from_tokens(packed, item_id=item_id, seq=seq, layers=layers))
        await self._serving.perform(self._core.open_stream(item, loop_time()))
        return ProducerStream(self, item, layers, int(input_tokens.numel()), placement)

    def _placement(self, input_tokens: torch.Tensor, slots: torch.Tensor, replica: torch.Tensor | int) -> Placement:
        pools = self._registered.pools
        if pools is None:
            raise InvalidInputError("a stream of the pools needs them: call register_pools first")
        replicas = per_token(replica, slots)
        if slots.numel() != input_tokens.numel():
            raise InvalidInputError(f"open_stream: {slots.numel()} slots for {input_tokens.numel()} tokens")
        return Placement(pools, *checked_indexes(pools, replicas, slots))

    async def gathered_layer(
        self, placement: Placement, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """Layer `layer` of a stream of the pools, gathered into a block of its own (key and
        value back to back: one transfer), and on a GPU the event after the gather, queued on
        the current stream. A first launch compiles, for about a second, in the gather thread
        (the loop must not wait for that), queued on the same stream all the same."""
        from kvrt.kernels.paged_kv import prepare_gather_layer

        pools = placement.pools
        if pools.device.type != "cuda":
            return (await self.gathered_layers(placement, range(layer, layer + 1)))[0]
        key, value = _layer_block(placement)
        prepared = prepare_gather_layer(pools, placement.replicas, placement.slots, layer, key, value)
        caller = torch.cuda.current_stream(pools.device)
        await launch_on(prepared, caller, self.gather_thread)
        ready = torch.cuda.Event()
        ready.record(caller)
        return key, value, ready

    async def gathered_layers(
        self, placement: Placement, layers: range
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]]:
        """`gathered_layer` for each of `layers`, in order. On the host on the gather thread (on
        a busy host a layer's gather can take a tenth of a second and a step's gathers seconds,
        which no lookup or ping may wait behind), all in one hand-off (each costs two thread
        switches and a wake-up of the loop: a 32-layer model would pay them 32 times a request)."""
        if placement.pools.device.type == "cuda":
            return [await self.gathered_layer(placement, layer) for layer in layers]
        from kvrt.kernels.paged_kv import gather_layer_into_any

        pools, replicas, slots = placement.pools, placement.replicas, placement.slots
        blocks = [_layer_block(placement) for _ in layers]

        def gather_all() -> None:
            for layer, (key, value) in zip(layers, blocks, strict=True):
                gather_layer_into_any(pools, replicas, slots, layer, key, value)

        await asyncio.wrap_future(self.gather_thread().submit(gather_all))
        return [(key, value, None) for key, value in blocks]

    async def stream_layer(
        self, item: BufferedItem, key: torch.Tensor, value: torch.Tensor, ready: torch.cuda.Event | None
    ) -> None:
        """The core records the layer; its tensors go in the stream's store, where the send
        path reads them (GPU: once `ready` fired)."""
        store = self._items[item].store
        assert store is not None
        metas = tensor_meta(key), tensor_meta(value)
        if self._items.checksum and key.device.type == "cpu":
            store.checksums.append(tensors_checksum((key, value), metas, len(store.keys)))
        elif self._items.checksum:  # its end carries it: the layer leaves before it is written
            store.layer_sums.append(self._items.queue_tensors_checksum((key, value), metas, len(store.keys), ready))
        out = self._core.stream_layer(item, *metas)
        store.keys.append(key)
        store.values.append(value)
        store.ready.append(ready)
        await self._serving.perform(out)
        reader = None if item.stream is None else item.stream.reader
        if reader is not None:  # a reader slower than the prefill slows it down rather than be dropped
            await self._serving.room_for(reader)
        await asyncio.sleep(0)  # a yield: a prefill publishing in a tight loop leaves the loop to the others

    async def finish_stream(self, item: BufferedItem, hidden: torch.Tensor | None) -> None:
        """The stream as one whole item (what a reader confirms, or what `drop_select` takes if
        nobody read it): its layers stacked straight into the item's buffer, one copy."""
        stream, opened = item.stream, self._items[item]
        store = opened.store
        assert stream is not None and store is not None
        first_key, first_value = store.keys[0], store.values[0]
        packed = pack_empty(
            [(opened.input_tokens.shape, opened.input_tokens.dtype),
             None if opened.roi is None else (opened.roi.shape, opened.roi.dtype),
             ((stream.layers, *first_key.shape), first_key.dtype),
             ((stream.layers, *first_value.shape), first_value.dtype),
             None if hidden is None else (hidden.shape, hidden.dtype)],
            self.device, self._items.allocate,  # registered memory: a consumer maps it once, not per item
        )  # fmt: skip
        tokens, roi, key, value, whole_hidden = packed.tensors
        assert tokens is not None and key is not None and value is not None
        for into, source in ((tokens, opened.input_tokens), (roi, opened.roi), (whole_hidden, hidden)):
            if into is not None and source is not None:
                copy_into(into, source)
        new = item_from_packed(packed, item_id=item.item_id, seq=item.seq, masked=item.masked_tokens)
        whole, whole_bytes = self._items.keep(new), new.bytes
        whole_bytes.layer_sums = store.layer_sums or None
        keys, values, written = list(store.keys), list(store.values), list(store.ready)

        def fill(whole: BufferedItem, whole_bytes: ItemBytes) -> None:
            """The layers stacked straight into the item's buffer (one copy), on the current
            stream, after the streams that wrote them; the transports then prepare it."""
            if self.device.type == "cuda":
                current = torch.cuda.current_stream(self.device)
                for event in written:
                    if event is not None:
                        current.wait_event(event)
                for tensor in (*keys, *values):
                    tensor.record_stream(current)  # freed with this closure, maybe before the stack ran
            torch.stack(keys, out=key)
            torch.stack(values, out=value)
            self._items.prepare(whole, whole_bytes)

        if stream.reader is None and self.device.type == "cuda":
            fill(whole, whole_bytes)
        elif stream.reader is None:  # on the host the stack copies every layer: off the loop
            try:
                await asyncio.wrap_future(self.gather_thread().submit(fill, whole, whole_bytes))
            except asyncio.CancelledError:  # a prefill that gave up its finish ends its stream
                await self.abort_stream(item, "the prefill's finish was cancelled")
                raise
        else:
            # The reader has every layer on its way: the whole item is written only if it must
            # travel whole after all (its reader leaves before confirming it). Stacking every
            # layer now would share the producer's GPU with the last layers' sends (a 1 GiB
            # stack slowed the last send of `kvrt bench stream` from ~0.11 to ~0.26 ms).
            whole_bytes.fill = fill
            if self.device.type == "cuda":  # the end's hidden states are written on this stream
                whole_bytes.ready_event = torch.cuda.Event()
                whole_bytes.ready_event.record(torch.cuda.current_stream(self.device))
        await self._serving.perform(self._core.finish_stream(item, whole, loop_time()))
        store.release()

    async def abort_stream(self, item: BufferedItem, reason: str) -> None:
        store = self._items[item].store
        await self._serving.perform(self._core.abort_stream(item, reason))
        if store is not None:
            store.release()


def _layer_block(placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's key and value, back to back in one block of their own (one transfer)."""
    pools = placement.pools
    g, tokens = pools.geometry, placement.slots.numel()
    block = torch.empty((g.kv, tokens, g.heads, g.head_dim), dtype=pools.dtype, device=pools.device)
    value = block[1] if g.kv == 2 else torch.empty((tokens, 1, 0), dtype=pools.dtype, device=pools.device)
    return block[0], value
