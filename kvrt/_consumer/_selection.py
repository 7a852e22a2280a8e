"""Lookups: `drop_select` and `drop_select_many`, choosing among the producers (each link
asked in turn, in batches), and, in a TP group, agreeing on one outcome with the other
ranks (`_consensus`). Runs in the caller's task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

import torch

from kvrt import _messages as m
from kvrt import _metrics
from kvrt._caller_stream import lands_on_caller_stream
from kvrt._consensus import GroupConsensus, Outcome, Status, error_for, status_of
from kvrt._consumer._link import _Link
from kvrt._consumer._session import OnLanding, _Reply
from kvrt._consumer._state import ConsumerState
from kvrt._errors import (
    InvalidInputError,
    KVRTError,
    fresh_copy,
)
from kvrt._heads import PiecePlan, head_range, join_pieces, pieces_agree, plan_pieces
from kvrt._item import (
    KVBuffers,
    KVItem,
    Landing,
    check_buffers,
    check_buffers_apart,
    check_fit,
    check_timeout,
    land_in,
    query_bytes,
    truncate,
)
from kvrt._messages import HeadRange
from kvrt.transports._base import BufferLanding, InPlace, PoolLanding, caller_ready

log = logging.getLogger("kvrt.consumer")


def _delivered(call: asyncio.Task[_Reply]) -> bool:
    """A finished call that brought an item."""
    return not call.cancelled() and call.exception() is None and call.result().item is not None


def _retrieved(call: asyncio.Task[_Reply]) -> None:
    """A call nobody awaits any more: its outcome is read, so that asyncio does not report it."""
    if not call.cancelled():
        call.exception()


def _misfit(call: asyncio.Task[_Reply]) -> bool:
    """A finished call whose item did not fit the caller's buffers (it went back)."""
    return not call.cancelled() and isinstance(call.exception(), InvalidInputError)


_BATCH_QUERY_BYTES: Final = 32 << 20
"""Most token bytes one drop_select_many request carries (a producer drops messages over 64 MiB)."""


def _batches(queries: list[bytes | None]) -> list[list[bytes | None]]:
    """Queries cut into requests of at most `MAX_BATCH` queries and `_BATCH_QUERY_BYTES`."""
    batches: list[list[bytes | None]] = []
    size = 0
    for query in queries:
        length = 0 if query is None else len(query)
        if not batches or len(batches[-1]) == m.MAX_BATCH or size + length > _BATCH_QUERY_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(query)
        size += length
    return batches


def _batch_request(queries: list[bytes | None], plan: PiecePlan | None = None) -> Callable[[int], m.Message]:
    if plan is None:
        return lambda request_id: m.DropSelectMany(request_id=request_id, queries=queries)
    return lambda request_id: m.DropSelectMany(
        request_id=request_id, queries=queries, heads=plan.heads, readers=plan.readers, hidden=plan.hidden
    )


def _chunks(buffers: list[KVBuffers | None], batches: list[list[bytes | None]]) -> list[list[KVBuffers | None]]:
    """`buffers` (one per query) cut as the queries are into `batches`."""
    chunks, start = [], 0
    for batch in batches:
        chunks.append(buffers[start : start + len(batch)])
        start += len(batch)
    return chunks


def _landing(buffers: KVBuffers | Sequence[KVBuffers | None] | None, *, copy: bool = True) -> Landing | None:
    """A call's `Landing`, or None where no query has buffers."""
    if buffers is None or (not isinstance(buffers, KVBuffers) and all(entry is None for entry in buffers)):
        return None
    return Landing(buffers, copy=copy)


