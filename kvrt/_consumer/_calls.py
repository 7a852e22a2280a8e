"""A link's calls: a request sent to its producer and its answer awaited, with a reply
timeout; what it delivered confirmed (or given back if the caller gave up first). `Calls` is
handed its link's session (`_session`) and records each call there (`PendingCall`), where the
link's task completes it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvrt import _messages as m
from kvrt._consumer._session import LinkSession, OnLanding, PendingCall, _item_ids, _Reply
from kvrt._errors import KVRTTimeoutError
from kvrt._item import Landing
from kvrt._loop_watch import ListeningTimer
from kvrt._streams import PoolWriter
from kvrt.transports._base import InPlace


class Calls:
    """The requests of one link (see the module's docstring)."""

    def __init__(self, session: LinkSession) -> None:
        self._session = session

    async def call(
        self,
        build: Callable[[int], m.Message],
        *,
        confirm: bool = True,
        on_landing: OnLanding | None = None,
        writer: PoolWriter | None = None,
        waits_s: float | None = 0.0,
        into: Landing | None = None,
        in_place: InPlace | None = None,
    ) -> _Reply:
        """Send a request and wait for its answer (or for the link to fail).

        A delivered item is confirmed to the producer when this returns it (unless `confirm`
        is False: then the caller must `settle` it), and given back if the caller is
        cancelled first, so an item is never freed without reaching someone; one that this
        link's lease no longer covers when it is handed over is given back, and the call
        raises `LeaseExpiredError`. `on_landing` is called once the item's receive is posted,
        if the transport hands out its tensors before they land (GPU): a pull queues its
        scatters there. A stream's layers are written by `writer` into the pools, if given.
        `waits_s` is how long the producer may wait before it answers (None: for ever): with
        no answer `reply_timeout_s` after that, the call fails with `KVRTTimeoutError`.
        `into`: the caller's buffers; an item that does not fit them is given back and the
        call raises `InvalidInputError`. `in_place`: the pools of a pull or the buffers of
        `into`, for a transport that lands the item there itself (`Receiver.receive_in_place`).
        """
        session = self._session
        stopped = session.stopped()
        if stopped is not None:
            raise stopped from session.task_failure()
        await session.joining.joined()
        loop = asyncio.get_running_loop()
        request_id, message = session.core.start_request(build, loop.time())
        future: asyncio.Future[_Reply] = loop.create_future()
        asked_at = time.perf_counter() if session.metrics is not None else 0.0
        session.calls[request_id] = PendingCall(future, on_landing, writer, into, in_place, asked_at, waits_s is None)
        overdue = None
        if waits_s is not None:
            # Counted while this side listens: a stall of its own loop is not the producer's.
            overdue = ListeningTimer(loop, waits_s + session.reply_timeout_s, self._reply_overdue, request_id, waits_s)
        try:
            if not session.io.send_nowait([m.encode(message)]):
                await session.io.send([m.encode(message)])
            reply = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                for item_id in _item_ids(future.result().message):
                    session.settle(item_id, keep=False)
            else:
                cancel = session.core.abandon(request_id)
                if cancel is not None:
                    session.sends.nowait(cancel)
            raise
        finally:
            if overdue is not None:
                overdue.cancel()
            del session.calls[request_id]
        if confirm:
            kept = [session.settle(item_id, keep=True, send=False) for item_id in _item_ids(reply.message)]
            session.sends.send_receipts()
            if not all(kept):
                raise session.lease_error()
        return reply

    def _reply_overdue(self, request_id: int, waits_s: float) -> None:
        """A request's answer did not come in time: the call fails; a late answer is a stray."""
        session = self._session
        call = session.calls.get(request_id)
        if call is None or call.future.done() or not session.core.is_pending(request_id):
            return  # answered (its bytes may still be landing: `transfer_timeout_s` has those)
        cancel = session.core.abandon(request_id)
        if cancel is not None:
            session.sends.nowait(cancel)
        overdue = KVRTTimeoutError(
            f"the producer at {session.endpoint} did not answer within {waits_s + session.reply_timeout_s:.3g} s "
            f"(the call let it wait {waits_s:.3g} s, plus reply_timeout_s)",
            phase="reply",
        )
        call.future.set_exception(overdue)
        if session.unread_in_session:
            # Its answer may have been the message that could not be read: a delivery whose
            # item the producer keeps for this session. A new session gives such items back.
            session.new_session(
                KVRTTimeoutError(
                    f"{overdue} after a message from it could not be read; the link started a new session",
                    phase="reply",
                )
            )

