"""The consumer (decode side): one link per producer, and `drop_select`.

A `_Link` is a ZeroMQ DEALER around a `ConsumerCore`. One task per link, owned by the
link, reads frames, feeds the core, resolves the futures of pending calls, pings, and
sends the receipts that let the producer free delivered items. Many calls may be pending
on one link at once; replies are matched to them by request id, in any order.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Self

import torch
import torch.distributed as dist
import zmq

from kvrt import _messages as m
from kvrt import _metrics
from kvrt._arguments import endpoint, seconds, usable_device
from kvrt._auth import CurveKeys, handshake_failure, secure_client
from kvrt._caller_stream import lands_on_caller_stream, on_caller_stream
from kvrt._consensus import GroupConsensus, Outcome, Status, error_for, status_of
from kvrt._errors import (
    ClosedError,
    InvalidInputError,
    KVRTError,
    KVRTTimeoutError,
    LeaseExpiredError,
    PeerLostError,
    ProtocolError,
    RemoteProtocolError,
    TransportUnavailableError,
    fresh_copy,
    translate_torch_error,
    translate_zmq_error,
)
from kvrt._item import KVItem, check_timeout, query_bytes, truncate
from kvrt._pools import PoolTable, checked_indexes, per_token
from kvrt._producer import DEFAULT_HEARTBEAT_S, _heartbeat
from kvrt._protocol import (
    ConsumerCore,
    ConsumerEvent,
    Failed,
    LinkState,
    Lost,
    PayloadCame,
    Refused,
    Replied,
    Stray,
    Streamed,
    Welcomed,
)
from kvrt._service import AsyncService
from kvrt._streams import ConsumerStream, Placement, PoolWriter, StreamAbortedError
from kvrt._tensors import layer_chunks, transfer_segments, unpack
from kvrt._threads import gpu_worker, outcome_seen
from kvrt._zmqio import SocketIO, zmtp_heartbeats
from kvrt.transports import Transport
from kvrt.transports._base import Arrival, ItemTensors
from kvrt.transports.cuda_ipc import host_identity
from kvrt.transports.select import make_transports, transport_preference

log = logging.getLogger("kvrt.consumer")

DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_REPLY_TIMEOUT_S = 1.0
"""How long past what a call lets the producer wait (its `timeout`) the consumer waits for the
producer's answer: a call with `timeout=t` has its answer, or `KVRTTimeoutError`, within
`t + reply_timeout_s` whatever the producer does (an item's bytes then have
`transfer_timeout_s` to land)."""
DEFAULT_TRANSFER_TIMEOUT_S = 60.0
"""How long a posted receive may take to land (GPU transports) before the link gives its
producer up: a producer whose loop answers heartbeats while its GPU never writes the bytes
(a hung kernel or collective in its engine) would otherwise hold the call, and every later
transfer of the pair, for ever."""


@dataclass(frozen=True, slots=True)
class _Reply:
    message: m.Message
    item: KVItem | None = None
    stream: ConsumerStream | None = None
    items: list[KVItem | None] | None = None
    """A DeliverMany's: one per query, None for a miss."""


_CPU = torch.device("cpu")


def _delivered(call: asyncio.Task[_Reply]) -> bool:
    """A finished call that brought an item."""
    return not call.cancelled() and call.exception() is None and call.result().item is not None


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


def _batch_request(queries: list[bytes | None]) -> Callable[[int], m.Message]:
    return lambda request_id: m.DropSelectMany(request_id=request_id, queries=queries)


_LINK_EVENTS: Final = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
"""What a link learns from its socket's monitor: the connection closed (the producer exited, or
ZeroMQ's own heartbeats, which its I/O thread answers, went unanswered), came back, or was
refused."""


def _seconds(value: object, name: str) -> float:
    checked = seconds(value, name)
    assert checked is not None
    return checked


def _item_ids(reply: m.Message) -> list[int]:
    """The items a reply delivered (to confirm, or to give back)."""
    if isinstance(reply, m.Deliver):
        return [reply.item_id]
    if isinstance(reply, m.DeliverMany):
        return [hit.item_id for hit in reply.hits if hit is not None]
    return []


OnLanding = Callable[[m.Deliver, Arrival], None]
"""Called by a link when a request's item starts landing (see `_Link.call`)."""


def _pass_outcome(into: asyncio.Future[None], task: asyncio.Task[None]) -> None:
    if into.done():
        return
    if task.cancelled():
        into.cancel()
    elif (error := task.exception()) is not None:
        into.set_exception(error)
    else:
        into.set_result(None)


async def _raise(error: BaseException) -> None:
    raise error


