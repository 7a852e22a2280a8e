"""A link's session with its producer: the pending calls and their replies, the
handshake (join over the transport the welcome names), leases and receipts, the messages
that must leave in order, and giving the producer up. `_Link` (in `_link`) builds on it;
the consumer's lookups call `call` and `settle`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import zmq

from kvrt import _messages as m
from kvrt import _metrics
from kvrt._auth import CurveKeys, secure_client
from kvrt._errors import (
    ClosedError,
    KVRTError,
    KVRTTimeoutError,
    LeaseExpiredError,
    PeerLostError,
    RemoteProtocolError,
    TransportUnavailableError,
    fresh_copy,
)
from kvrt._item import KVItem, Landing
from kvrt._protocol import (
    ConsumerCore,
    LinkState,
    Lost,
)
from kvrt._streams import ConsumerStream, PoolWriter
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
refused."""


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
        self._transport: Receiver | None = None
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
        self._into: dict[int, Landing] = {}
        """Where each pending request's items land (`into=`), checked as they arrive."""
        self._in_place: dict[int, InPlace] = {}
        """The caller's memory a pending call's item lands in, where the transport writes it itself."""
        self._writers: dict[int, PoolWriter] = {}
        self._welcomed = asyncio.Event()
        self.connected = asyncio.Event()
        """Set while the producer is connected (welcomed), cleared when it is lost."""
        self._refused: KVRTError | None = None
        self._task: asyncio.Task[None] | None = None
        self.rejected_frames = 0
        """Messages from the producer dropped because they did not decode or could not be handled."""

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
        if into is not None:
            self._into[request_id] = into
        if in_place is not None:
            self._in_place[request_id] = in_place
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
            self._into.pop(request_id, None)
            self._in_place.pop(request_id, None)
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

    @property
    def receiver(self) -> Receiver | None:
        """The transport the producer and this link agreed on (None before the first welcome)."""
        return self._transport

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

    def _answered(self, request_id: int, now: float) -> None:
        """The producer answered a request (an item's header, or a miss): its lookup wait."""
        asked_at = self._asked_at.pop(request_id, None)
        if asked_at is not None and self._metrics is not None:
            self._metrics.lookup_wait.observe(now - asked_at)

    def _release(self, item_ids: Sequence[int]) -> None:
        for item_id in item_ids:
            self._send_in_order(m.Release(item_id=item_id, lease=self._leases.pop(item_id, 0)))

    def _give_back(self, future: asyncio.Future[_Reply] | None, deliver: m.Deliver, error: BaseException) -> None:
        self._release([deliver.item_id])
        if future is not None and not future.done():
            future.set_exception(error)

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

    async def _join(self, transport: Receiver, rendezvous: dict[str, str]) -> None:
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
