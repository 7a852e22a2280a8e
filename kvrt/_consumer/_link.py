"""A link to one producer: a ZeroMQ DEALER around a `ConsumerCore`, in two halves handed the
link's session (`_session`: pending calls, leases, the handshake, ordered sends).

* Its calls (`Calls`): a request sent, its answer awaited with a reply timeout, what it
  delivered confirmed (or given back if the caller gave up first). Each call is recorded in
  the session (`PendingCall`), where the link's task completes it.
* Its task (`_Link`), one per link, owned by the link: reads frames, feeds the core, and hands
  each event to the session or to the parts that take what arrives, the arrivals (`_arrivals`)
  and the streams' layers (`_stream_layers`); it pings and sends the receipts that let the
  producer free delivered items.

Many calls may be pending on one link at once; replies are matched to them by request id, in
any order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import zmq

from kvrt import _messages as m
from kvrt._auth import handshake_failure
from kvrt._consumer._arrivals import Arrivals
from kvrt._consumer._session import LinkSession, OnLanding, PendingCall, _item_ids, _Reply, loop_time
from kvrt._consumer._stream_layers import StreamLayers
from kvrt._errors import (
    KVRTError,
    KVRTTimeoutError,
    ProtocolError,
    RemoteProtocolError,
    VersionMismatchError,
)
from kvrt._item import Landing
from kvrt._loop_watch import ListeningTimer, fail_after_listening
from kvrt._protocol import (
    ConsumerEvent,
    Failed,
    Lost,
    PayloadCame,
    Refused,
    Replied,
    Stray,
    Streamed,
    Welcomed,
)
from kvrt._streams import PoolWriter
from kvrt.transports import Receiver
from kvrt.transports._base import InPlace
from kvrt.transports.tcp import TcpReceiver

log = logging.getLogger("kvrt.consumer")


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


class _Link:
    """One consumer's connection to one producer: its session, the parts it hands the session
    to (`arrivals`, `layers`), and the task that hands what comes to them. What other parts of
    the consumer call on a link (`call`, `settle`, `lease_error`, ...) is its session's."""

    def __init__(self, session: LinkSession) -> None:
        self.session = session
        self.endpoint = session.endpoint
        self.core = session.core
        self.joining = session.joining
        self.sends = session.sends
        self.connected = session.connected
        self.call = Calls(session).call
        self.lease_error = session.lease_error
        self.aclose = session.aclose
        self.arrivals = Arrivals(session)
        self.layers = StreamLayers(session)
        self._welcomed = asyncio.Event()
        self._refused: KVRTError | None = None
        self._closed_in_handshake = 0
        """Connections the producer closed inside the handshake before it welcomed this side."""
        self.rejected_frames = 0
        """Messages from the producer dropped because they did not decode or could not be handled."""

    @property
    def receiver(self) -> Receiver | None:
        return self.session.receiver

    def lease_holds(self) -> bool:
        return self.session.lease_holds()

    def settle(self, item_id: int, *, keep: bool, send: bool = True) -> bool:
        return self.session.settle(item_id, keep=keep, send=send)

    async def start(self) -> None:
        connect_timeout_s = self.joining.connect_timeout_s
        self.session.connect()
        self.sends.in_order(self.core.connect(loop_time()))
        self.session.own_task(asyncio.create_task(self._run(), name=f"kvrt-link-{self.endpoint}"))
        try:
            # Counted while this side listens: a stall of its own loop past the deadline is
            # not the producer's, whose welcome may sit unread (a decode's first load of a
            # producer, on a host whose cores are all busy).
            with fail_after_listening(connect_timeout_s):
                await self._welcomed.wait()
                if self._refused is not None:
                    raise self._refused
                await self.joining.joined()
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

    # -- the link's task ------------------------------------------------------------------

    async def _run(self) -> None:
        core, session = self.core, self.session
        io = session.io
        while True:
            first = await io.next(core.next_deadline())
            now = loop_time()
            if first is not None:
                for frames in [first, *io.drain()]:
                    self._frame(frames, now)
            for event, _ in io.monitor_events():
                self._connection_event(event, now)
            due, lost = core.expire(now)
            if lost is not None:
                self.connected.clear()
                log.warning("%s", lost.error, extra={"endpoint": self.endpoint})
                session.fail_all(lost)
            for message in due:
                if isinstance(message, m.Hello):
                    self.sends.in_order(message)
                else:
                    self.sends.nowait(message)
            if first is not None and io.drained_a_full_batch:
                await asyncio.sleep(0)  # a yield once a full batch (see `Producer._serve`)

    def _frame(self, frames: list[zmq.Frame], now: float) -> None:
        """One message from the producer. One that does not decode is dropped and counted (if
        it was an answer damaged on the way, its call's reply timeout starts a new session:
        see `_reply_overdue`; a call with no timeout has none, so then a new session starts at
        once); one that this side fails on ends the session (see below); the link goes on
        either way."""
        try:
            event = self.core.receive(frames[0].buffer, now)
            if event is not None:
                self._handle(event, frames[1:])
        except ProtocolError as exc:
            self.rejected_frames += 1
            self.session.unreadable()
            if not self._welcomed.is_set():  # the answer to the hello: start() raises why it cannot be read
                self._refused = unreadable_welcome(exc, self.endpoint)
                self._welcomed.set()
                return
            log.warning("ignoring a message: %s", exc, extra={"endpoint": self.endpoint})
            if self._may_answer_a_call_with_no_deadline(frames[0].buffer):
                # No reply timeout would ever end that call (nor a stream's wait for its end),
                # and the producer keeps what it answered with for this session: a new session
                # gives it back.
                self.session.new_session(
                    RemoteProtocolError(
                        f"a message from the producer at {self.endpoint} could not be read ({exc}); it may have "
                        "answered a call, or been a stream's layer or end, that waits with no timeout: the link "
                        "started a new session"
                    )
                )
        except Exception as exc:
            # A bug, or a case nobody foresaw: this session's state cannot be trusted (a call may
            # wait for a reply that was just lost). Its calls fail now and a new session starts,
            # in which the producer takes back what it had sent: nothing hangs, nothing is lost.
            self.rejected_frames += 1
            log.exception("a message from the producer could not be handled", extra={"endpoint": self.endpoint})
            self.session.new_session(
                KVRTError(
                    f"a message from the producer at {self.endpoint} could not be handled "
                    f"({type(exc).__name__}: {exc}); the link started a new session"
                )
            )

    def _may_answer_a_call_with_no_deadline(self, frame: memoryview) -> bool:
        """Whether an unreadable message may be the answer to a pending call that waits for
        ever: the call its request id names, if that can be read, else any such call, or a
        message of an open stream (whose reader waits for its end with no timeout)."""
        request_id = m.peek_request_id(frame) if frame.nbytes <= m.MAX_HEADER_BYTES else None
        calls = self.session.calls
        if request_id is not None:
            call = calls.get(request_id)
            return call is not None and call.waits_forever
        return bool(self.session.open_streams) or any(call.waits_forever for call in calls.values())

    def _connection_event(self, event: int, now: float) -> None:
        """What the socket's monitor saw (see `_LINK_EVENTS`)."""
        if event == zmq.EVENT_DISCONNECTED:
            lost = self.core.disconnected("it exited, or stopped answering ZeroMQ heartbeats")
            if lost is not None:
                self.connected.clear()
                log.warning("%s", lost.error, extra={"endpoint": self.endpoint})
                self.session.fail_all(lost)
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            hello = self.core.reconnected(now)
            if hello is not None:
                self.sends.in_order(hello)
        elif not self._welcomed.is_set():  # a handshake refused before any welcome: start() raises it
            if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and not self.session.curve:
                # Closed inside the handshake: a producer exiting or starting (killed,
                # restarted) does so once, and ZeroMQ connects again; a CURVE producer does so
                # each time (where it was faster than this side to see the mechanisms differ).
                self._closed_in_handshake += 1
                if self._closed_in_handshake < 2:
                    return
            self._refused = handshake_failure(event, self.endpoint)
            self._welcomed.set()

    def _handle(self, event: ConsumerEvent, payload: Sequence[zmq.Frame]) -> None:
        match event:
            case Welcomed(welcome=welcome):
                self.joining.start(welcome)
                self._welcomed.set()
                self.connected.set()
            case Replied(request_id=request_id, message=m.Deliver() as deliver):
                self.arrivals.on_deliver(self._future(request_id), deliver, payload)
            case Replied(request_id=request_id, message=m.DeliverMany() as batch):
                self.arrivals.on_deliver_many(self._future(request_id), batch, payload)
            case Replied(request_id=request_id, message=m.StreamStart() as start):
                self.layers.on_stream_start(self._future(request_id), start, payload)
            case Streamed(message=message):
                self.layers.on_streamed(message, payload)
            case PayloadCame(message=message):
                receiver = self.receiver
                if isinstance(receiver, TcpReceiver):  # only TCP sends a delivery's bytes apart
                    receiver.payload(message, payload)
                elif receiver is not None:
                    raise RemoteProtocolError(f"a {receiver.name} producer sends no payload messages")
            case Replied(request_id=request_id, message=message):
                future = self._future(request_id)
                if future is not None and not future.done():
                    self.session.answered(request_id, time.perf_counter())
                    future.set_result(_Reply(message))
            case Failed(request_id=request_id, error=error):
                future = self._future(request_id)
                if future is not None and not future.done():
                    future.set_exception(error)
            case Stray(message=stray):
                # Its bytes are on their way already (an out-of-band transport's send is
                # posted): they are received all the same, then the items are given back, or
                # the next receive on the pair would take them for other items'.
                if isinstance(stray, m.DeliverMany):
                    self.arrivals.on_deliver_many(None, stray, payload)
                elif isinstance(stray, m.StreamStart):
                    self.layers.on_stream_start(None, stray, payload)  # gives it back
                else:
                    self.arrivals.on_deliver(None, stray, payload)
            case Lost():
                self.connected.clear()
                self.session.fail_all(event)
            case Refused(error=error):
                if self._welcomed.is_set():
                    log.warning("%s", error)
                else:  # the hello itself was refused: start() raises it
                    self._refused = error
                    self._welcomed.set()

    def _future(self, request_id: int) -> asyncio.Future[_Reply] | None:
        call = self.session.calls.get(request_id)
        return None if call is None else call.future


def unreadable_welcome(error: ProtocolError, endpoint: str) -> ProtocolError:
    """Why `start()` fails when the answer to its hello does not decode: a producer of a
    protocol version this side does not speak that welcomed instead of refusing
    (`VersionMismatchError`), or one that broke the protocol (`RemoteProtocolError`)."""
    said = (
        f"the producer at {endpoint} answered the hello with a message this side (kvrt {m.RELEASE}) "
        f"cannot read: {error}"
    )
    return VersionMismatchError(said) if isinstance(error, VersionMismatchError) else RemoteProtocolError(said)