class _Link:
    """One consumer's connection to one producer."""

    def __init__(
        self,
        endpoint: str,
        *,
        device: torch.device = _CPU,
        context: zmq.Context[zmq.Socket[bytes]],
        name: str,
        heartbeat_s: float,
        transports: dict[str, Transport],
        connect_timeout_s: float,
        curve: CurveKeys | None = None,
        transfer_timeout_s: float | None = DEFAULT_TRANSFER_TIMEOUT_S,
        reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S,
        metrics: _metrics.ConsumerMetrics | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._metrics = metrics
        self._asked_at: dict[int, float] = {}
        """When each pending request left (perf_counter), for `metrics`' lookup waits."""
        self._transfer_timeout_s = transfer_timeout_s
        self._reply_timeout_s = reply_timeout_s
        self._device = device
        self.core = ConsumerCore(
            endpoint=endpoint, name=name, heartbeat_s=heartbeat_s, transports=tuple(transports), host=host_identity()
        )
        self._transports = transports
        self._transport: Transport | None = None
        self._connect_timeout_s = connect_timeout_s
        self._join_task: asyncio.Task[None] | None = None
        self._rejoin: asyncio.Future[None] | None = None
        """Set while a join that fell back waits for the next welcome's join."""
        self._arrivals: set[asyncio.Future[Any]] = set()
        self._sessions_lost = 0
        """Counts the times the link gave its producer up: a receive posted before the last of
        them belongs to calls that failed then, whatever it lands."""
        self._socket: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # One identity for the link's whole life: after a reconnect the producer still knows
        # whose receipts it reads (a new connection would otherwise get a new identity).
        self._socket.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        zmtp_heartbeats(self._socket, heartbeat_s, self.core.timeout_s)
        # Replies to its own requests only: never let libzmq stop reading them (an engine whose input
        # is stopped, when its connection fails, trips libzmq's heartbeat timer into an assertion).
        self._socket.setsockopt(zmq.RCVHWM, 0)
        if curve is not None:
            secure_client(self._socket, curve)
        self._monitor: zmq.Socket[bytes] | None = self._socket.get_monitor_socket(_LINK_EVENTS)
        self._io = SocketIO(self._socket, self._monitor)
        self._receipts: list[tuple[int, int]] = []
        """(item id, lease) of items handed over, to confirm in the next `Received`."""
        self._leases: dict[int, int] = {}
        """The lease number of each item delivered and not settled yet."""
        self._in_order: collections.deque[bytes] = collections.deque()
        """Messages that must reach the producer in this order (receipts, releases, hello, bye)
        and that a full send queue refused: `_in_order_sender` sends them once it has room."""
        self._in_order_sender: asyncio.Task[None] | None = None
        self._streams: dict[int, ConsumerStream] = {}
        self._pending: dict[int, asyncio.Future[_Reply]] = {}
        self._landing: dict[int, OnLanding] = {}
        self._writers: dict[int, PoolWriter] = {}
        self._welcomed = asyncio.Event()
        self.connected = asyncio.Event()
        """Set while the producer is connected (welcomed), cleared when it is lost."""
        self._refused: KVRTError | None = None
        self._task: asyncio.Task[None] | None = None
        self.rejected_frames = 0
        """Messages from the producer dropped because they did not decode or could not be handled."""

    async def start(self) -> None:
        connect_timeout_s = self._connect_timeout_s
        try:
            self._socket.connect(self.endpoint)
        except zmq.ZMQError as exc:
            self._io.close()
            self._socket.close()
            raise translate_zmq_error(exc, endpoint=self.endpoint) from None
        self._send_in_order(self.core.connect(self._now()))
        self._task = asyncio.create_task(self._run(), name=f"kvrt-link-{self.endpoint}")
        self._task.add_done_callback(self._run_ended)
        try:
            async with asyncio.timeout(connect_timeout_s):
                await self._welcomed.wait()
                if self._refused is not None:
                    raise self._refused
                await self._joined()
        except KVRTError:
            await self.aclose()
            raise
        except TimeoutError:
            await self.aclose()
            raise KVRTTimeoutError(
                f"no producer answered at {self.endpoint} within {connect_timeout_s} s: "
                "is it running, and is the address right?",
                phase="connect",
            ) from None

    async def call(
        self,
        build: Callable[[int], m.Message],
        *,
        confirm: bool = True,
        on_landing: OnLanding | None = None,
        writer: PoolWriter | None = None,
        waits_s: float | None = 0.0,
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
        """
        if self._task is not None and self._task.done():
            raise ClosedError(f"the link to {self.endpoint} stopped") from self._task_failure()
        await self._joined()
        loop = asyncio.get_running_loop()
        request_id, message = self.core.start_request(build, loop.time())
        future: asyncio.Future[_Reply] = loop.create_future()
        self._pending[request_id] = future
        if on_landing is not None:
            self._landing[request_id] = on_landing
        if writer is not None:
            self._writers[request_id] = writer
        if self._metrics is not None:
            self._asked_at[request_id] = time.perf_counter()
        overdue = None
        if waits_s is not None:
            overdue = loop.call_later(waits_s + self._reply_timeout_s, self._reply_overdue, request_id, waits_s)
        try:
            if not self._io.send_nowait([m.encode(message)]):
                await self._io.send([m.encode(message)])
            reply = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                for item_id in _item_ids(future.result().message):
                    self.settle(item_id, keep=False)
            else:
                cancel = self.core.abandon(request_id)
                if cancel is not None:
                    self._send_nowait(cancel)
            raise
        finally:
            if overdue is not None:
                overdue.cancel()
            self._pending.pop(request_id, None)
            self._landing.pop(request_id, None)
            self._writers.pop(request_id, None)
            self._asked_at.pop(request_id, None)
        if confirm:
            kept = [self.settle(item_id, keep=True, send=False) for item_id in _item_ids(reply.message)]
            self._send_receipts()
            if not all(kept):
                raise self._lease_error()
        return reply

    def _reply_overdue(self, request_id: int, waits_s: float) -> None:
        """A request's answer did not come in time: the call fails; a late answer is a stray."""
        future = self._pending.get(request_id)
        if future is None or future.done() or not self.core.is_pending(request_id):
            return  # answered (its bytes may still be landing: `transfer_timeout_s` has those)
        cancel = self.core.abandon(request_id)
        if cancel is not None:
            self._send_nowait(cancel)
        future.set_exception(
            KVRTTimeoutError(
                f"the producer at {self.endpoint} did not answer within {waits_s + self._reply_timeout_s:.3g} s "
                f"(the call let it wait {waits_s:.3g} s, plus reply_timeout_s)",
                phase="reply",
            )
        )

    def lease_holds(self) -> bool:
        """Whether an item delivered by this link may be handed to a caller now."""
        return self.core.lease_holds(self._now())

    def _lease_error(self) -> LeaseExpiredError:
        return LeaseExpiredError(
            f"the producer at {self.endpoint} answered nothing for {self.core.lease_s:.1f} s (this process, or "
            "the producer, was stalled), so the item it delivered may be another consumer's now: it was given "
            "back, not handed over"
        )

    def settle(self, item_id: int, *, keep: bool, send: bool = True) -> bool:
        """Confirm (keep) or give back an item delivered to a call made with confirm=False.
        Keeping it outside the lease gives it back instead and returns False: the caller must
        not hand it over (`LeaseExpiredError`).

        The receipt leaves at once, before the caller has the item: a caller that holds the
        loop next (a forward pass, a GC pause) for longer than the lease would otherwise keep
        it here while the producer gives the item to another consumer. `send` False leaves it
        to the caller's `_send_receipts` (confirmations of one batch, in one message)."""
        lease = self._leases.pop(item_id, 0)
        if keep and self.lease_holds():
            self._receipts.append((item_id, lease))
            if send:
                self._send_receipts()
            return True
        self._send_in_order(m.Release(item_id=item_id, lease=lease))
        return not keep

    async def aclose(self) -> None:
        if self.core.state is not LinkState.CLOSED:
            was_ready = self.core.state is LinkState.READY
            self._fail_all(self.core.close())
            if was_ready:
                # Receipts still waiting for their flush leave before the bye: after it, the
                # producer would put those items back in its buffer and deliver them again.
                self._send_in_order(m.Bye(reason="consumer closed"))
            await self._in_order_sent()
        owned = [task for task in (self._task, self._join_task, self._in_order_sender) if task is not None]
        for task in owned:
            task.cancel()
        for arriving in list(self._arrivals):
            arriving.cancel()
        for task in owned:
            if task.done() and not task.cancelled():
                task.exception()  # an error of its own was reported where it ended: not raised again
                continue
            with contextlib.suppress(asyncio.CancelledError, KVRTError):
                await task
        for transport in self._transports.values():
            await transport.aclose()
        self._io.close()
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._socket.close(linger=0)

    # -- the link's task ------------------------------------------------------------------

    async def _run(self) -> None:
        core = self.core
        io = self._io
        while True:
            first = await io.next(core.next_deadline())
            now = self._now()
            if first is not None:
                for frames in [first, *io.drain()]:
                    self._frame(frames, now)
            for event, _ in io.monitor_events():
                self._connection_event(event, now)
            due, lost = core.expire(now)
            if lost is not None:
                self.connected.clear()
                log.warning("%s", lost.error, extra={"endpoint": self.endpoint})
                self._fail_all(lost)
            for message in due:
                if isinstance(message, m.Hello):
                    self._send_in_order(message)
                else:
                    self._send_nowait(message)
            if first is not None and self._io.drained_a_full_batch:
                await asyncio.sleep(0)  # a yield once a full batch (see `Producer._serve`)

    def _frame(self, frames: list[zmq.Frame], now: float) -> None:
        """One message from the producer. One that does not decode is dropped and counted; one
        that this side fails on ends the session (see below); the link goes on either way."""
        try:
            event = self.core.receive(frames[0].buffer, now)
            if event is not None:
                self._handle(event, frames[1:])
        except ProtocolError as exc:
            self.rejected_frames += 1
            log.warning("ignoring a message: %s", exc, extra={"endpoint": self.endpoint})
        except Exception as exc:
            # A bug, or a case nobody foresaw: this session's state cannot be trusted (a call may
            # wait for a reply that was just lost). Its calls fail now and a new session starts,
            # in which the producer takes back what it had sent: nothing hangs, nothing is lost.
            self.rejected_frames += 1
            log.exception("a message from the producer could not be handled", extra={"endpoint": self.endpoint})
            self._new_session(
                KVRTError(
                    f"a message from the producer at {self.endpoint} could not be handled "
                    f"({type(exc).__name__}: {exc}); the link started a new session"
                )
            )

    def _connection_event(self, event: int, now: float) -> None:
        """What the socket's monitor saw (see `_LINK_EVENTS`)."""
        if event == zmq.EVENT_DISCONNECTED:
            lost = self.core.disconnected("it exited, or stopped answering ZeroMQ heartbeats")
            if lost is not None:
                self.connected.clear()
                log.warning("%s", lost.error, extra={"endpoint": self.endpoint})
                self._fail_all(lost)
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            hello = self.core.reconnected(now)
            if hello is not None:
                self._send_in_order(hello)
        elif not self._welcomed.is_set():  # a handshake refused before any welcome: start() raises it
            self._refused = handshake_failure(event, self.endpoint)
            self._welcomed.set()

    def _handle(self, event: ConsumerEvent, payload: Sequence[zmq.Frame]) -> None:
        match event:
            case Welcomed(welcome=welcome):
                self._start_join(welcome)
                self._welcomed.set()
                self.connected.set()
            case Replied(request_id=request_id, message=m.Deliver() as deliver):
                self._on_deliver(self._pending.get(request_id), deliver, payload)
            case Replied(request_id=request_id, message=m.DeliverMany() as batch):
                self._on_deliver_many(self._pending.get(request_id), batch, payload)
            case Replied(request_id=request_id, message=m.StreamStart() as start):
                self._on_stream_start(self._pending.get(request_id), start, payload)
            case Streamed(message=message):
                self._on_streamed(message, payload)
            case PayloadCame(message=message):
                if self._transport is not None:
                    self._transport.payload(message, payload)
            case Replied(request_id=request_id, message=message):
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    self._answered(request_id, time.perf_counter())
                    future.set_result(_Reply(message))
            case Failed(request_id=request_id, error=error):
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    future.set_exception(error)
            case Stray(message=stray):
                # Its bytes are on their way already (an out-of-band transport's send is
                # posted): they are received all the same, then the items are given back, or
                # the next receive on the pair would take them for other items'.
                if isinstance(stray, m.DeliverMany):
                    self._on_deliver_many(None, stray, payload)
                elif isinstance(stray, m.StreamStart):
                    self._on_stream_start(None, stray, payload)  # gives it back
                else:
                    self._on_deliver(None, stray, payload)
            case Lost():
                self.connected.clear()
                self._fail_all(event)
            case Refused(error=error):
                if self._welcomed.is_set():
                    log.warning("%s", error)
                else:  # the hello itself was refused: start() raises it
                    self._refused = error
                    self._welcomed.set()

    def _on_deliver(
        self, future: asyncio.Future[_Reply] | None, deliver: m.Deliver, payload: Sequence[zmq.Frame]
    ) -> None:
        """Post the item's receive now (arrival order); complete the call when it lands."""
        self._leases[deliver.item_id] = deliver.lease
        if self._transport is None:
            self._release([deliver.item_id])
            return
        if self._transport.out_of_band and not self.lease_holds():
            # Its bytes may come from memory that is another consumer's by now: not read.
            self._start_afresh(future, self._lease_error())
            return
        try:
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

    def _answered(self, request_id: int, now: float) -> None:
        """The producer answered a request (an item's header, or a miss): its lookup wait."""
        asked_at = self._asked_at.pop(request_id, None)
        if asked_at is not None and self._metrics is not None:
            self._metrics.lookup_wait.observe(now - asked_at)

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
        input_tokens, roi, key, value, hidden = arriving.result()
        if self._metrics is not None and header_at:
            transport = self._transport.name if self._transport is not None else "unknown"
            self._metrics.transferred(transport, time.perf_counter() - header_at, deliver.payload_bytes)
        future.set_result(_Reply(deliver, KVItem(input_tokens, roi, key, value, hidden, deliver.matched)))

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
        if self._transport.out_of_band and not self.lease_holds():
            self._start_afresh(future, self._lease_error())
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
        future.set_result(_Reply(batch, items=items))

    def _release(self, item_ids: Sequence[int]) -> None:
        for item_id in item_ids:
            self._send_in_order(m.Release(item_id=item_id, lease=self._leases.pop(item_id, 0)))

    def _give_back(self, future: asyncio.Future[_Reply] | None, deliver: m.Deliver, error: BaseException) -> None:
        self._release([deliver.item_id])
        if future is not None and not future.done():
            future.set_exception(error)

    def _on_stream_start(
        self, future: asyncio.Future[_Reply] | None, start: m.StreamStart, payload: Sequence[zmq.Frame]
    ) -> None:
        self._leases[start.item_id] = start.lease
        try:
            if len(payload) != 1 or payload[0].buffer.nbytes != start.payload_bytes:
                raise RemoteProtocolError("stream_start needs one payload frame of payload_bytes")
            input_tokens, roi = unpack((start.input_tokens, start.roi), payload[0].buffer)
            assert input_tokens is not None
        except ProtocolError as exc:
            self._release([start.item_id])
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is None or future.done():
            self._release([start.item_id])
            return
        if not self.lease_holds():
            self._release([start.item_id])
            future.set_exception(self._lease_error())
            return
        writer = self._writers.get(start.request_id)
        if writer is not None and start.layers != writer.placement.pools.layers:
            self._release([start.item_id])
            future.set_exception(
                InvalidInputError(f"the stream has {start.layers} layers, the pools {writer.placement.pools.layers}")
            )
            return

        def confirm() -> KVRTError | None:
            self._streams.pop(start.item_id, None)
            return None if self.settle(start.item_id, keep=True) else self._lease_error()

        stream = ConsumerStream(input_tokens, roi, start.matched, start.layers, confirm, writer)
        self._streams[start.item_id] = stream
        future.set_result(_Reply(start, stream=stream))

    def _on_streamed(self, message: m.StreamLayer | m.StreamEnd | m.StreamAbort, payload: Sequence[zmq.Frame]) -> None:
        stream = self._streams.get(message.item_id)
        transport = self._transport
        out_of_band = transport is not None and transport.out_of_band
        by_transport = transport is not None and transport.streams_tensors
        if stream is not None and not self.lease_holds():  # the stream may be another reader's by now
            self._stream_lost(message.item_id, self._lease_error())
            stream = None
        if stream is None:  # a stream this side gave back
            if out_of_band and transport is not None:
                self._receive_stray(transport, message, payload)
            elif transport is not None:
                transport.discard(payload)
            return
        try:
            match message:
                case m.StreamLayer(layer=layer, key=key_meta, value=value_meta):
                    if by_transport:
                        assert transport is not None
                        self._receive_layer(stream, message.item_id, transport, layer, key_meta, value_meta, payload)
                        return
                    if len(payload) != 2:
                        raise RemoteProtocolError(f"stream_layer needs 2 frames, {len(payload)} came")
                    (key,) = unpack([key_meta], payload[0].buffer)
                    (value,) = unpack([value_meta], payload[1].buffer)
                    assert key is not None and value is not None
                    self._deliver_layer(stream, message.item_id, layer, key.to(self._device), value.to(self._device))
                case m.StreamEnd(hidden=hidden_meta):
                    if by_transport:
                        assert transport is not None
                        self._receive_end(stream, message.item_id, transport, hidden_meta, payload)
                        return
                    hidden = None
                    if hidden_meta is not None:
                        (hidden,) = unpack([hidden_meta], payload[0].buffer)
                        hidden = None if hidden is None else hidden.to(self._device)
                    stream.finish(hidden)
                case m.StreamAbort(reason=reason):
                    self._streams.pop(message.item_id, None)
                    self._leases.pop(message.item_id, None)
                    stream.fail(StreamAbortedError(f"producer at {self.endpoint} aborted the stream: {reason}"))
        except (ProtocolError, IndexError) as exc:
            self._streams.pop(message.item_id, None)
            error = exc if isinstance(exc, ProtocolError) else RemoteProtocolError(str(exc))
            stream.fail(error)
            if out_of_band:  # its bytes are on the way: the pair is out of step
                self._start_afresh(None, error)
            else:
                self._release([message.item_id])

    def _receive_layer(
        self, stream: ConsumerStream, item_id: int, transport: Transport, layer: int,
        key_meta: m.TensorMeta, value_meta: m.TensorMeta, payload: Sequence[zmq.Frame],
    ) -> None:  # fmt: skip
        """Post a streamed layer's receive (out of band). On a GPU the reader gets it at once,
        with the event of its landing; on CPU (gloo) once it landed."""
        if not 0 <= layer < stream.layers:
            raise RemoteProtocolError(f"stream_layer {layer} of a stream of {stream.layers}")
        arrival = transport.receive_tensors((key_meta, value_meta), payload)
        stream.arriving = arrival.complete
        if arrival.landed is not None:
            key, value = arrival.tensors
            self._deliver_layer(stream, item_id, layer, key, value, arrival.landed)

        def landed(arriving: asyncio.Future[list[torch.Tensor]]) -> None:
            error = None if arriving.cancelled() else arriving.exception()
            if error is not None:
                self._stream_lost(item_id, translate_torch_error(error, what=f"receiving layer {layer} of a stream"))
            elif not arriving.cancelled() and arrival.landed is None:
                key, value = arriving.result()
                self._deliver_layer(stream, item_id, layer, key, value)

        self._own_arrival(arrival.complete, landed)

    def _deliver_layer(
        self, stream: ConsumerStream, item_id: int, layer: int, key: torch.Tensor, value: torch.Tensor,
        landed: torch.cuda.Event | None = None,
    ) -> None:  # fmt: skip
        """Hand a layer to its reader (GPU: with the event of its landing); a reader of the pools
        gets it once its write there is queued, with the event after the write."""
        writer = stream.writer
        if writer is None:
            stream.deliver_layer(layer, key, value, landed)
            return
        stream.writing(layer)
        written = writer.write(layer, key, value, landed)

        def delivered(written: asyncio.Future[torch.cuda.Event | None]) -> None:
            if written.cancelled():
                return  # the link closed; its streams failed already
            error = written.exception()
            if error is not None:
                self._stream_lost(item_id, translate_torch_error(error, what=f"writing layer {layer} into the pools"))
            else:
                stream.deliver_layer(layer, key, value, written.result())

        self._own_arrival(written, delivered)

    def _receive_end(
        self, stream: ConsumerStream, item_id: int, transport: Transport,
        hidden_meta: m.TensorMeta | None, payload: Sequence[zmq.Frame],
    ) -> None:  # fmt: skip
        """A stream's end (out of band): it finishes once everything posted for it landed,
        the hidden states last."""
        if hidden_meta is not None:
            stream.arriving = transport.receive_tensors((hidden_meta,), payload).complete
        elif payload:
            raise RemoteProtocolError(f"a {transport.name} stream_end carries no frames, {len(payload)} came")
        last = stream.arriving

        def landed(arriving: asyncio.Future[list[torch.Tensor]] | None) -> None:
            if arriving is not None and arriving.cancelled():
                return
            error = None if arriving is None else arriving.exception()
            if error is not None:
                self._stream_lost(item_id, translate_torch_error(error, what=f"receiving the end of stream {item_id}"))
                return
            stream.finish(None if hidden_meta is None or arriving is None else arriving.result()[0])

        if last is None or last.done():
            landed(last)
        elif hidden_meta is not None:
            self._own_arrival(last, landed)
        else:
            last.add_done_callback(landed)  # owned already: it is a layer's

    def _receive_stray(
        self, transport: Transport, message: m.StreamLayer | m.StreamEnd | m.StreamAbort, payload: Sequence[zmq.Frame]
    ) -> None:
        """The tensors of a stream this side gave back are on their way all the same (out of
        band): they are received and dropped, or the next receive on the pair would take them."""
        metas: tuple[m.TensorMeta, ...]
        match message:
            case m.StreamLayer(key=key_meta, value=value_meta):
                metas = (key_meta, value_meta)
            case m.StreamEnd(hidden=hidden_meta) if hidden_meta is not None:
                metas = (hidden_meta,)
            case _:
                return
        try:
            self._own_arrival(transport.receive_tensors(metas, payload).complete, outcome_seen)
        except ProtocolError as exc:
            self._start_afresh(None, exc)

    def _stream_lost(self, item_id: int, error: KVRTError) -> None:
        """A stream's receive failed: it fails, and its item goes back to the producer."""
        stream = self._streams.pop(item_id, None)
        if stream is not None:
            self._release([item_id])
            stream.fail(error)

    def _start_afresh(self, future: asyncio.Future[_Reply] | None, error: KVRTError) -> None:
        """A Deliver this side refused after its bytes were sent out of band: the pair is out
        of step (the next receive would take those bytes). Its call fails with `error`, every
        other pending call too, and a new hello starts a new session: the producer takes back
        what it had sent, and pairs anew."""
        if future is not None and not future.done():
            future.set_exception(error)
        restart = RemoteProtocolError(
            f"producer at {self.endpoint} sent a transfer this consumer could not take ({error}); "
            "the link started a new session"
        )
        self._new_session(restart)

    def _new_session(self, error: KVRTError) -> None:
        """Give this session up: every pending call fails with `error`, and a hello starts a
        new session, in which the producer takes back what the old one held (and pairs anew)."""
        lost, hello = self.core.start_afresh(error, self._now())
        self.connected.clear()
        self._fail_all(lost)
        self._send_in_order(hello)

    def _start_join(self, welcome: m.Welcome) -> None:
        """Join the transport the producer chose, in a task the link owns (the link keeps
        answering heartbeats meanwhile); requests wait for it in `_joined`."""
        transport = self._transports.get(welcome.transport)
        log.info("the producer's items travel over %s", welcome.transport,
                 extra={"endpoint": self.endpoint, "transport": welcome.transport})  # fmt: skip
        rejoin, self._rejoin = self._rejoin, None
        if self._join_task is not None and rejoin is None:
            self._join_task.cancel()
        self._transport = transport
        if transport is None:
            error = RemoteProtocolError(f"producer chose transport {welcome.transport!r}, which was not offered")
            task = asyncio.create_task(_raise(error))
        else:
            task = asyncio.create_task(self._join(transport, welcome.rendezvous))
        self._join_task = task
        if rejoin is not None:  # the join that fell back (and who waits on it) ends with this one
            task.add_done_callback(functools.partial(_pass_outcome, rejoin))

    async def _join(self, transport: Transport, rendezvous: dict[str, str]) -> None:
        """Join `transport`; where it cannot work with this producer (`cuda_ipc` between
        processes that cannot share memory) and another was offered, say so and start a new
        session without it, ending only once that one joined."""
        try:
            await transport.join(rendezvous, self._connect_timeout_s)
        except TransportUnavailableError as exc:
            remaining = tuple(name for name in self.core.transports if name != transport.name)
            if not remaining:
                raise
            log.warning("%s; the items of the producer at %s travel over %s instead", exc, self.endpoint, remaining[0],
                        extra={"endpoint": self.endpoint, "transport": transport.name})  # fmt: skip
            self.core.transports = remaining
            self._rejoin = asyncio.get_running_loop().create_future()
            self._new_session(exc)
            await self._rejoin

    async def _joined(self) -> None:
        task = self._join_task
        if task is None:
            return
        try:
            await asyncio.shield(task)
        except KVRTError as exc:
            raise PeerLostError(f"could not join the producer's {self.core.transport} transport: {exc}") from exc

    # -- helpers --------------------------------------------------------------------------

    def _send_receipts(self) -> None:
        """One Received for every item confirmed since the last one, in order with the
        messages that must follow it. A receipt is never dropped for want of room (the
        producer would give its item to another consumer once this one's lease ends)."""
        while self._receipts:
            batch = self._receipts[: m.MAX_RECEIPTS]
            del self._receipts[: m.MAX_RECEIPTS]
            item_ids = [item_id for item_id, _ in batch]
            self._queue_in_order(m.Received(item_ids=item_ids, leases=[lease for _, lease in batch]))
            self.core.receipts_sent(batch)

    def _send_in_order(self, message: m.Message) -> None:
        """Send `message` after every receipt and in-order message before it (a release, a
        hello, a bye): a hello or bye that overtook a receipt would make the producer take
        that item back, and give it to someone else."""
        self._send_receipts()
        self._queue_in_order(message)

    def _queue_in_order(self, message: m.Message) -> None:
        self._in_order.append(m.encode(message))
        if self._in_order_sender is not None and not self._in_order_sender.done():
            return  # it sends this one too, in order
        try:
            while self._in_order and self._io.send_nowait([self._in_order[0]]):
                self._in_order.popleft()
        except zmq.ZMQError as exc:  # the socket is closing: the link is going away
            log.debug("could not send to %s: %s", self.endpoint, exc)
            self._in_order.clear()
            return
        if self._in_order:
            self._in_order_sender = asyncio.create_task(
                self._send_in_order_with_room(), name=f"kvrt-in-order-{self.endpoint}"
            )

    async def _send_in_order_with_room(self) -> None:
        """The in-order messages a full send queue refused, each sent as soon as it has room."""
        while self._in_order:
            await self._io.send([self._in_order[0]])
            self._in_order.popleft()

    async def _in_order_sent(self) -> None:
        """Closing: the in-order messages left waiting, given a heartbeat to leave (else the
        producer takes their items back once the lease ends, and may deliver them again)."""
        sender = self._in_order_sender
        if sender is None or sender.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(sender), self.core.heartbeat_s)
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("closing with %d messages unsent to %s (%r): their items may be delivered again",
                        len(self._in_order), self.endpoint, exc, extra={"endpoint": self.endpoint})  # fmt: skip

    def _send_nowait(self, message: m.Message) -> None:
        """Queue a small message without awaiting (receipts, cancels, pings, bye).

        If the queue is full or the socket closed, the message is dropped: the producer's
        heartbeat timeout then returns whatever it would have released or confirmed.
        """
        try:
            sent = self._io.send_nowait([m.encode(message)])
        except zmq.ZMQError as exc:
            sent = False
            log.debug("could not send %s to %s: %s", type(message).__name__, self.endpoint, exc)
        if not sent:
            log.debug("dropped %s to %s: send queue full", type(message).__name__, self.endpoint)

    def _fail_all(self, lost: Lost) -> None:
        """Every call of the link fails: those waiting for their answer (`lost.request_ids`)
        and those whose item is still landing, whose bytes cannot be trusted any more (over
        cuda_ipc, `abandon` lets their copies read whatever a dead producer left). Receipts of
        items already handed over still leave, before any new hello."""
        self._sessions_lost += 1
        self._send_receipts()  # of items already handed over: they must reach the producer all the same
        if self._transport is not None:
            self._transport.abandon()
        for stream in self._streams.values():
            stream.fail(fresh_copy(lost.error))
        self._streams.clear()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(fresh_copy(lost.error))

    def _run_ended(self, task: asyncio.Task[None]) -> None:
        """The link's task ended by an error it did not expect (a bug): every call and stream
        waiting on it fails now, instead of waiting for an answer nobody will read."""
        if task.cancelled() or task.exception() is None:
            return
        failure = task.exception()
        log.error("the link to %s stopped: %r", self.endpoint, failure, extra={"endpoint": self.endpoint})
        error = ClosedError(f"the link to {self.endpoint} stopped: {type(failure).__name__}: {failure}")
        self._fail_all(Lost(error, tuple(self._pending)))

    def _task_failure(self) -> BaseException | None:
        if self._task is None or self._task.cancelled():
            return None
        return self._task.exception()

    def _now(self) -> float:
        return asyncio.get_running_loop().time()


@dataclass(slots=True)
class ConsumerCounters:
    """What a consumer received and what failed, since start (for stats and metrics)."""

    items: int = 0
    bytes: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Taken:
    """An item delivered by one link and not yet confirmed to its producer."""

    item: KVItem
    link: _Link
    item_id: int
    link_index: int

    def settle(self, *, keep: bool) -> bool:
        """As `_Link.settle`: False if it was to be kept but the link's lease had ended."""
        return self.link.settle(self.item_id, keep=keep)


class Consumer(AsyncService):
    """Takes buffered KV from a producer (decode side).

        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            item = await consumer.drop_select(input_tokens, roi, timeout=0.0)

    Items arrive on `device`. Many `drop_select` calls may be in flight at once. Closing
    ends every pending call with `ClosedError`.

    `transfer_timeout_s`: how long an item's (or a stream layer's) bytes may take to land once
    its header came, on a GPU transport, before the link gives the producer up as if it had
    gone silent (the calls fail, with `KVRTTimeoutError` for the late one, and a new session
    starts): a producer whose GPU hangs while its loop still answers heartbeats. A stream's
    layer counts from its header, sent when the prefill queues the layer: keep it above the
    longest prefill a reader waits through. None waits for ever.

    `group`: the torch.distributed process group of a decode TP group, one consumer per
    rank. Every rank then returns the same outcome for each lookup (the shortest match,
    the worst status), agreed by one all_reduce; lookups must be made in the same order on
    every rank. An item that the group does not take goes back to its producer.
    """

    def __init__(
        self,
        connect: str | Sequence[str],
        device: torch.device | str = "cpu",
        *,
        group: dist.ProcessGroup | None = None,
        transport: str | None = None,
        curve: CurveKeys | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        transfer_timeout_s: float | None = DEFAULT_TRANSFER_TIMEOUT_S,
        reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S,
        name: str | None = None,
    ) -> None:
        endpoints = [connect] if isinstance(connect, str) else list(connect) if isinstance(connect, Sequence) else []
        if not endpoints:
            raise InvalidInputError(
                f"connect must be a ZeroMQ address such as 'tcp://host:port', or a list of them; got {connect!r}"
            )
        endpoints = [endpoint(address, "connect", binding=False) for address in endpoints]
        heartbeat_s = _heartbeat(heartbeat_s)
        connect_timeout_s = _seconds(connect_timeout_s, "connect_timeout_s")
        reply_timeout_s = _seconds(reply_timeout_s, "reply_timeout_s")
        transfer_timeout_s = seconds(transfer_timeout_s, "transfer_timeout_s", none=True)
        if curve is not None and not isinstance(curve, CurveKeys):
            raise InvalidInputError(f"curve must be None or kvrt.CurveKeys, got {type(curve).__name__}")
        self._reply_timeout_s = reply_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self.device = usable_device(device)
        self._endpoints = endpoints
        self._transport_names = transport_preference(transport, self.device)
        self._curve = curve
        self._name = name or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._heartbeat_s = heartbeat_s
        self._connect_timeout_s = connect_timeout_s
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._links: list[_Link] = []
        self._group = group
        self._consensus: GroupConsensus | None = None
        self._pull_stream: torch.cuda.Stream | None = None
        """Where pulls scatter what lands (GPU): the caller's stream waits only for the writes."""
        self._scatters: concurrent.futures.ThreadPoolExecutor | None = None
        """Queues a pull's scatters, in order, off the loop (see `pull`)."""
        self.counters = ConsumerCounters()
        self.metrics = _metrics.ConsumerMetrics()
        """Lookups by outcome, lookup waits and transfers (see `kvrt._metrics`)."""
        self._closed = False

    async def start(self) -> Self:
        """Connect and handshake with the producer; returns once it answered."""
        if self._context is not None or self._closed:
            raise ClosedError("a consumer starts once; create a new one")
        self._context = zmq.Context()
        _metrics.track_consumer(self)
        try:
            if self._group is not None:
                self._consensus = GroupConsensus(self._group)
                self._consensus.start()
            for endpoint in self._endpoints:
                link = _Link(
                    endpoint,
                    device=self.device,
                    context=self._context,
                    name=self._name,
                    heartbeat_s=self._heartbeat_s,
                    transports=make_transports(self._transport_names, self.device, store_host=""),
                    connect_timeout_s=self._connect_timeout_s,
                    curve=self._curve,
                    transfer_timeout_s=self._transfer_timeout_s,
                    reply_timeout_s=self._reply_timeout_s,
                    metrics=self.metrics,
                )
                self._links.append(link)
                await link.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        """End every pending call with `ClosedError`, say Bye, and stop."""
        if self._closed:
            return
        self._closed = True
        if self._consensus is not None:
            await self._consensus.aclose()
        for link in self._links:
            await link.aclose()
        if self._scatters is not None:
            self._scatters.shutdown(wait=False)  # queued scatters still run: they only enqueue GPU work
        if self._context is not None:
            self._context.term()

    @property
    def name(self) -> str:
        """This consumer's name, as its producers and its metrics (`consumer` label) know it."""
        return self._name

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    @property
    def transports(self) -> dict[str, str | None]:
        """Per producer endpoint, the transport its items travel over ("nccl", "gloo", "tcp"),
        as the producer chose it from what both offer; None until it answered."""
        return {link.endpoint: link.core.transport for link in self._links}

    @property
    def pending_requests(self) -> int:
        return sum(link.core.pending_count for link in self._links)

    def link_for_tests(self, index: int = 0) -> _Link:
        """The link to the `index`-th producer of `connect` (the only one by default): a hook
        for tests that watch or steer one link's protocol core, socket or transport. Not part
        of the serving API, and what a link holds may change between versions."""
        return self._links[index]

    @lands_on_caller_stream
    async def drop_select(
        self,
        input_tokens: torch.Tensor | None,
        roi: torch.Tensor | None = None,
        timeout: float | None = 0.0,
        *,
        stream: torch.cuda.Stream | None = None,
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
        after this returns reads the item as it landed.
        """
        return await self._lookup(input_tokens, roi, timeout, what="drop_select")

    @lands_on_caller_stream
    async def drop_select_many(
        self,
        queries: Sequence[torch.Tensor | None],
        rois: Sequence[torch.Tensor | None] | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
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
        after the other.
        """
        self._check_open()
        what = "drop_select_many"
        if not isinstance(queries, Sequence):
            raise InvalidInputError(
                f"{what}: queries must be a sequence of token tensors (or None), got {type(queries)}"
            )
        if rois is not None and len(rois) != len(queries):
            raise InvalidInputError(f"{what}: {len(rois)} rois for {len(queries)} queries")
        lookups = list(zip(queries, rois or [None] * len(queries), strict=True))
        wire = [query_bytes(tokens, roi, what=what) for tokens, roi in lookups]
        if len(self._links) != 1:
            # One after the other: a query sees the items the one before it gave back.
            return [await self._lookup(tokens, roi, 0.0, what=what) for tokens, roi in lookups]
        timer = _metrics.Timer(what)
        try:
            if self._consensus is not None:
                items = await self._agreed_drop_select_many(wire, self._consensus)
            else:
                calls = [self._links[0].call(_batch_request(batch)) for batch in _batches(wire)]
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

    async def _agreed_drop_select_many(
        self, wire: list[bytes | None], consensus: GroupConsensus
    ) -> list[KVItem | None]:
        """drop_select_many for a TP group (one producer): take the batch unconfirmed, agree
        its lookups together, then keep each item cut to its agreed length, or give it back.
        A lookup that failed on any rank fails the whole call on every rank, as a failed
        request fails it outside a group."""
        link = self._links[0]
        sequences = [consensus.register() for _ in wire]
        taken: list[tuple[KVItem | None, int | None]] = []  # (item, its id) per query
        error: KVRTError | None = None
        try:
            for batch in _batches(wire):
                reply = await link.call(_batch_request(batch), confirm=False)
                assert isinstance(reply.message, m.DeliverMany) and reply.items is not None
                hits = reply.message.hits
                taken += [
                    (item, None if hit is None else hit.item_id) for item, hit in zip(reply.items, hits, strict=True)
                ]
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
                    items.append(truncate(item, decision.matched_tokens))
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
        on_landing: OnLanding | None = None,
    ) -> KVItem | None:  # fmt: skip
        """drop_select, counted and timed; `on_landing` as for `_Link.call` (one producer, no group)."""
        self._check_open()
        query = query_bytes(input_tokens, roi, what=what)
        check_timeout(timeout, what=what)

        def build(request_id: int) -> m.Message:
            return m.DropSelect(request_id=request_id, tokens=query, timeout_s=timeout)

        timer = _metrics.Timer("drop_select")
        try:
            item = await self._drop_select(build, waits_s=timeout, on_landing=on_landing)
        except KVRTError as error:
            self._count_error(error)
            raise
        timer.done()
        self._count(item, waited=timeout != 0)
        return item

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
        self, build: Callable[[int], m.Message], *, waits_s: float | None, on_landing: OnLanding | None = None
    ) -> KVItem | None:
        """One drop-select whose producer may wait `waits_s` for a match (None: for ever)."""
        if self._consensus is not None:
            return await self._agreed_drop_select(build, self._consensus, waits_s=waits_s)
        if len(self._links) == 1:
            return (await self._links[0].call(build, on_landing=on_landing, waits_s=waits_s)).item
        taken = await self._take(build, waits_s=waits_s)
        if taken is None:
            return None
        if not taken.settle(keep=True):
            raise taken.link._lease_error()
        return taken.item

    async def _take(self, build: Callable[[int], m.Message], *, waits_s: float | None) -> _Taken | None:
        """The best item over every producer, not yet confirmed (the caller settles it).

        Every producer is asked at once. Answering at once (`waits` False): the longest match
        wins, ties go to the first endpoint, and the other items are given back. Waiting: the
        first match to arrive wins and the other requests are cancelled. A producer that
        cannot be reached is skipped with a warning; if none can be, its error is raised.
        """
        waits = waits_s != 0
        calls = {
            asyncio.create_task(link.call(build, confirm=False, waits_s=waits_s)): index
            for index, link in enumerate(self._links)
        }
        try:
            pending = set(calls)
            while pending:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if waits and any(_delivered(call) for call in calls if call.done()):
                    break
        finally:
            for call in calls:
                call.cancel()  # a call cancelled after its item arrived gives that item back itself
            await asyncio.gather(*calls, return_exceptions=True)
        taken: list[_Taken] = []
        errors: list[KVRTError] = []
        for call, index in calls.items():
            link = self._links[index]
            if call.cancelled():
                continue
            failure = call.exception()
            if isinstance(failure, KVRTError):
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
                taken.append(_Taken(reply.item, link, reply.message.item_id, index))
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
        self, build: Callable[[int], m.Message], consensus: GroupConsensus, *, waits_s: float | None
    ) -> KVItem | None:
        """drop_select for a TP group: look up locally, agree with the group, then keep the
        item cut to the agreed length, or give it back to its producer."""
        sequence = consensus.register()
        taken: _Taken | None = None
        error: BaseException | None = None
        try:
            taken = await self._take(build, waits_s=waits_s)
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
                assert item is not None
                keep = True
                return truncate(item, decision.matched_tokens)
            if decision.status is Status.MISS:
                return None
            raise error_for(decision, outcome, error)
        finally:
            if taken is not None and not taken.settle(keep=keep):
                raise taken.link._lease_error()

    @on_caller_stream
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
    ) -> ConsumerStream | None:
        """Take a request's KV layer by layer (see `kvrt._streams`): a prefill still running, or a
        finished item. Matching, `timeout` and the result are as for drop_select; the stream's
        layers are awaited with `layer(i)` or `async for`. None on a miss.

        With `into` (and `slots`, `replica`, as for `pull`) each layer is written into those
        pools as it lands, at the slots, for as many tokens as both have; `layer(i)` returns
        once layer i is written (on a GPU: once the write is queued, with the caller's stream
        made to wait for it). Slots out of range are refused before anything is taken. The
        writes wait, on the GPU, for `stream` (None: the caller's current stream) as it was
        when this was called: the work that wrote the slots there."""
        self._check_open()
        if len(self._links) != 1 or self._consensus is not None:
            raise InvalidInputError("streams need a consumer of one producer, without group= (not supported yet)")
        query = query_bytes(input_tokens, roi, what="open_stream")
        check_timeout(timeout, what="open_stream")
        writer = None if into is None and slots is None else self._pool_writer(into, slots, replica)
        reply = await self._links[0].call(
            lambda request_id: m.DropSelect(request_id=request_id, tokens=query, timeout_s=timeout, stream=True),
            confirm=False,
            writer=writer,
            waits_s=timeout,
        )
        return reply.stream

    def _pool_writer(
        self, into: PoolTable | None, slots: torch.Tensor | None, replica: torch.Tensor | int
    ) -> PoolWriter:
        if into is None or slots is None:
            raise InvalidInputError("a stream into the pools needs both into= and slots=")
        if into.device != self.device:
            raise InvalidInputError(f"the pools are on {into.device}, this consumer is on {self.device}")
        replicas, slots = checked_indexes(into, per_token(replica, slots), slots)
        indexes_ready = None
        if self.device.type == "cuda":
            indexes_ready = torch.cuda.Event()
            indexes_ready.record(torch.cuda.current_stream(self.device))
        return PoolWriter(Placement(into, replicas, slots), self._scatter_thread, self._scatter_stream, indexes_ready)

    @lands_on_caller_stream
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
    ) -> KVItem | None:
        """Take a published prefill (matched as `drop_select` matches) and write its KV into
        the caller's pools `into`: the item's token i lands at `slots[i]` of replica `replica`
        (or `replica[i]`), for as many tokens as both have. Returns the item (None on a miss,
        and then nothing is written); `timeout` is as in `drop_select`.

        `into` must be on this consumer's device; `slots` and `replica` are 1-D int32 or int64
        tensors on its device or on the host. Raises `InvalidInputError` for pools on another
        device or slots and replicas outside them (before any item is taken), and the errors of
        `drop_select`.

        Memory: the pools are the caller's; kvrt writes only the given slots. On a GPU, with one
        producer and no group, the scatter is pipelined with the transfer: each chunk of layers
        is scattered (on a stream of the consumer's own) as soon as it has landed. Work the
        caller queues on `stream` (None: the calling thread's current stream) after this
        returns sees the whole request in the pools, also after a pull that failed or was
        cancelled midway (the slots then hold a partial request, and no defined bytes where a
        producer died before writing them)."""
        if into.device != self.device:
            raise InvalidInputError(f"the pools are on {into.device}, this consumer is on {self.device}")
        from kvrt.kernels.paged_kv import scatter_from_any  # Triton: only when pools are used

        # Bad slots are refused before any item is taken.
        replicas, slots = checked_indexes(into, per_token(replica, slots), slots)
        if self.device.type == "cuda" and len(self._links) == 1 and self._consensus is None:
            item, scattered = await self._pull_pipelined(input_tokens, roi, timeout, into, slots, replicas)
        else:
            item, scattered = await self._lookup(input_tokens, roi, timeout, what="pull"), False
        if item is not None and not scattered:
            count = min(item.key.shape[1], slots.numel())
            # Straight from the item as it arrived (its K and V are views of the received
            # payload): no staging copy.
            scatter_from_any(into, item.key, item.value, replicas[:count], slots[:count])
        return item

    async def _pull_pipelined(
        self, input_tokens: torch.Tensor, roi: torch.Tensor | None, timeout: float | None, into: PoolTable,
        slots: torch.Tensor, replicas: torch.Tensor,
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
            stream = self._scatter_stream()
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
            queued.append(self._scatter_thread().submit(queue_scatters, deliver, key, value, arrival.landed))

        try:
            item = await self._lookup(input_tokens, roi, timeout, what="pull", on_landing=scatter_as_it_lands)
        finally:
            for job in queued:  # the caller's later work on these slots comes after the writes
                # Queued long before the last byte landed, as a rule: then no wrapping future
                # and its hops of the loop (three, after the item itself completed).
                done: torch.cuda.Event = job.result() if job.done() else await asyncio.shield(asyncio.wrap_future(job))
                caller.wait_event(done)
        return item, bool(queued)

    def _scatter_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._scatters is None:
            self._scatters = gpu_worker(self.device, "kvrt-scatter")
        return self._scatters

    def _scatter_stream(self) -> torch.cuda.Stream:
        if self._pull_stream is None:
            self._pull_stream = torch.cuda.Stream(self.device)
        return self._pull_stream

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the consumer is closed")
        if self._context is None:
            raise ClosedError("the consumer is not started: use `async with` or `await start()`")