@dataclass(frozen=True, slots=True)
class _Taken:
    """An item delivered by one link and not yet confirmed to its producer."""

    item: KVItem
    link: _Link
    item_id: int
    link_index: int
    landed_on: torch.cuda.Stream | None = None
    pieces: tuple[tuple[_Link, int], ...] = ()
    """An item joined from pieces of several producers: the other pieces' links and item ids."""

    def settle(self, *, keep: bool) -> bool:
        """As `_Link.settle`: False if it was to be kept but a link's lease had ended (then
        every piece goes back)."""
        if keep and not all(link.lease_holds() for link, _ in ((self.link, self.item_id), *self.pieces)):
            keep = False
            kept = False
        else:
            kept = True
        for link, item_id in ((self.link, self.item_id), *self.pieces):
            kept = link.settle(item_id, keep=keep) and kept
        return kept


class _Selecting(ConsumerState):
    """Lookups among the producers, agreed in a TP group."""

    @lands_on_caller_stream
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
        """Take the buffered item that best matches `input_tokens` (masked by `roi`).

        Called by the decode engine once per request, from its event loop; many calls may be
        in flight at once. The best match is the longest common prefix of the masked
        sequences, then the oldest item; `input_tokens` None takes the oldest item. `timeout`
        is how long to wait for a match to be inserted: 0 answers at once, None waits until
        one is, or until either side closes. Returns None on a miss.

        Raises `InvalidInputError` for tokens or a roi that are not 1-D (integer, bool)
        tensors of one length, `PeerLostError` when no producer can be reached (or its
        connection closed), `LeaseExpiredError` for an item that came after the link's lease
        ended (given back, not handed over), `KVRTTimeoutError` (phase "reply") when no answer
        came within `timeout + reply_timeout_s`, (phase "transfer") when an item's bytes do not
        come within `transfer_timeout_s`, `RemoteProtocolError` for an answer that breaks the
        protocol, `ClosedError` when the consumer closes meanwhile; in a TP group, the group's
        decision (the same error on every rank). Memory: the item's tensors are the caller's,
        on this consumer's device; the item has left the producer's buffer (its receipt
        follows). On a GPU, work queued on `stream` (None: the calling thread's current stream)
        after this returns reads the item as it landed. `into`: buffers of the caller's that
        the item lands in (`kvrt.KVBuffers`); an item that does not fit them goes back to the
        producer and the call raises `InvalidInputError`.

        `heads=slice(h0, h1)`: only the item's KV heads [h0, h1) (prefill TP unlike decode TP):
        the producer moves only their bytes, and the item waits there for the pieces the other
        readers take (each consumer takes one piece of an item; in a group the readers of a
        producer are the ranks connected to it, else one). Heads are numbered as the producers
        were told (`kvrt.Producer(heads=...)`), else from 0 in the one producer's items; a range
        that lies with several producers is asked of each, and the call returns the joined item
        only when every piece came (a miss or a failure of one gives the others back). An item
        of latents (MLA, an empty value) comes whole for any range. `hidden` comes with the
        piece of the first producer.
        """
        buffers = check_buffers(into, self.device, what="drop_select")
        wanted = head_range(heads, "drop_select: heads")
        return await self._lookup(input_tokens, roi, timeout, what="drop_select", into=buffers, heads=wanted)

    @lands_on_caller_stream
    async def drop_select_many(
        self,
        queries: Sequence[torch.Tensor | None],
        rois: Sequence[torch.Tensor | None] | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
        into: Sequence[KVBuffers | None] | None = None,
        heads: slice | None = None,
    ) -> list[KVItem | None]:
        """Several `drop_select`s answered at once (timeout 0): an item or None per query, in
        order; `stream` as for `drop_select`.

        For a serving engine that takes the KV of a whole scheduler step: with one producer
        and no TP group, up to 256 queries travel in one request and the items found come back
        in one transfer (one header, and over NCCL one operation and one completion), so the
        per-request costs are paid once per batch, not once per item. Over a paired
        transport the items of a batch are views of one received buffer, which lives until
        the last of them is freed. Items are taken in query order, each at most once. In a TP
        group (one producer) the batch is taken the same way and its lookups are agreed
        together: one round once the group's window knows batches of that size (the first
        batch after single lookups takes two), where one `drop_select` after the other takes a
        round each. With several producers the queries run as that many `drop_select`s, one
        after the other. `into`: one `kvrt.KVBuffers` (or None) per query, as for
        `drop_select`; one item that does not fit sends every item of the call back. `heads`:
        as for `drop_select`, for every query.
        """
        self._check_open()
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
        plans = None if wanted is None else self._piece_plans(wanted)
        if len(self._links) != 1:
            # One after the other: a query sees the items the one before it gave back.
            return [
                await self._lookup(tokens, roi, 0.0, what=what, into=query_buffers, heads=wanted)
                for (tokens, roi), query_buffers in zip(lookups, buffers, strict=True)
            ]
        plan = None if plans is None else plans[0]
        timer = _metrics.Timer(what)
        try:
            if self._consensus is not None:
                items = await self._agreed_drop_select_many(wire, self._consensus, buffers, plan)
            else:
                calls = [
                    self._links[0].call(_batch_request(batch, plan), into=_landing(chunk))
                    for batch, chunk in zip(_batches(wire), _chunks(buffers, _batches(wire)), strict=True)
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
        checked = [check_buffers(entry, self.device, what=f"{what} (query {i})") for i, entry in enumerate(into)]
        check_buffers_apart(checked, what=what)
        return checked

    def _land_now(self, item: KVItem, buffers: KVBuffers | None, landed_on: torch.cuda.Stream | None) -> KVItem:
        """`item`, which its link checked fits `buffers`, copied there now (the link's choice
        or the group's decision made), on the current stream once its landing's is done."""
        if buffers is None:
            return item
        if landed_on is not None:
            torch.cuda.current_stream(self.device).wait_stream(landed_on)
        return land_in(item, buffers)

    async def _agreed_drop_select_many(
        self, wire: list[bytes | None], consensus: GroupConsensus, buffers: list[KVBuffers | None],
        plan: PiecePlan | None = None,
    ) -> list[KVItem | None]:  # fmt: skip
        """drop_select_many for a TP group (one producer): take the batch unconfirmed, agree
        its lookups together, then keep each item cut to its agreed length, or give it back.
        A lookup that failed on any rank fails the whole call on every rank, as a failed
        request fails it outside a group."""
        link = self._links[0]
        sequences = [consensus.register() for _ in wire]
        taken: list[tuple[KVItem | None, int | None]] = []  # (item, its id) per query
        landed_on: list[torch.cuda.Stream | None] = []
        error: KVRTError | None = None
        try:
            for batch, chunk in zip(_batches(wire), _chunks(buffers, _batches(wire)), strict=True):
                reply = await link.call(_batch_request(batch, plan), confirm=False, into=_landing(chunk, copy=False))
                assert isinstance(reply.message, m.DeliverMany) and reply.items is not None
                hits = reply.message.hits
                taken += [
                    (item, None if hit is None else hit.item_id) for item, hit in zip(reply.items, hits, strict=True)
                ]
                landed_on += [reply.landed_on] * len(hits)
        except asyncio.CancelledError as cancelled:
            for _, item_id in taken:
                if item_id is not None:
                    link.settle(item_id, keep=False)
            for sequence in sequences:
                consensus.abandon(sequence, Outcome(status_of(cancelled)))
            raise
        except KVRTError as failure:
            error = failure
            outcomes = [Outcome(status_of(failure))] * len(wire)
        else:
            outcomes = [Outcome(Status.MISS) if item is None else Outcome(Status.OK, item.matched) for item, _ in taken]
        kept = [False] * len(taken)
        try:
            decisions = await consensus.decide_many(sequences, outcomes)
            for decision, outcome in zip(decisions, outcomes, strict=True):
                if decision.status not in (Status.OK, Status.MISS):
                    raise error_for(decision, outcome, error)
            items: list[KVItem | None] = []
            for index, ((item, _), decision) in enumerate(zip(taken, decisions, strict=True)):
                if decision.status is Status.OK:
                    assert item is not None  # OK on every rank, this one's included
                    kept[index] = True
                    items.append(
                        self._land_now(truncate(item, decision.matched_tokens), buffers[index], landed_on[index])
                    )
                else:
                    items.append(None)
            return items
        finally:
            settled = [
                link.settle(item_id, keep=keep, send=False)
                for (_, item_id), keep in zip(taken, kept, strict=True)
                if item_id is not None
            ]
            link._send_receipts()
            if not all(settled):
                raise link._lease_error()

    async def _lookup(
        self, input_tokens: torch.Tensor | None, roi: torch.Tensor | None, timeout: float | None, *, what: str,
        on_landing: OnLanding | None = None, into: KVBuffers | None = None, heads: HeadRange | None = None,
        pools: PoolLanding | None = None,
    ) -> KVItem | None:  # fmt: skip
        """drop_select, counted and timed; `on_landing` and `pools` (`in_place`) as for `_Link.call` (one
        producer, no group); `into` checked already; `heads` a checked range (pieces, see
        `drop_select`)."""
        self._check_open()
        query = query_bytes(input_tokens, roi, what=what)
        check_timeout(timeout, what=what)
        plans = None if heads is None else self._piece_plans(heads)

        def build(request_id: int) -> m.Message:
            return m.DropSelect(request_id=request_id, tokens=query, timeout_s=timeout)

        timer = _metrics.Timer("drop_select")
        try:
            if plans is not None:
                item = await self._drop_select_pieces(query, timeout, plans, into=into)
            else:
                item = await self._drop_select(build, waits_s=timeout, on_landing=on_landing, into=into, pools=pools)
        except KVRTError as error:
            self._count_error(error)
            raise
        timer.done()
        self._count(item, waited=timeout != 0)
        return item

    def _piece_plans(self, heads: HeadRange) -> list[PiecePlan]:
        """Which producers hold `heads`, and which of their heads (see `drop_select`)."""
        if self._readers_unknown is not None:
            raise fresh_copy(self._readers_unknown)
        plans = plan_pieces(heads, [link.core.heads for link in self._links], self._readers)
        if self._consensus is not None and len(plans) != len(self._links):
            asked = {plan.link for plan in plans}
            idle = [link.endpoint for index, link in enumerate(self._links) if index not in asked]
            raise InvalidInputError(
                f"heads [{heads.first}, {heads.end}) lie with none of the producers at {idle}: in a TP group each rank "
                "connects only to the producers that hold its heads (their items count it as a reader)"
            )
        return plans

    async def _drop_select_pieces(
        self, query: bytes | None, timeout: float | None, plans: list[PiecePlan], *, into: KVBuffers | None
    ) -> KVItem | None:
        """drop_select of a head range: a piece from each producer in `plans`, joined."""
        if self._consensus is not None:
            return await self._agreed_drop_select(
                lambda: self._take_pieces(query, timeout, plans, into=into), self._consensus, into=into
            )
        taken = await self._take_pieces(query, timeout, plans, into=into)
        if taken is None:
            return None
        if not taken.settle(keep=True):
            raise taken.link._lease_error()
        return self._land_now(taken.item, into, taken.landed_on)

    async def _take_pieces(
        self, query: bytes | None, timeout: float | None, plans: list[PiecePlan], *, into: KVBuffers | None
    ) -> _Taken | None:
        """The pieces of one item from the producers in `plans`, not yet confirmed (the caller
        settles them). All are asked at once; a miss or a failure of one gives the others back
        (the error is raised, a miss is None)."""

        def build_for(plan: PiecePlan) -> Callable[[int], m.Message]:
            return lambda request_id: m.DropSelect(
                request_id=request_id, tokens=query, timeout_s=timeout,
                heads=plan.heads, readers=plan.readers, hidden=plan.hidden,
            )  # fmt: skip

        # One piece lands in `into` as it comes (its link checks it fits); several are joined first.
        landing = _landing(into, copy=False) if len(plans) == 1 else None
        calls = [
            asyncio.create_task(
                self._links[plan.link].call(build_for(plan), confirm=False, waits_s=timeout, into=landing)
            )
            for plan in plans
        ]
        def give_back_delivered() -> None:
            for plan, call in zip(plans, calls, strict=True):
                if call.done() and _delivered(call):
                    reply = call.result()
                    assert isinstance(reply.message, m.Deliver)
                    self._links[plan.link].settle(reply.message.item_id, keep=False)

        settled = False
        try:
            pending = set(calls)
            while pending:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(call.done() and not _delivered(call) for call in calls):
                    break  # a miss or a failure: the others are not needed
            for call in calls:
                call.cancel()  # a call cancelled after its item arrived gives that item back itself
            await asyncio.gather(*calls, return_exceptions=True)
            settled = True
        finally:
            if not settled:  # cancelled: the pieces that came go back, the others give theirs back
                for call in calls:
                    call.cancel()
                    call.add_done_callback(_retrieved)
                give_back_delivered()
        failure = next(
            (call.exception() for call in calls if not call.cancelled() and call.exception() is not None), None
        )
        if failure is not None or not all(_delivered(call) for call in calls):
            give_back_delivered()
            if failure is not None:
                raise failure
            return None
        delivered = [(plan, call.result()) for plan, call in zip(plans, calls, strict=True)]
        items = [reply.item for _, reply in delivered if reply.item is not None]
        if not pieces_agree(items):
            give_back_delivered()  # the producers' oldest items of different requests (a query of None)
            return None
        joined = join_pieces(items)
        if into is not None and len(plans) > 1:
            try:
                check_fit(joined, into, what="drop_select")
            except InvalidInputError:
                give_back_delivered()  # the caller learns that its buffers are wrong; nothing is lost
                raise
        ids = [reply.message.item_id for _, reply in delivered if isinstance(reply.message, m.Deliver)]
        first = plans[0].link
        return _Taken(
            joined, self._links[first], ids[0], first,
            delivered[0][1].landed_on,
            tuple((self._links[plan.link], item_id) for plan, item_id in zip(plans[1:], ids[1:], strict=True)),
        )  # fmt: skip

    def _count(self, item: KVItem | None, *, waited: bool = False) -> None:
        """A lookup answered: its outcome, and an item's counts. `waited`: the call had a
        timeout (a miss then is a lookup that timed out)."""
        miss = _metrics.LookupOutcome.TIMEOUT if waited else _metrics.LookupOutcome.MISS
        self.metrics.looked_up(miss if item is None else _metrics.LookupOutcome.HIT)
        if item is not None:
            self.counters.items += 1
            self.counters.bytes += sum(
                tensor.nbytes for tensor in (item.key, item.value, item.hidden) if tensor is not None
            )

    def _count_error(self, error: KVRTError, lookups: int = 1) -> None:
        self.metrics.looked_up(_metrics.outcome_of_error(error), lookups)
        errors = self.counters.errors
        errors[type(error).__name__] = errors.get(type(error).__name__, 0) + 1

    async def _drop_select(
        self, build: Callable[[int], m.Message], *, waits_s: float | None, on_landing: OnLanding | None = None,
        into: KVBuffers | None = None, pools: PoolLanding | None = None,
    ) -> KVItem | None:  # fmt: skip
        """One drop-select whose producer may wait `waits_s` for a match (None: for ever)."""
        if self._consensus is not None:
            return await self._agreed_drop_select(
                lambda: self._take(build, waits_s=waits_s, into=into), self._consensus, into=into
            )
        if len(self._links) == 1:
            link = self._links[0]
            in_place: InPlace | None = pools
            if into is not None and pools is None:  # the transport may READ into them itself (nixl)
                in_place = BufferLanding(caller_ready(self.device), key=into.key, value=into.value, hidden=into.hidden)
            try:
                reply = await link.call(
                    build, on_landing=on_landing, waits_s=waits_s, into=_landing(into), in_place=in_place
                )
            finally:
                if in_place is not None:  # nothing writes the caller's memory once this returns
                    await in_place.ended()
            return reply.item
        taken = await self._take(build, waits_s=waits_s, into=into)
        if taken is None:
            return None
        if not taken.settle(keep=True):
            raise taken.link._lease_error()
        return self._land_now(taken.item, into, taken.landed_on)

    async def _take(
        self, build: Callable[[int], m.Message], *, waits_s: float | None, into: KVBuffers | None = None
    ) -> _Taken | None:
        """The best item over every producer, not yet confirmed (the caller settles it).

        Every producer is asked at once. Answering at once (`waits` False): the longest match
        wins, ties go to the first endpoint, and the other items are given back. Waiting: the
        first match to arrive wins and the other requests are cancelled. A producer that
        cannot be reached is skipped with a warning; if none can be, its error is raised.
        Each link checks that its item fits `into`; the winner is copied there by the caller.
        An item that does not fit fails the lookup (`InvalidInputError`), at once, and the
        others go back too: the caller learns that its buffers are wrong, not a shorter match.
        """
        waits = waits_s != 0
        landing = _landing(into, copy=False)
        calls = {
            asyncio.create_task(link.call(build, confirm=False, waits_s=waits_s, into=landing)): index
            for index, link in enumerate(self._links)
        }
        try:
            pending = set(calls)
            while pending:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if waits and any(_delivered(call) or _misfit(call) for call in calls if call.done()):
                    break
        finally:
            for call in calls:
                call.cancel()  # a call cancelled after its item arrived gives that item back itself
            await asyncio.gather(*calls, return_exceptions=True)
        taken: list[_Taken] = []
        errors: list[KVRTError] = []
        misfits: list[InvalidInputError] = []
        for call, index in calls.items():
            link = self._links[index]
            if call.cancelled():
                continue
            failure = call.exception()
            if isinstance(failure, InvalidInputError):
                misfits.append(failure)  # a match that does not fit `into`: the caller's to know
            elif isinstance(failure, KVRTError):
                log.warning(
                    "producer at %s skipped for this lookup: %s",
                    link.endpoint,
                    failure,
                    extra={"endpoint": link.endpoint},
                )
                errors.append(failure)
            elif failure is not None:
                raise failure
            elif _delivered(call):
                reply = call.result()
                assert reply.item is not None and isinstance(reply.message, m.Deliver)
                taken.append(_Taken(reply.item, link, reply.message.item_id, index, reply.landed_on))
        if misfits:
            for candidate in taken:
                candidate.settle(keep=False)
            raise misfits[0]
        if not taken:
            if len(errors) == len(self._links):
                raise errors[0]
            return None
        best = max(taken, key=lambda candidate: (candidate.item.matched, -candidate.link_index))
        for candidate in taken:
            if candidate is not best:
                candidate.settle(keep=False)
        return best

    async def _agreed_drop_select(
        self, take: Callable[[], Awaitable[_Taken | None]], consensus: GroupConsensus, *, into: KVBuffers | None = None
    ) -> KVItem | None:
        """drop_select for a TP group: look up locally (`take`), agree with the group, then keep
        the item cut to the agreed length, or give it back to its producer(s)."""
        sequence = consensus.register()
        taken: _Taken | None = None
        error: BaseException | None = None
        try:
            taken = await take()
        except asyncio.CancelledError as cancelled:
            consensus.abandon(sequence, Outcome(status_of(cancelled)))
            raise
        except KVRTError as failure:
            error = failure
            outcome = Outcome(status_of(failure))
        else:
            outcome = Outcome(Status.MISS) if taken is None else Outcome(Status.OK, taken.item.matched)
        item = None if taken is None else taken.item
        keep = False
        try:
            decision = await consensus.decide(sequence, outcome)
            if decision.status is Status.OK:
                assert item is not None and taken is not None
                keep = True
                return self._land_now(truncate(item, decision.matched_tokens), into, taken.landed_on)
            if decision.status is Status.MISS:
                return None
            raise error_for(decision, outcome, error)
        finally:
            if taken is not None and not taken.settle(keep=keep):
                raise taken.link._lease_error()
