"""A link's session with its producer: the pending calls (one `PendingCall` record each, made
by the link's `Calls`) and their replies, the handshake (join over the transport the welcome names),
leases and receipts (sent by `_sends`), the receives it has posted, and giving the producer
up. `_Link` (in `_link`) holds a session and its task; its calls (`Calls`, there), arrivals
(`_arrivals`) and streams (`_stream_layers`) are handed the session and act through its methods here.
The consumer's lookups call the link's `call` and `settle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import zmq

from kvrt import _messages as m
from kvrt import _metrics
from kvrt._auth import CurveKeys, secure_client
from kvrt._consumer._join import TransportJoin
from kvrt._consumer._sends import OrderedSends
from kvrt._errors import (
    ClosedError,
    IntegrityError,
    KVRTError,
    KVRTTimeoutError,
    LeaseExpiredError,
    RemoteProtocolError,
    fresh_copy,
    translate_zmq_error,
)
from kvrt._item import KVItem, Landing
from kvrt._loop_watch import ListeningTimer
from kvrt._protocol import (
    SILENT_HOLD_LEASES,
    ConsumerCore,
    LinkState,
    Lost,
)
from kvrt._streams import ConsumerStream, PoolWriter
from kvrt._threads import CheckWorkers
from kvrt._zmqio import SocketIO, zmtp_heartbeats
from kvrt.transports import Receiver
from kvrt.transports._base import Arrival, InPlace
from kvrt.transports.cuda_ipc import host_identity

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
    landed_on: torch.cuda.Stream | None = None
    """On a GPU, the stream the item's landing was ordered on (this loop thread's current one):
    a copy of it made elsewhere waits for that stream first."""


_CPU = torch.device("cpu")


_LINK_EVENTS: Final = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
"""What a link learns from its socket's monitor: the connection closed (the producer exited, or
ZeroMQ's own heartbeats, which its I/O thread answers, went unanswered), came back, or was
refused (a CURVE producer's answer to a plain or unknown consumer: see `_Link`)."""


def _item_ids(reply: m.Message) -> list[int]:
    """The items a reply delivered (to confirm, or to give back)."""
    if isinstance(reply, m.Deliver):
        return [reply.item_id]
    if isinstance(reply, m.DeliverMany):
        return [hit.item_id for hit in reply.hits if hit is not None]
    return []


OnLanding = Callable[[m.Deliver, Arrival], None]
"""Called by a link when a request's item starts landing (see `_Link.call`)."""


@dataclass(slots=True)
class PendingCall:
    """One request waiting for its answer, and what its answer needs (see `LinkSession.call`)."""

    future: asyncio.Future[_Reply]
    on_landing: OnLanding | None = None
    writer: PoolWriter | None = None
    """Writes a stream's layers into the caller's pools."""
    into: Landing | None = None
    """Where its items land (`into=`), checked as they arrive."""
    in_place: InPlace | None = None
    """The caller's memory its item lands in, where the transport writes it itself."""
    asked_at: float = 0.0
    """When it left (perf_counter), for the metrics' lookup waits; 0 without metrics."""
    waits_forever: bool = False
    """No reply timeout runs for it (the producer may wait for ever before it answers)."""


def _dealer(
    context: zmq.Context[zmq.Socket[bytes]], core: ConsumerCore, heartbeat_s: float, curve: CurveKeys | None
) -> zmq.Socket[bytes]:
    """A link's socket, not connected yet."""
    socket: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    # One identity for the link's whole life: after a reconnect the producer still knows
    # whose receipts it reads (a new connection would otherwise get a new identity).
    socket.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
    # The producer keeps a stopped consumer's connection (and what it holds) as long as
    # it may keep its items for it.
    zmtp_heartbeats(socket, heartbeat_s, core.timeout_s, core.timeout_s * SILENT_HOLD_LEASES)
    # Replies to its own requests only: never let libzmq stop reading them (an engine whose input
    # is stopped, when its connection fails, trips libzmq's heartbeat timer into an assertion).
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, m.MAX_PAYLOAD_FRAME_BYTES)
    if curve is not None:
        secure_client(socket, curve)
    return socket


