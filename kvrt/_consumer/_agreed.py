"""Lookups in a TP group: each rank looks up on its own (unconfirmed), the group agrees on one
outcome (`GroupConsensus`: the shortest match, the worst status), and each rank keeps its
item cut to the agreed length, or gives it back. Also a step's lookups in one batch, agreed
together (`agree_batch`). The ranks make their lookups in the same order."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import torch

from kvrt import _messages as m
from kvrt._consensus import GroupConsensus, Outcome, Status, error_for, status_of
from kvrt._consumer._across import Taken, landing
from kvrt._consumer._batch import batch_request, batches, chunks
from kvrt._consumer._link import _Link
from kvrt._errors import KVRTError
from kvrt._heads import PiecePlan
from kvrt._item import KVBuffers, KVItem, truncate

Land = Callable[[KVItem, KVBuffers | None, torch.cuda.Stream | None], KVItem]
"""Copies a kept item into the caller's buffers, if it gave some (`Lookups.land_now`)."""


async def agree_one(
    take: Callable[[], Awaitable[Taken | None]], consensus: GroupConsensus, land: Land, *,
    into: KVBuffers | None = None,
) -> KVItem | None:  # fmt: skip
    """drop_select for a TP group: look up locally (`take`), agree with the group, then keep
    the item cut to the agreed length, or give it back to its producer(s)."""
    sequence = consensus.register()
    taken: Taken | None = None
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
            return land(truncate(item, decision.matched_tokens), into, taken.landed_on)
        if decision.status is Status.MISS:
            return None
        raise error_for(decision, outcome, error)
    finally:
        if taken is not None and not taken.settle(keep=keep):
            raise taken.link.lease_error()


async def agree_batch(
    link: _Link, consensus: GroupConsensus, wire: list[bytes | None], buffers: list[KVBuffers | None], land: Land,
    plan: PiecePlan | None = None,
) -> list[KVItem | None]:  # fmt: skip
    """drop_select_many for a TP group (one producer): take the batch unconfirmed, agree
    its lookups together, then keep each item cut to its agreed length, or give it back.
    A lookup that failed on any rank fails the whole call on every rank, as a failed
    request fails it outside a group."""
    sequences = [consensus.register() for _ in wire]
    taken: list[tuple[KVItem | None, int | None]] = []  # (item, its id) per query
    landed_on: list[torch.cuda.Stream | None] = []
    error: KVRTError | None = None
    try:
        for batch, chunk in zip(batches(wire), chunks(buffers, batches(wire)), strict=True):
            reply = await link.call(batch_request(batch, plan), confirm=False, into=landing(chunk, copy=False))
            assert isinstance(reply.message, m.DeliverMany) and reply.items is not None
            hits = reply.message.hits
            taken += [(item, None if hit is None else hit.item_id) for item, hit in zip(reply.items, hits, strict=True)]
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
                items.append(land(truncate(item, decision.matched_tokens), buffers[index], landed_on[index]))
            else:
                items.append(None)
        return items
    finally:
        settled = [
            link.settle(item_id, keep=keep, send=False)
            for (_, item_id), keep in zip(taken, kept, strict=True)
            if item_id is not None
        ]
        link.sends.send_receipts()
        if not all(settled):
            raise link.lease_error()
