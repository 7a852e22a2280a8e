"""A consumer's lookups (`drop_select`, `drop_select_many`, and the lookup under `pull` and
`open_stream`): one producer asked on its link; several asked at once (`_across`); a head range
taken as pieces (`_across`); a step's lookups in batches (`_batch`); in a TP group, each of
these agreed with the other ranks (`_agreed`). Runs in the caller's task.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence

import torch

from kvrt import _messages as m
from kvrt import _metrics
from kvrt._consumer._across import Taken, landing, take_best, take_pieces
from kvrt._consumer._agreed import agree_batch, agree_one
from kvrt._consumer._batch import batch_request, batches, chunks
from kvrt._consumer._connections import Connections
from kvrt._consumer._session import OnLanding
from kvrt._errors import InvalidInputError, KVRTError, fresh_copy
from kvrt._heads import PiecePlan, head_range, plan_pieces
from kvrt._item import KVBuffers, KVItem, check_buffers, check_buffers_apart, check_timeout, land_in, query_bytes
from kvrt._messages import HeadRange
from kvrt._metrics import ConsumerCounters
from kvrt.transports._base import BufferLanding, InPlace, PoolLanding, caller_ready


class DropSelects:
    """Lookups among a consumer's producers, agreed in its TP group if it has one."""

    def __init__(
        self, connections: Connections, device: torch.device, counters: ConsumerCounters,
        metrics: _metrics.ConsumerMetrics,
    ) -> None:  # fmt: skip
        self._connections = connections
        self._device = device
        self._counters = counters
        self._metrics = metrics

    async def drop_select(
        self,
        input_tokens: torch.Tensor | None,
        roi: torch.Tensor | None = None,
        timeout: float | None = 0.0,
        *,
        stream: torch.cuda.Stream | None = None,
        into: KVBuffers | None = None,
        heads: slice | None = None,
    ) -> KVItem | None:
        """See `Consumer.drop_select` (`stream` is the caller's: current while this runs)."""
        buffers = check_buffers(into, self._device, what="drop_select")
        wanted = head_range(heads, "drop_select: heads")
        return await self.lookup(input_tokens, roi, timeout, what="drop_select", into=buffers, heads=wanted)

    async def drop_select_many(
        self,
        queries: Sequence[torch.Tensor | None],
        rois: Sequence[torch.Tensor | None] | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
        into: Sequence[KVBuffers | None] | None = None,
        heads: slice | None = None,
    ) -> list[KVItem | None]:
        """See `Consumer.drop_select_many` (`stream` is the caller's: current while this runs)."""
        connections = self._connections
        connections.check_open()
        what = "drop_select_many"
        wanted = head_range(heads, f"{what}: heads")
        if not isinstance(queries, Sequence):
            raise InvalidInputError(
                f"{what}: queries must be a sequence of token tensors (or None), got {type(queries)}"
            )
        if rois is not None and len(rois) != len(queries):
            raise InvalidInputError(f"{what}: {len(rois)} rois for {len(queries)} queries")
        lookups = list(zip(queries, rois or [None] * len(queries), strict=True))
        wire = [query_bytes(tokens, roi, what=what) for tokens, roi in lookups]
        buffers = self._buffers_per_query(into, len(queries), what=what)
        plans = None if wanted is None else self.piece_plans(wanted)
        if len(connections.links) != 1:
            # One after the other: a query sees the items the one before it gave back.
            return [
                await self.lookup(tokens, roi, 0.0, what=what, into=query_buffers, heads=wanted)
                for (tokens, roi), query_buffers in zip(lookups, buffers, strict=True)
            ]
        plan = None if plans is None else plans[0]
        link = connections.links[0]
        timer = _metrics.Timer(what)
        try:
            if connections.consensus is not None:
                items = await agree_batch(link, connections.consensus, wire, buffers, self.land_now, plan)
            else:
                calls = [
                    link.call(batch_request(batch, plan), into=landing(chunk))
                    for batch, chunk in zip(batches(wire), chunks(buffers, batches(wire)), strict=True)
                ]
                # One request (up to 256 queries) is awaited as it is: a task around it would
                # cost the loop a task and a hop per batch.
                answers = [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
                items = [item for answer in answers for item in answer.items or ()]
        except KVRTError as error:
            self._count_error(error, lookups=len(wire))
            raise
        timer.done()
        for item in items:
            self._count(item)
        return items

    async def lookup(
        self, input_tokens: torch.Tensor | None, roi: torch.Tensor | None, timeout: float | None, *, what: str,
        on_landing: OnLanding | None = None, into: KVBuffers | None = None, heads: HeadRange | None = None,
        pools: PoolLanding | None = None,
    ) -> KVItem | None:  # fmt: skip
        """drop_select, counted and timed; `on_landing` and `pools` (`in_place`) as for
        `_Link.call` (one producer, no group); `into` checked already; `heads` a checked range
        (pieces, see `Consumer.drop_select`)."""
        self._connections.check_open()
        query = query_bytes(input_tokens, roi, what=what)
        check_timeout(timeout, what=what)
        plans = None if heads is None else self.piece_plans(heads)

        def build(request_id: int) -> m.Message:
            return m.DropSelect(request_id=request_id, tokens=query, timeout_s=timeout)

        timer = _metrics.Timer("drop_select")
        try:
            if plans is not None:
                item = await self._pieces(query, timeout, plans, into=into)
            else:
                item = await self._whole(build, waits_s=timeout, on_landing=on_landing, into=into, pools=pools)
        except KVRTError as error:
            self._count_error(error)
            raise
        timer.done()
        self._count(item, waited=timeout != 0)
        return item

    def piece_plans(self, heads: HeadRange) -> list[PiecePlan]:
        """Which producers hold `heads`, and which of their heads (see `Consumer.drop_select`)."""
        connections = self._connections
        if connections.readers_unknown is not None:
            raise fresh_copy(connections.readers_unknown)
        plans = plan_pieces(heads, [link.core.heads for link in connections.links], connections.readers)
        if connections.consensus is not None and len(plans) != len(connections.links):
            asked = {plan.link for plan in plans}
            idle = [link.endpoint for index, link in enumerate(connections.links) if index not in asked]
            raise InvalidInputError(
                f"heads [{heads.first}, {heads.end}) lie with none of the producers at {idle}: in a TP group each rank "
                "connects only to the producers that hold its heads (their items count it as a reader)"
            )
        return plans

    def land_now(self, item: KVItem, buffers: KVBuffers | None, landed_on: torch.cuda.Stream | None) -> KVItem:
        """`item`, which its link checked fits `buffers`, copied there now (the link's choice
        or the group's decision made), on the current stream once its landing's is done."""
        if buffers is None:
            return item
        if landed_on is not None:
            torch.cuda.current_stream(self._device).wait_stream(landed_on)
        return land_in(item, buffers)

    async def _whole(
        self, build: Callable[[int], m.Message], *, waits_s: float | None, on_landing: OnLanding | None = None,
        into: KVBuffers | None = None, pools: PoolLanding | None = None,
    ) -> KVItem | None:  # fmt: skip
        """One drop-select of whole items whose producer may wait `waits_s` for a match (None:
        for ever)."""
        links = self._connections.links
        if self._connections.consensus is None and len(links) == 1:
            in_place: InPlace | None = pools
            if into is not None and pools is None:  # the transport may READ into them itself (nixl)
                ready = caller_ready(self._device)
                in_place = BufferLanding(ready, key=into.key, value=into.value, hidden=into.hidden)
            try:
                reply = await links[0].call(
                    build, on_landing=on_landing, waits_s=waits_s, into=landing(into), in_place=in_place
                )
            finally:
                if in_place is not None:  # nothing writes the caller's memory once this returns
                    await in_place.ended()
            return reply.item
        return await self._kept(functools.partial(take_best, links, build, waits_s=waits_s, into=into), into)

    async def _pieces(
        self, query: bytes | None, timeout: float | None, plans: list[PiecePlan], *, into: KVBuffers | None
    ) -> KVItem | None:
        """drop_select of a head range: a piece from each producer in `plans`, joined."""
        take = functools.partial(take_pieces, self._connections.links, query, timeout, plans, into=into)
        return await self._kept(take, into)

    async def _kept(self, take: Callable[[], Awaitable[Taken | None]], into: KVBuffers | None) -> KVItem | None:
        """What `take` took, not yet confirmed, kept (in a TP group, as the group agreed) and
        landed in `into`; or given back."""
        consensus = self._connections.consensus
        if consensus is not None:
            return await agree_one(take, consensus, self.land_now, into=into)
        taken = await take()
        if taken is None:
            return None
        if not taken.settle(keep=True):
            raise taken.link.lease_error()
        return self.land_now(taken.item, into, taken.landed_on)

    def _buffers_per_query(
        self, into: Sequence[KVBuffers | None] | None, queries: int, *, what: str
    ) -> list[KVBuffers | None]:
        """`into` of a drop_select_many, checked: one entry (None or buffers) per query."""
        if into is None:
            return [None] * queries
        if not isinstance(into, Sequence) or len(into) != queries:
            raise InvalidInputError(
                f"{what}: into must name one kvrt.KVBuffers (or None) for each of the {queries} queries"
            )
        device = self._device
        checked = [check_buffers(entry, device, what=f"{what} (query {i})") for i, entry in enumerate(into)]
        check_buffers_apart(checked, what=what)
        return checked

    def _count(self, item: KVItem | None, *, waited: bool = False) -> None:
        """A lookup answered: its outcome, and an item's counts. `waited`: the call had a
        timeout (a miss then is a lookup that timed out)."""
        miss = _metrics.LookupOutcome.TIMEOUT if waited else _metrics.LookupOutcome.MISS
        self._metrics.looked_up(miss if item is None else _metrics.LookupOutcome.HIT)
        if item is not None:
            counters = self._counters
            counters.items += 1
            counters.bytes += sum(tensor.nbytes for tensor in (item.key, item.value, item.hidden) if tensor is not None)

    def _count_error(self, error: KVRTError, lookups: int = 1) -> None:
        self._metrics.looked_up(_metrics.outcome_of_error(error), lookups)
        errors = self._counters.errors
        errors[type(error).__name__] = errors.get(type(error).__name__, 0) + 1
