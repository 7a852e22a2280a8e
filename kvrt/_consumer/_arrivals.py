"""Arrivals on a link: a delivered item's (or a batch's) bytes received over the transport,
checked against its lease and handed to the call that asked for it. `_Link._handle` calls
`Arrivals.on_deliver` and `on_deliver_many` for each `Deliver` and `DeliverMany`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence

import torch
import zmq

from kvrt import _messages as m
from kvrt._checksum import delivery_checksum
from kvrt._consumer._session import LinkSession, _item_ids, _Reply
from kvrt._devices import translate_torch_error
from kvrt._errors import (
    IntegrityError,
    InvalidInputError,
    ProtocolError,
)
from kvrt._item import KVBuffers, KVItem, Landing, check_fit, land_in
from kvrt.transports._base import ItemTensors

log = logging.getLogger("kvrt.consumer")


class Arrivals:
    """Items arriving on a link, each landed for the call that asked for it."""

    def __init__(self, session: LinkSession) -> None:
        self._session = session

    def on_deliver(
        self, future: asyncio.Future[_Reply] | None, deliver: m.Deliver, payload: Sequence[zmq.Frame]
    ) -> None:
        """Post the item's receive now (arrival order); complete the call when it lands."""
        if self._delivery_damaged(future, deliver.request_id, [deliver]):
            return
        self._session.leases[deliver.item_id] = deliver.lease
        if self._session.receiver is None:
            self._session.release([deliver.item_id])
            return
        if not self._session.lease_holds():
            # Read after the lease ended (this process stalled): its bytes may come from
            # memory that is another consumer's by now, or reused (a GPU transport reads the
            # producer's), so nothing is read.
            self._refuse_unread(future, [deliver.item_id], payload)
            return
        call = self._session.calls.get(deliver.request_id)
        in_place = None if call is None else call.in_place
        try:
            if in_place is not None and future is not None and not future.done():
                arrival = self._session.receiver.receive_in_place(deliver, payload, in_place)
            else:
                arrival = self._session.receiver.receive(deliver, payload)
        except (ProtocolError, IntegrityError) as exc:
            self._session.receiver.refuse(self._session, future, [deliver.item_id], exc)
            return
        on_landing = None if call is None else call.on_landing
        if on_landing is not None and arrival.early is not None and future is not None and not future.done():
            on_landing(deliver, arrival)
        header_at = time.perf_counter()
        if future is not None:
            self._session.answered(deliver.request_id, header_at)
        arriving = arrival.complete
        if arriving.done():
            sessions_lost = self._session.sessions_lost
            self._landed(future, deliver, sessions_lost, arriving, header_at=header_at)  # TCP: already here
        else:
            session = self._session.sessions_lost
            self._session.own_arrival(
                arriving, functools.partial(self._landed, future, deliver, session, header_at=header_at)
            )

    def _landed(
        self, future: asyncio.Future[_Reply] | None, deliver: m.Deliver, session: int,
        arriving: asyncio.Future[ItemTensors], *, header_at: float = 0.0,
    ) -> None:  # fmt: skip
        """An item's receive ended: complete the call, or give the item back with the reason."""
        if arriving.cancelled():
            return  # the link closed; its calls failed already
        if session != self._session.sessions_lost:
            # The link gave the producer up since (a cuda_ipc copy then lands what a dead
            # producer left; a pair's receive fails): the call failed then, and the producer
            # took the item back. What the receive ended with is seen here, and dropped.
            arriving.exception()
            return
        error = arriving.exception()
        if error is not None:
            failure = translate_torch_error(error, what=f"receiving item {deliver.item_id}")
            self._session.give_back(future, [deliver.item_id], failure)
            return
        if future is None or future.done():
            self._session.release([deliver.item_id])
            return
        if not self._session.lease_holds():
            self._session.give_back(future, [deliver.item_id], self._session.lease_error())
            return
        item = KVItem(*arriving.result(), deliver.matched)
        call = self._session.calls.get(deliver.request_id)
        landing = None if call is None else call.into
        buffers = None if landing is None else landing.at(0)
        in_place = None if call is None else call.in_place
        if buffers is not None and not (in_place is not None and in_place.landed):  # else READ there, fitting
            assert landing is not None
            try:
                check_fit(item, buffers, what="drop_select")
            except InvalidInputError as misfit:
                self._session.give_back(future, [deliver.item_id], misfit)
                return
            if landing.copy:
                try:
                    item = land_in(item, buffers)
                except RuntimeError as failure:  # what torch refuses to write, past the checks made up front
                    self._session.give_back(future, [deliver.item_id], unwritable(failure))
                    return
        if self._session.metrics is not None and header_at:
            transport = self._session.receiver.name if self._session.receiver is not None else "unknown"
            self._session.metrics.transferred(transport, time.perf_counter() - header_at, deliver.payload_bytes)
        future.set_result(_Reply(deliver, item, landed_on=self._landing_stream(landing)))

    def on_deliver_many(
        self, future: asyncio.Future[_Reply] | None, batch: m.DeliverMany, payload: Sequence[zmq.Frame]
    ) -> None:
        """Post the receive of a batch's hits now; complete the call when all have landed."""
        if self._delivery_damaged(future, batch.request_id, [hit for hit in batch.hits if hit is not None]):
            return
        for hit in batch.hits:
            if hit is not None:
                self._session.leases[hit.item_id] = hit.lease
        if self._session.receiver is None:
            self._session.release(_item_ids(batch))
            return
        if not self._session.lease_holds():
            self._refuse_unread(future, _item_ids(batch), payload)
            return
        try:
            arriving = self._session.receiver.receive_many(batch, payload)
        except (ProtocolError, IntegrityError) as exc:
            self._session.receiver.refuse(self._session, future, _item_ids(batch), exc)
            return
        if arriving.done():
            self._batch_landed(future, batch, self._session.sessions_lost, arriving)  # TCP: already here
        else:
            session = self._session.sessions_lost
            self._session.own_arrival(arriving, functools.partial(self._batch_landed, future, batch, session))

    def _delivery_damaged(
        self, future: asyncio.Future[_Reply] | None, request_id: int, entries: Sequence[m.Deliver | m.Hit]
    ) -> bool:
        """Whether a delivery's own fields (its ids, lease, match) fail their checksum: then
        nothing in it can be named to the producer (a receipt or a release might name another
        delivery), so nothing is taken; its call fails with `IntegrityError` and a new session
        starts, in which the producer takes back what the old one held, this item with it."""
        for entry in entries:
            item = entry.checksum if entry.checksum is not None else entry.device_checksum
            expected = entry.delivery_checksum
            if item is None or expected is None:
                continue
            if delivery_checksum(request_id, entry.item_id, entry.matched, entry.lease, item) != expected:
                error = IntegrityError(
                    f"a delivery of item {entry.item_id} (request {request_id}) does not match the checksum of "
                    "its ids, lease and match (damaged on the way): nothing was taken, and the producer takes "
                    "it back in a new session"
                )
                self._session.start_afresh(future, error)
                return True
        return False

    def _refuse_unread(
        self, future: asyncio.Future[_Reply] | None, item_ids: list[int], payload: Sequence[zmq.Frame]
    ) -> None:
        """A delivery outside the lease, its bytes not read: the items go back and the call
        fails with `LeaseExpiredError` (over a transport whose bytes were sent apart from the
        message, the pair is then out of step: a new session starts instead; see
        `Receiver.refuse_unread`)."""
        assert self._session.receiver is not None
        self._session.receiver.refuse_unread(self._session, future, item_ids, self._session.lease_error(), payload)

    def _landing_stream(self, landing: Landing | None) -> torch.cuda.Stream | None:
        """The stream an item's landing is ordered on here (see `_Reply.landed_on`), where the
        caller copies it into its buffers later (`landing.copy` False); else None, with no
        query of torch's current stream on every reply."""
        if landing is None or landing.copy or self._session.device.type != "cuda":
            return None
        return torch.cuda.current_stream(self._session.device)

    def _batch_landed(
        self, future: asyncio.Future[_Reply] | None, batch: m.DeliverMany, session: int,
        arriving: asyncio.Future[list[ItemTensors]],
    ) -> None:  # fmt: skip
        if arriving.cancelled():
            return
        if session != self._session.sessions_lost:  # as in `_landed`
            arriving.exception()
            return
        error = arriving.exception()
        if error is not None:
            hit_ids = _item_ids(batch)
            failure = translate_torch_error(error, what=f"receiving {len(hit_ids)} items")
            self._session.give_back(future, hit_ids, failure)
            return
        if future is None or future.done():
            self._session.release(_item_ids(batch))
            return
        if not self._session.lease_holds():
            self._session.release(_item_ids(batch))
            future.set_exception(self._session.lease_error())
            return
        tensors = iter(arriving.result())
        items = [None if hit is None else KVItem(*next(tensors), hit.matched) for hit in batch.hits]
        call = self._session.calls.get(batch.request_id)
        landing = None if call is None else call.into
        if landing is not None:
            try:
                for index, item in enumerate(items):
                    buffers = landing.at(index)
                    if item is not None and buffers is not None:
                        check_fit(item, buffers, what=f"drop_select_many (query {index} of the request)")
            except InvalidInputError as misfit:
                self._session.release(_item_ids(batch))
                future.set_exception(misfit)
                return
            if landing.copy:
                try:
                    items = [_landed_in(item, landing.at(index)) for index, item in enumerate(items)]
                except RuntimeError as failure:
                    self._session.release(_item_ids(batch))
                    future.set_exception(unwritable(failure))
                    return
        future.set_result(_Reply(batch, items=items, landed_on=self._landing_stream(landing)))


def unwritable(failure: RuntimeError) -> InvalidInputError:
    return InvalidInputError(f"the item could not be written into the buffers of into=, so it goes back: {failure}")


def _landed_in(item: KVItem | None, buffers: KVBuffers | None) -> KVItem | None:
    return item if item is None or buffers is None else land_in(item, buffers)