class LinkSession:
    """One consumer's session with one producer: calls, leases, the handshake, ordered sends."""

    def __init__(
        self,
        endpoint: str,
        *,
        device: torch.device = _CPU,
        context: zmq.Context[zmq.Socket[bytes]],
        name: str,
        heartbeat_s: float,
        transports: dict[str, Receiver],
        connect_timeout_s: float,
        curve: CurveKeys | None = None,
        transfer_timeout_s: float | None = DEFAULT_TRANSFER_TIMEOUT_S,
        reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S,
        metrics: _metrics.ConsumerMetrics | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.metrics = metrics
        self.curve = curve is not None
        """Whether this side speaks CURVE."""
        self._transfer_timeout_s = transfer_timeout_s
        self.reply_timeout_s = reply_timeout_s
        """How long past what a call lets the producer wait it waits for the answer (`_link.Calls`)."""
        self.device = device
        self.core = ConsumerCore(
            endpoint=endpoint, name=name, heartbeat_s=heartbeat_s, transports=tuple(transports), host=host_identity()
        )
        self.joining = TransportJoin(transports, self.core, endpoint, connect_timeout_s, self.new_session)
        self._arrivals: set[asyncio.Future[Any]] = set()
        """Receives posted and not landed yet (`own_arrival`)."""
        self.checks = CheckWorkers()
        """Where what landed of this producer's GPU streams is checked."""
        self.sessions_lost = 0
        """Counts the times the link gave its producer up: a receive posted before the last of
        them belongs to calls that failed then, whatever it lands."""
        self._socket = _dealer(context, self.core, heartbeat_s, curve)
        self._monitor: zmq.Socket[bytes] | None = self._socket.get_monitor_socket(_LINK_EVENTS)
        self.io = SocketIO(self._socket, self._monitor)
        self.sends = OrderedSends(self.io, self.core, endpoint)
        self.leases: dict[int, int] = {}
        """The lease number of each item delivered and not settled yet."""
        self.open_streams: dict[int, ConsumerStream] = {}
        self.calls: dict[int, PendingCall] = {}
        self.connected = asyncio.Event()
        """Set while the producer is connected (welcomed), cleared when it is lost."""
        self._task: asyncio.Task[None] | None = None
        """The link's task, which reads what the producer sends (see `own_task`)."""
        self.unread_in_session = 0
        """Of those, the ones that did not decode in this session: one may have been an answer
        (a delivery whose header was damaged on the way), whose item the producer keeps for
        this session until it ends."""

    @property
    def transfer_timeout_s(self) -> float | None:
        """How long bytes may take to land once their header came (None: for ever)."""
        return self._transfer_timeout_s

    @property
    def receiver(self) -> Receiver | None:
        return self.joining.receiver  # (None before the first welcome)

    def lease_holds(self) -> bool:
        """Whether an item delivered by this link may be handed to a caller now."""
        return self.core.lease_holds(self._now())

    def lease_error(self) -> LeaseExpiredError:
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
        to the caller's `sends.send_receipts()` (confirmations of one batch, in one message)."""
        lease = self.leases.pop(item_id, 0)
        if keep and self.lease_holds():
            self.sends.receipt(item_id, lease)
            if send:
                self.sends.send_receipts()
            return True
        self.sends.in_order(m.Release(item_id=item_id, lease=lease))
        return not keep

    def connect(self) -> None:
        """Connect the socket to the producer (ZeroMQ then keeps it connected); raises the
        translated error, the socket closed, if the address cannot be used."""
        try:
            self._socket.connect(self.endpoint)
        except zmq.ZMQError as exc:
            self.io.close()
            self._socket.close()
            raise translate_zmq_error(exc, endpoint=self.endpoint) from None

    def stopped(self) -> BaseException | None:
        """Why a call cannot be made any more: `ClosedError` once the link's task stopped."""
        if self._task is not None and self._task.done():
            return ClosedError(f"the link to {self.endpoint} stopped")
        return None

    def task_failure(self) -> BaseException | None:
        """What the link's task failed with, if it did."""
        return None if self._task is None or self._task.cancelled() else self._task.exception()

    def own_task(self, task: asyncio.Task[None]) -> None:
        """The link's task runs for this session: a call fails once it stopped, closing cancels
        it, and an error it did not expect fails every call (`_run_ended`)."""
        self._task = task
        task.add_done_callback(self._run_ended)

    def unreadable(self) -> None:
        """A message from the producer did not decode in this session (see `unread_in_session`)."""
        self.unread_in_session += 1

    async def aclose(self) -> None:
        if self.core.state is not LinkState.CLOSED:
            was_ready = self.core.state is LinkState.READY
            self.fail_all(self.core.close())
            if was_ready:
                # Receipts still waiting for their flush leave before the bye: after it, the
                # producer would put those items back in its buffer and deliver them again.
                self.sends.in_order(m.Bye(reason="consumer closed"))
            await self.sends.sent(within_s=self.core.heartbeat_s)
        owned = [task for task in (self._task, self.joining.task, self.sends.task) if task is not None]
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
        for transport in self.joining.transports.values():
            await transport.aclose()
        self.checks.close()
        self.io.close()
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._socket.close(linger=0)

    def answered(self, request_id: int, now: float) -> None:
        """The producer answered a request (an item's header, or a miss): its lookup wait."""
        call = self.calls.get(request_id)
        if call is not None and call.asked_at and self.metrics is not None:
            self.metrics.lookup_wait.observe(now - call.asked_at)
            call.asked_at = 0.0

    def release(self, item_ids: Sequence[int]) -> None:
        """Give items back to the producer (after every receipt before)."""
        for item_id in item_ids:
            self.sends.in_order(m.Release(item_id=item_id, lease=self.leases.pop(item_id, 0)))

    def give_back(self, future: asyncio.Future[_Reply] | None, item_ids: Sequence[int], error: BaseException) -> None:
        """Delivered items go back (one item, or a batch's hits); their call fails with `error`."""
        if isinstance(error, IntegrityError) and self.metrics is not None:
            self.metrics.integrity_failures += 1
        self.release(item_ids)
        if future is not None and not future.done():
            future.set_exception(error)

    def start_afresh(self, future: asyncio.Future[_Reply] | None, error: KVRTError) -> None:
        """A Deliver this side refused after its bytes were sent out of band: the pair is out
        of step (the next receive would take those bytes). Its call fails with `error`, every
        other pending call too, and a new hello starts a new session: the producer takes back
        what it had sent, and pairs anew."""
        if isinstance(error, IntegrityError) and self.metrics is not None:
            self.metrics.integrity_failures += 1
        if future is not None and not future.done():
            future.set_exception(error)
        restart = RemoteProtocolError(
            f"producer at {self.endpoint} sent a transfer this consumer could not take ({error}); "
            "the link started a new session"
        )
        self.new_session(restart)

    def new_session(self, error: KVRTError) -> None:
        """Give this session up: every pending call fails with `error`, and a hello starts a
        new session, in which the producer takes back what the old one held (and pairs anew)."""
        self.unread_in_session = 0
        lost, hello = self.core.start_afresh(error, self._now())
        self.connected.clear()
        self.fail_all(lost)
        self.sends.in_order(hello)

    def own_arrival(self, arriving: asyncio.Future[Any], landed: Callable[[asyncio.Future[Any]], None]) -> None:
        """Call `landed` when a posted receive ends, from the future's own callback (no task,
        no extra hop of the loop); closing the link cancels it. One that has not landed within
        the transfer timeout gives the producer up (`_transfer_overdue`)."""
        self._arrivals.add(arriving)
        arriving.add_done_callback(self._arrivals.discard)
        arriving.add_done_callback(landed)
        if self._transfer_timeout_s is not None:
            overdue = ListeningTimer(
                asyncio.get_running_loop(), self._transfer_timeout_s, self._transfer_overdue, arriving,
                self.sessions_lost,
            )  # fmt: skip
            arriving.add_done_callback(lambda _: overdue.cancel())

    def _transfer_overdue(self, arriving: asyncio.Future[Any], session: int) -> None:
        """A receive has not landed within the transfer timeout: the producer's GPU never wrote
        the bytes (its loop may still answer heartbeats). The link gives it up as it does a
        silent one: every call fails (this one with a timeout), the transport stops waiting
        (cuda_ipc releases its copies' waits, NCCL aborts the pair), and a new session starts,
        in which the producer takes back what the old one held."""
        if arriving.done() or session != self.sessions_lost or self.core.state is not LinkState.READY:
            return
        error = KVRTTimeoutError(
            f"the producer at {self.endpoint} did not finish a transfer within {self._transfer_timeout_s} s "
            "(its GPU may be stuck); the link started a new session",
            phase="transfer",
        )
        log.warning("%s", error, extra={"endpoint": self.endpoint})
        self.new_session(error)

    # -- helpers --------------------------------------------------------------------------

    def fail_all(self, lost: Lost) -> None:
        """Every call of the link fails: those waiting for their answer (`lost.request_ids`)
        and those whose item is still landing, whose bytes cannot be trusted any more (over
        cuda_ipc, `abandon` lets their copies read whatever a dead producer left). Receipts of
        items already handed over still leave, before any new hello."""
        self.sessions_lost += 1
        self.sends.send_receipts()  # of items already handed over: they must reach the producer all the same
        if self.receiver is not None:
            self.receiver.abandon()
        for stream in self.open_streams.values():
            stream.fail(fresh_copy(lost.error))
        self.open_streams.clear()
        for call in self.calls.values():
            if not call.future.done():
                call.future.set_exception(fresh_copy(lost.error))

    def _run_ended(self, task: asyncio.Task[None]) -> None:
        """The link's task ended by an error it did not expect (a bug): every call and stream
        waiting on it fails now, instead of waiting for an answer nobody will read."""
        if task.cancelled() or task.exception() is None:
            return
        failure = task.exception()
        log.error("the link to %s stopped: %r", self.endpoint, failure, extra={"endpoint": self.endpoint})
        error = ClosedError(f"the link to {self.endpoint} stopped: {type(failure).__name__}: {failure}")
        self.fail_all(Lost(error, tuple(self.calls)))

    def _now(self) -> float:
        return loop_time()


def loop_time() -> float:
    """The loop's clock, which the protocol core is given."""
    return asyncio.get_running_loop().time()
