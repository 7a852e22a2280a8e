"""Arrivals on a link: a delivered item's (or a batch's) bytes received over the transport,
checked against its lease and handed to the call that asked for it. `_Link._handle` calls
`_on_deliver` and `_on_deliver_many` for each `Deliver` and `DeliverMany`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import zmq

from kvrt import _messages as m
from kvrt._consumer._session import LinkSession, _item_ids, _Reply
from kvrt._errors import (
    InvalidInputError,
    KVRTTimeoutError,
    ProtocolError,
    translate_torch_error,
)
from kvrt._item import KVBuffers, KVItem, Landing, check_fit, land_in
from kvrt._protocol import (
    LinkState,
)
from kvrt.transports._base import ItemTensors

log = logging.getLogger("kvrt.consumer")


class LinkArrivals(LinkSession):
    """Items arriving on a link, each landed for the call that asked for it."""

    def _on_deliver(
        self, future: asyncio.Future[_Reply] | None, deliver: m.Deliver, payload: Sequence[zmq.Frame]
    ) -> None:
        """Post the item's receive now (arrival order); complete the call when it lands."""
        self._leases[deliver.item_id] = deliver.lease
        if self._transport is None:
            self._release([deliver.item_id])
            return
        if not self.lease_holds():
            # Read after the lease ended (this process stalled): its bytes may come from
            # memory that is another consumer's by now, or reused (a GPU transport reads the
            # producer's), so nothing is read.
            self._refuse_unread(future, [deliver.item_id], payload)
            return
        in_place = self._in_place.get(deliver.request_id)
        try:
            if in_place is not None and future is not None and not future.done():
                arrival = self._transport.receive_in_place(deliver, payload, in_place)
            else:
                arrival = self._transport.receive(deliver, payload)
        except ProtocolError as exc:
            if self._transport.out_of_band:
                self._start_afresh(future, exc)
            else:
                self._give_back(future, deliver, exc)
            return
        on_landing = self._landing.get(deliver.request_id)
        if on_landing is not None and arrival.early is not None and future is not None and not future.done():
            on_landing(deliver, arrival)
        header_at = time.perf_counter()
        if future is not None:
            self._answered(deliver.request_id, header_at)
        arriving = arrival.complete
        if arriving.done():
            self._landed(future, deliver, self._sessions_lost, arriving, header_at=header_at)  # TCP: already here
        else:
            self._own_arrival(
                arriving, functools.partial(self._landed, future, deliver, self._sessions_lost, header_at=header_at)
            )

    def _landed(
        self, future: asyncio.Future[_Reply] | None, deliver: m.Deliver, session: int,
        arriving: asyncio.Future[ItemTensors], *, header_at: float = 0.0,
    ) -> None:  # fmt: skip
        """An item's receive ended: complete the call, or give the item back with the reason."""
        if arriving.cancelled():
            return  # the link closed; its calls failed already
        if session != self._sessions_lost:
            # The link gave the producer up since (a cuda_ipc copy then lands what a dead
            # producer left; a pair's receive fails): the call failed then, and the producer
            # took the item back. What the receive ended with is seen here, and dropped.
            arriving.exception()
            return
        error = arriving.exception()
        if error is not None:
            self._give_back(future, deliver, translate_torch_error(error, what=f"receiving item {deliver.item_id}"))
            return
        if future is None or future.done():
            self._release([deliver.item_id])
            return
        if not self.lease_holds():
            self._give_back(future, deliver, self._lease_error())
            return
        item = KVItem(*arriving.result(), deliver.matched)
        landing = self._into.get(deliver.request_id)
        buffers = None if landing is None else landing.at(0)
        in_place = self._in_place.get(deliver.request_id)
        if buffers is not None and not (in_place is not None and in_place.landed):  # else READ there, fitting
            assert landing is not None
            try:
                check_fit(item, buffers, what="drop_select")
            except InvalidInputError as misfit:
                self._give_back(future, deliver, misfit)
                return
            if landing.copy:
                try:
                    item = land_in(item, buffers)
                except RuntimeError as failure:  # what torch refuses to write, past the checks made up front
                    self._give_back(future, deliver, unwritable(failure))
                    return
        if self._metrics is not None and header_at:
            transport = self._transport.name if self._transport is not None else "unknown"
            self._metrics.transferred(transport, time.perf_counter() - header_at, deliver.payload_bytes)
        future.set_result(_Reply(deliver, item, landed_on=self._landing_stream(landing)))

    def _on_deliver_many(
        self, future: asyncio.Future[_Reply] | None, batch: m.DeliverMany, payload: Sequence[zmq.Frame]
    ) -> None:
        """Post the receive of a batch's hits now; complete the call when all have landed."""
        for hit in batch.hits:
            if hit is not None:
                self._leases[hit.item_id] = hit.lease
        if self._transport is None:
            self._release(_item_ids(batch))
            return
        if not self.lease_holds():
            self._refuse_unread(future, _item_ids(batch), payload)
            return
        try:
            arriving = self._transport.receive_many(batch, payload)
        except ProtocolError as exc:
            if self._transport.out_of_band:
                self._start_afresh(future, exc)
            else:
                self._release(_item_ids(batch))
                if future is not None and not future.done():
                    future.set_exception(exc)
            return
        if arriving.done():
            self._batch_landed(future, batch, self._sessions_lost, arriving)  # TCP: already here
        else:
            self._own_arrival(arriving, functools.partial(self._batch_landed, future, batch, self._sessions_lost))

    def _refuse_unread(
        self, future: asyncio.Future[_Reply] | None, item_ids: list[int], payload: Sequence[zmq.Frame]
    ) -> None:
        """A delivery outside the lease, its bytes not read: the items go back and the call
        fails with `LeaseExpiredError`. Over an out-of-band transport the pair is then out of
        step (its bytes were sent): a new session starts instead."""
        assert self._transport is not None
        if self._transport.out_of_band:
            self._start_afresh(future, self._lease_error())
            return
        self._transport.discard(payload)
        self._release(item_ids)
        if future is not None and not future.done():
            future.set_exception(self._lease_error())

    def _landing_stream(self, landing: Landing | None) -> torch.cuda.Stream | None:
        """The stream an item's landing is ordered on here (see `_Reply.landed_on`), where the
        caller copies it into its buffers later (`landing.copy` False); else None, with no
        query of torch's current stream on every reply."""
        if landing is None or landing.copy or self._device.type != "cuda":
            return None
        return torch.cuda.current_stream(self._device)

    def _own_arrival(self, arriving: asyncio.Future[Any], landed: Callable[[asyncio.Future[Any]], None]) -> None:
        """Call `landed` when a posted receive ends, from the future's own callback (no task,
        no extra hop of the loop); closing the link cancels it. One that has not landed within
        the transfer timeout gives the producer up (`_transfer_overdue`)."""
        self._arrivals.add(arriving)
        arriving.add_done_callback(self._arrivals.discard)
        arriving.add_done_callback(landed)
        if self._transfer_timeout_s is not None:
            overdue = asyncio.get_running_loop().call_later(
                self._transfer_timeout_s, self._transfer_overdue, arriving, self._sessions_lost
            )
            arriving.add_done_callback(lambda _: overdue.cancel())

    def _transfer_overdue(self, arriving: asyncio.Future[Any], session: int) -> None:
        """A receive has not landed within the transfer timeout: the producer's GPU never wrote
        the bytes (its loop may still answer heartbeats). The link gives it up as it does a
        silent one: every call fails (this one with a timeout), the transport stops waiting
        (cuda_ipc releases its copies' waits, NCCL aborts the pair), and a new session starts,
        in which the producer takes back what the old one held."""
        if arriving.done() or session != self._sessions_lost or self.core.state is not LinkState.READY:
            return
        error = KVRTTimeoutError(
            f"the producer at {self.endpoint} did not finish a transfer within {self._transfer_timeout_s} s "
            "(its GPU may be stuck); the link started a new session",
            phase="transfer",
        )
        log.warning("%s", error, extra={"endpoint": self.endpoint})
        self._new_session(error)

    def _batch_landed(
        self, future: asyncio.Future[_Reply] | None, batch: m.DeliverMany, session: int,
        arriving: asyncio.Future[list[ItemTensors]],
    ) -> None:  # fmt: skip
        if arriving.cancelled():
            return
        if session != self._sessions_lost:  # as in `_landed`
            arriving.exception()
            return
        error = arriving.exception()
        if error is not None:
            hit_ids = _item_ids(batch)
            self._release(hit_ids)
            if future is not None and not future.done():
                future.set_exception(translate_torch_error(error, what=f"receiving a batch of {len(hit_ids)} items"))
            return
        if future is None or future.done():
            self._release(_item_ids(batch))
            return
        if not self.lease_holds():
            self._release(_item_ids(batch))
            future.set_exception(self._lease_error())
            return
        tensors = iter(arriving.result())
        items = [None if hit is None else KVItem(*next(tensors), hit.matched) for hit in batch.hits]
        landing = self._into.get(batch.request_id)
        if landing is not None:
            try:
                for index, item in enumerate(items):
                    buffers = landing.at(index)
                    if item is not None and buffers is not None:
                        check_fit(item, buffers, what=f"drop_select_many (query {index} of the request)")
            except InvalidInputError as misfit:
                self._release(_item_ids(batch))
                future.set_exception(misfit)
                return
            if landing.copy:
                try:
                    items = [_landed_in(item, landing.at(index)) for index, item in enumerate(items)]
                except RuntimeError as failure:
                    self._release(_item_ids(batch))
                    future.set_exception(unwritable(failure))
                    return
        future.set_result(_Reply(batch, items=items, landed_on=self._landing_stream(landing)))


def unwritable(failure: RuntimeError) -> InvalidInputError:
    return InvalidInputError(f"the item could not be written into the buffers of into=, so it goes back: {failure}")


def _landed_in(item: KVItem | None, buffers: KVBuffers | None) -> KVItem | None:
    return item if item is None or buffers is None else land_in(item, buffers)
