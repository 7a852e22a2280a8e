"""One lookup answered by several producers: every producer asked at once, the best item kept
and the others given back (`take_best`), or one piece of an item from each producer that holds
some of the heads asked for, joined (`take_pieces`). What is taken is not yet confirmed: the
caller settles it (`Taken.settle`), after its TP group agreed if it has one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvrt import _messages as m
from kvrt._consumer._link import _Link
from kvrt._consumer._session import _Reply
from kvrt._errors import InvalidInputError, KVRTError
from kvrt._heads import PiecePlan, join_pieces, pieces_agree
from kvrt._item import KVBuffers, KVItem, Landing, check_fit

log = logging.getLogger("kvrt.consumer")


@dataclass(frozen=True, slots=True)
class Taken:
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


def landing(buffers: KVBuffers | Sequence[KVBuffers | None] | None, *, copy: bool = True) -> Landing | None:
    """A call's `Landing`, or None where no query has buffers."""
    if buffers is None or (not isinstance(buffers, KVBuffers) and all(entry is None for entry in buffers)):
        return None
    return Landing(buffers, copy=copy)


async def take_best(
    links: Sequence[_Link], build: Callable[[int], m.Message], *, waits_s: float | None, into: KVBuffers | None = None
) -> Taken | None:
    """The best item over every producer, not yet confirmed (the caller settles it).

    Every producer is asked at once. Answering at once (`waits_s` 0): the longest match wins,
    ties go to the first endpoint, and the other items are given back. Waiting: the first
    match to arrive wins and the other requests are cancelled. A producer that cannot be
    reached is skipped with a warning; if none can be, its error is raised. Each link checks
    that its item fits `into`; the winner is copied there by the caller. An item that does not
    fit fails the lookup (`InvalidInputError`), at once, and the others go back too: the caller
    learns that its buffers are wrong, not a shorter match.
    """
    waits = waits_s != 0
    lands = landing(into, copy=False)
    calls = {
        asyncio.create_task(link.call(build, confirm=False, waits_s=waits_s, into=lands)): index
        for index, link in enumerate(links)
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
    taken: list[Taken] = []
    errors: list[KVRTError] = []
    misfits: list[InvalidInputError] = []
    for call, index in calls.items():
        link = links[index]
        if call.cancelled():
            continue
        failure = call.exception()
        if isinstance(failure, InvalidInputError):
            misfits.append(failure)  # a match that does not fit `into`: the caller's to know
        elif isinstance(failure, KVRTError):
            log.warning(
                "producer at %s skipped for this lookup: %s", link.endpoint, failure, extra={"endpoint": link.endpoint}
            )
            errors.append(failure)
        elif failure is not None:
            raise failure
        elif _delivered(call):
            reply = call.result()
            assert reply.item is not None and isinstance(reply.message, m.Deliver)
            taken.append(Taken(reply.item, link, reply.message.item_id, index, reply.landed_on))
    if misfits:
        for candidate in taken:
            candidate.settle(keep=False)
        raise misfits[0]
    if not taken:
        if len(errors) == len(links):
            raise errors[0]
        return None
    best = max(taken, key=lambda candidate: (candidate.item.matched, -candidate.link_index))
    for candidate in taken:
        if candidate is not best:
            candidate.settle(keep=False)
    return best


async def take_pieces(
    links: Sequence[_Link], query: bytes | None, timeout: float | None, plans: list[PiecePlan], *,
    into: KVBuffers | None,
) -> Taken | None:  # fmt: skip
    """The pieces of one item from the producers in `plans`, not yet confirmed (the caller
    settles them). All are asked at once; a miss or a failure of one gives the others back
    (the error is raised, a miss is None)."""

    def build_for(plan: PiecePlan) -> Callable[[int], m.Message]:
        return lambda request_id: m.DropSelect(
            request_id=request_id, tokens=query, timeout_s=timeout,
            heads=plan.heads, readers=plan.readers, hidden=plan.hidden,
        )  # fmt: skip

    # One piece lands in `into` as it comes (its link checks it fits); several are joined first.
    lands = landing(into, copy=False) if len(plans) == 1 else None
    calls = [
        asyncio.create_task(links[plan.link].call(build_for(plan), confirm=False, waits_s=timeout, into=lands))
        for plan in plans
    ]

    def give_back_delivered() -> None:
        for plan, call in zip(plans, calls, strict=True):
            if call.done() and _delivered(call):
                reply = call.result()
                assert isinstance(reply.message, m.Deliver)
                links[plan.link].settle(reply.message.item_id, keep=False)

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
    failure = next((call.exception() for call in calls if not call.cancelled() and call.exception() is not None), None)
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
    return Taken(
        joined, links[first], ids[0], first, delivered[0][1].landed_on,
        tuple((links[plan.link], item_id) for plan, item_id in zip(plans[1:], ids[1:], strict=True)),
    )  # fmt: skip


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
