"""`Consumer.pull` (`Pulls`): a published request taken by its tokens and scattered into the caller's
paged pools as its chunks land, off the loop on one scatter thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence

import torch

from kvrt import _messages as m
from kvrt._consumer._connections import Connections, Scatters
from kvrt._consumer._drop_selects import DropSelects
from kvrt._errors import (
    InvalidInputError,
)
from kvrt._heads import head_range
from kvrt._item import KVItem
from kvrt._pools import PoolTable, checked_indexes, per_token
from kvrt._tensors import layer_chunks, transfer_segments
from kvrt.transports._base import Arrival, PoolLanding, caller_ready


class Pulls:
    """Pulls into paged pools."""

    def __init__(
        self, connections: Connections, scatters: Scatters, lookups: DropSelects, device: torch.device
    ) -> None:
        self._connections = connections
        self._scatters = scatters
        self._lookups = lookups
        self.device = device

    async def pull(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor | None = None,
        *,
        into: PoolTable,
        slots: torch.Tensor,
        replica: torch.Tensor | int = 0,
        timeout: float | None = 0.0,
        stream: torch.cuda.Stream | None = None,
        heads: slice | None = None,
    ) -> KVItem | None:
        """See `Consumer.pull`."""
        if into.device != self.device:
            raise InvalidInputError(f"the pools are on {into.device}, this consumer is on {self.device}")
        from kvrt.kernels.paged_kv import scatter_from_any  # Triton: only when pools are used

        # Bad slots are refused before any item is taken.
        given = per_token(replica, slots), slots
        replicas, slots = checked_indexes(into, *given)
        wanted = head_range(heads, "pull: heads")
        pools = None
        if len(self._connections.links) == 1 and self._connections.consensus is None and wanted is None:
            # A transport that reads the producer's memory itself (nixl) lands K and V in the
            # slots in the same READ, with no scatter after it.
            pools = await self._pool_landing(into, *given)
        try:
            if self.device.type == "cuda" and pools is not None:
                item, scattered = await self._pull_pipelined(input_tokens, roi, timeout, into, slots, replicas, pools)
            else:
                item = await self._lookups.lookup(input_tokens, roi, timeout, what="pull", heads=wanted, pools=pools)
                scattered = pools is not None and pools.landed
        finally:
            if pools is not None:  # the caller's later work on these slots comes after the writes
                await pools.ended()
        if item is not None and not scattered:
            count = min(item.key.shape[1], slots.numel())
            # Straight from the item as it arrived (its K and V are views of the received
            # payload): no staging copy.
            if self.device.type == "cuda":
                await self._scatter_off_the_loop(into, item, replicas[:count], slots[:count])
            else:
                scatter_from_any(into, item.key, item.value, replicas[:count], slots[:count])
        return item

    async def _scatter_off_the_loop(
        self, into: PoolTable, item: KVItem, replicas: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """A GPU item's scatter, queued by the scatter thread (a first launch compiles, for
        about a second, which the loop must not wait for), after the caller's stream reached
        this point (the item landed on it); the caller's stream waits for the scatter."""
        from kvrt.kernels.paged_kv import scatter_from

        caller = torch.cuda.current_stream(self.device)
        landed = torch.cuda.Event()
        landed.record(caller)

        def queue() -> torch.cuda.Event:
            stream = self._scatters.scatter_stream()
            with torch.cuda.stream(stream):
                stream.wait_event(landed)
                for tensor in (item.key, item.value, slots, replicas):
                    tensor.record_stream(stream)
                scatter_from(into, item.key, item.value, replicas, slots, check=False)  # checked by `pull`
                done = torch.cuda.Event()
                done.record(stream)
            return done

        caller.wait_event(await asyncio.shield(asyncio.wrap_future(self._scatters.scatter_thread().submit(queue))))

    async def _pull_pipelined(
        self, input_tokens: torch.Tensor, roi: torch.Tensor | None, timeout: float | None, into: PoolTable,
        slots: torch.Tensor, replicas: torch.Tensor, pools: PoolLanding,
    ) -> tuple[KVItem | None, bool]:  # fmt: skip
        """`pull` on a GPU: chunks are scattered as they land (see `pull`). Returns the item and
        whether it was scattered (not when it came without early tensors, as over TCP)."""
        from kvrt.kernels.paged_kv import scatter_from

        caller = torch.cuda.current_stream(self.device)
        indexes_ready = torch.cuda.Event()
        indexes_ready.record(caller)  # the slots may still be being written on the caller's stream
        queued: list[concurrent.futures.Future[torch.cuda.Event]] = []

        def queue_scatters(
            deliver: m.Deliver, key: torch.Tensor, value: torch.Tensor, landed: Sequence[torch.cuda.Event]
        ) -> torch.cuda.Event:
            """In the scatter thread (Triton may compile on a first launch; the loop must not
            wait for that): each chunk's scatter waits on its landing, on the scatter stream."""
            count = min(key.shape[1], slots.numel())
            segments = transfer_segments(deliver.segments, deliver.payload_bytes)
            stream = self._scatters.scatter_stream()
            with torch.cuda.stream(stream):
                stream.wait_event(indexes_ready)
                for tensor in (key, value, slots, replicas):
                    tensor.record_stream(stream)
                # A chunk's keys are scattered as soon as they landed, while its values are
                # still on the wire: after the last byte only the last values are left to write.
                for chunk in layer_chunks(deliver.key, deliver.value, segments):
                    stream.wait_event(landed[chunk.ready])
                    scatter_from(into, key, value, replicas[:count], slots[:count],
                                 layers=(chunk.first, chunk.end), part=chunk.part, check=False)  # fmt: skip
                done = torch.cuda.Event()
                done.record(stream)
            return done

        def scatter_as_it_lands(deliver: m.Deliver, arrival: Arrival) -> None:
            assert arrival.early is not None
            _, _, key, value, _ = arrival.early
            queued.append(self._scatters.scatter_thread().submit(queue_scatters, deliver, key, value, arrival.landed))

        try:
            item = await self._lookups.lookup(
                input_tokens, roi, timeout, what="pull", on_landing=scatter_as_it_lands, pools=pools
            )
        finally:
            for job in queued:  # the caller's later work on these slots comes after the writes
                # Queued long before the last byte landed, as a rule: then no wrapping future
                # and its hops of the loop (three, after the item itself completed).
                done: torch.cuda.Event = job.result() if job.done() else await asyncio.shield(asyncio.wrap_future(job))
                caller.wait_event(done)
        return item, bool(queued) or pools.landed

    async def _pool_landing(self, into: PoolTable, replicas: torch.Tensor, slots: torch.Tensor) -> PoolLanding:
        """The pools as the link's transport may land the item there itself. Indexes held on
        the device are read back (on a thread, after the caller's stream wrote them) only for
        a transport that does so (nixl)."""
        ready = caller_ready(self.device)
        if replicas.device.type == "cpu" and slots.device.type == "cpu":
            return PoolLanding(ready, table=into, replicas=replicas.numpy(), slots=slots.numpy())
        receiver = self._connections.links[0].receiver
        if receiver is None:
            return PoolLanding(ready, table=into, replicas=None, slots=None)
        return await receiver.pools_in_place(ready, into, replicas, slots)
