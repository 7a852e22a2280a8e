"""`Consumer.open_stream` (`StreamOpening`): a stream asked for by its tokens, its layers landed as they come,
into the caller's tensors or, through a pool writer, into its paged pools. The link's part of
a stream (its layers arriving) is `_stream_layers`.
"""

from __future__ import annotations

import torch

from kvrt import _messages as m
from kvrt._consumer._connections import Connections, Scatters
from kvrt._consumer._drop_selects import DropSelects
from kvrt._consumer._link import _Link
from kvrt._consumer._session import _Reply
from kvrt._errors import (
    InvalidInputError,
)
from kvrt._heads import head_range
from kvrt._item import check_timeout, query_bytes
from kvrt._pools import PoolTable, checked_indexes, per_token
from kvrt._streams import ConsumerStream, Placement, PoolWriter


class StreamOpening:
    """`open_stream`, and the pool writer that lands its layers."""

    def __init__(
        self, connections: Connections, scatters: Scatters, lookups: DropSelects, device: torch.device
    ) -> None:
        self._connections = connections
        self._scatters = scatters
        self._lookups = lookups
        self.device = device

    async def open_stream(
        self,
        input_tokens: torch.Tensor | None,
        roi: torch.Tensor | None = None,
        timeout: float | None = 0.0,
        *,
        into: PoolTable | None = None,
        slots: torch.Tensor | None = None,
        replica: torch.Tensor | int = 0,
        stream: torch.cuda.Stream | None = None,
        heads: slice | None = None,
        skip: int = 0,
    ) -> ConsumerStream | None:
        """See `Consumer.open_stream`."""
        connections = self._connections
        connections.check_open()
        if len(connections.links) != 1 or connections.consensus is not None:
            raise InvalidInputError("streams need a consumer of one producer, without group= (not supported yet)")
        query = query_bytes(input_tokens, roi, what="open_stream")
        check_timeout(timeout, what="open_stream")
        wanted = head_range(heads, "open_stream: heads")
        plan = None if wanted is None else self._lookups.piece_plans(wanted)[0]
        writer = None if into is None and slots is None else self._pool_writer(into, slots, replica, skip, wanted)

        def build(request_id: int) -> m.DropSelect:
            if plan is None:
                return m.DropSelect(request_id=request_id, tokens=query, timeout_s=timeout, stream=True, whole=True)
            return m.DropSelect(
                request_id=request_id, tokens=query, timeout_s=timeout, stream=True,
                heads=plan.heads, readers=plan.readers, hidden=plan.hidden, whole=True,
            )  # fmt: skip

        link = connections.links[0]
        reply = await link.call(
            build,
            confirm=False,
            writer=writer,
            waits_s=timeout,
        )
        if reply.stream is not None or reply.item is None:
            return reply.stream
        return await self._stream_of_item(link, reply, writer)

    async def _stream_of_item(self, link: _Link, reply: _Reply, writer: PoolWriter | None) -> ConsumerStream:
        """A finished item the producer sent whole (one transfer; `DropSelect.whole`), read as a
        stream: every layer is there at once (for a reader of the pools, written there by one
        launch). It is confirmed once written; one that does not fit the pools goes back."""
        item, deliver = reply.item, reply.message
        assert item is not None and isinstance(deliver, m.Deliver)
        layers = item.key.shape[0]
        landed = None
        if self.device.type == "cuda":  # it landed on the loop thread's current stream
            landed = torch.cuda.Event()
            landed.record(reply.landed_on or torch.cuda.current_stream(self.device))
        written = landed
        try:
            if writer is not None:
                pools = writer.placement.pools
                if layers != pools.layers:
                    raise InvalidInputError(f"the stream has {layers} layers, the pools {pools.layers}")
                written = await writer.write_all(item.key, item.value, landed)
        except BaseException:
            link.settle(deliver.item_id, keep=False)
            raise
        if not link.settle(deliver.item_id, keep=True):
            raise link.lease_error()
        stream = ConsumerStream(item.input_tokens, item.roi, item.matched, layers, lambda: None, writer)
        per_layer = item.value.dim() == 4  # a latent's value is empty: there is none a layer
        for layer in range(layers):
            stream.deliver_layer(layer, item.key[layer], item.value[layer] if per_layer else item.value, written)
        stream.finish(item.hidden)
        return stream

    def _pool_writer(
        self, into: PoolTable | None, slots: torch.Tensor | None, replica: torch.Tensor | int, skip: int,
        wanted: m.HeadRange | None,
    ) -> PoolWriter:  # fmt: skip
        if into is None or slots is None:
            raise InvalidInputError("a stream into the pools needs both into= and slots=")
        if into.device != self.device:
            raise InvalidInputError(f"the pools are on {into.device}, this consumer is on {self.device}")
        if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
            raise InvalidInputError(f"skip must be an int >= 0 (tokens the pools hold already), got {skip!r}")
        heads = None
        producer_heads = self._connections.links[0].core.heads
        if wanted is None and into.heads_said and producer_heads is not None:
            wanted = producer_heads  # a whole item of a producer that says which heads it holds
        if wanted is not None and into.geometry.kv == 2:
            heads = (wanted.first - into.first_head, wanted.end - into.first_head)
            if heads[0] < 0 or heads[1] > into.geometry.heads:
                raise InvalidInputError(
                    f"heads [{wanted.first}, {wanted.end}) do not lie in the pools' heads [{into.first_head}, "
                    f"{into.first_head + into.geometry.heads}) (PoolTable(..., heads=) says which the pools hold)"
                )
        replicas, slots = checked_indexes(into, per_token(replica, slots), slots)
        indexes_ready = None
        if self.device.type == "cuda":
            indexes_ready = torch.cuda.Event()
            indexes_ready.record(torch.cuda.current_stream(self.device))
        return PoolWriter(
            Placement(into, replicas, slots), self._scatters.scatter_thread, self._scatters.scatter_stream,
            indexes_ready, skip=skip, heads=heads,
        )  # fmt: skip
