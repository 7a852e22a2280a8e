"""The producer (prefill side): a ZeroMQ ROUTER around `ProducerCore`, and `insert`.

One task, owned by the producer, reads control frames, hands them to the core, and sends
what the core answers; it wakes for a frame or for the core's next deadline, nothing else.
`insert` runs in the caller's task: it waits (on an event, never a poll) while the buffer
holds more than `buffer_bytes`, copies the tensors, and gives the item to the core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Self

import msgspec
import numpy as np
import torch
import zmq

from kvrt import _messages as m
from kvrt import _metrics
from kvrt._arguments import byte_count, endpoint, seconds, usable_device
from kvrt._auth import CurveKeys, secure_server
from kvrt._buffer import BufferedItem, GathersFailed, StreamState
from kvrt._caller_stream import on_caller_stream
from kvrt._errors import (
    ClosedError,
    ErrorCode,
    InvalidInputError,
    KVRTError,
    KVRTTimeoutError,
    PeerLostError,
    translate_zmq_error,
)
from kvrt._item import (
    buffered_item,
    check_item,
    check_timeout,
    check_tokens,
    item_from_packed,
    item_from_tokens,
    masked_tokens,
)
from kvrt._messages import Capability
from kvrt._pools import Part, PoolTable, check_indices, checked_indexes, index_ranges, per_token, ranges_fit
from kvrt._protocol import HEARTBEAT_MISSES, Outgoing, ProducerCore, ProducerCounters
from kvrt._service import AsyncService
from kvrt._streams import Placement, ProducerStream
from kvrt._tensors import chunk_plan, copy_into, layer_segments, pack, pack_empty, tensor_bytes
from kvrt._threads import gpu_worker, launch_on
from kvrt._zmqio import MAX_BATCH, Dropped, RouterOutboxes, SocketIO
from kvrt.transports import Transport
from kvrt.transports.cuda_ipc import host_identity
from kvrt.transports.select import SAME_HOST_ONLY, make_transports, transport_preference

if TYPE_CHECKING:  # the kernels import Triton: only when pools are used
    from kvrt.kernels.paged_kv import PreparedGather

log = logging.getLogger("kvrt.producer")

DEFAULT_HEARTBEAT_S = 1.0
"""Consumers ping at least this often; one silent for 4 periods is dropped."""
DEFAULT_CHUNK_BYTES = 1 << 30
"""K and V bytes per chunk of a published request (see `register_pools`)."""

_BYE_LINGER_MS = 200
"""How long closing waits for its Bye messages to leave."""


@dataclass(frozen=True, slots=True)
class ProducerStats:
    """A snapshot of what the producer holds and has done."""

    endpoint: str
    items: int
    buffer_bytes: int
    in_flight: int
    waiting_requests: int
    peers: int
    totals: ProducerCounters
    transports: dict[str, int]
    """Connected consumers by the transport their items travel over ("nccl", "gloo", "tcp")."""


class _Gathers:
    """A published item's gathers in send order, each followed by its event. `publish` plans
    them while the index ranges travel back from the device; else the first `prepare` does
    (the send path's, right after the Deliver header left, or `publish`'s once the item is
    buffered), so that the header never waits for the planning alone.

    When every launch was compiled before, they are queued on the loop, each right before the
    sends of its bytes, so the first chunk is on the wire before the last is even gathered.
    Else a worker thread queues them all, once the item's first send or `publish` asks: a
    first launch compiles, for about a second, and the loop must not wait for that.
    """

    def __init__(
        self,
        plan: Callable[[], list[PreparedGather]],
        ready: list[torch.cuda.Event],
        stream: torch.cuda.Stream,
        thread: Callable[[], concurrent.futures.Executor],
    ) -> None:
        self._plan = plan
        self._launches: list[PreparedGather] = []
        self._ready = ready
        self._stream = stream
        self._thread = thread
        self._compiled: bool | None = None
        self._queued = 0
        self._in_thread: concurrent.futures.Future[None] | None = None
        self._failure: BaseException | None = None

    def plan(self) -> None:
        """Plan the launches now (else the first `prepare` does); a failure is kept for it."""
        if self._compiled is None and self._failure is None:
            try:
                self._launches = self._plan()
                self._compiled = all(launch.compiled for launch in self._launches)
            except Exception as exc:  # a plan that cannot be made fails every send, and publish
                self._failure = exc

    def prepare(self) -> concurrent.futures.Future[None] | None:
        """The worker thread's queuing of every gather, started on the first call, when they
        must compile; None when the loop queues them."""
        self.plan()
        self._raise_failure()
        if not self._compiled and self._in_thread is None:
            self._in_thread = self._thread().submit(self._queue, None)
        return self._in_thread

    def queue_through(self, gather: int | None) -> None:
        self.prepare()
        if self._in_thread is not None:
            assert self._in_thread.done(), "a send waits for the gather thread before queuing"
            failure = self._in_thread.exception()
            if failure is not None:
                raise GathersFailed(str(failure)) from failure
            return
        try:
            self._queue(gather)
        except Exception as exc:
            self._failure = exc
            self._raise_failure()

    def _queue(self, through: int | None) -> None:
        launches = self._launches
        last = len(launches) - 1 if through is None else through
        with torch.cuda.stream(self._stream):
            while self._queued <= last:
                launches[self._queued].launch()
                self._ready[self._queued].record(self._stream)
                self._queued += 1

    @property
    def failed(self) -> bool:
        """Whether queuing these gathers failed (the item's bytes never come)."""
        in_thread = self._in_thread
        return self._failure is not None or (
            in_thread is not None and in_thread.done() and in_thread.exception() is not None
        )

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise GathersFailed(str(self._failure)) from self._failure


async def _gathers_prepared(item: BufferedItem) -> None:
    """A published item's gathers queued already if a worker thread queues them (at once for
    other items). Raises `GathersFailed`."""
    if item.gathers is None:
        return
    in_thread = item.gathers.prepare()
    if in_thread is not None:
        try:
            await asyncio.wrap_future(in_thread)
        except Exception as exc:
            raise GathersFailed(str(exc)) from exc


async def _all_gathers_queued(item: BufferedItem) -> None:
    """Every gather of a published item queued (at once for other items): before anything
    reads the whole storage. Raises `GathersFailed`."""
    await _gathers_prepared(item)
    if item.gathers is not None:
        item.gathers.queue_through(None)


def _lookup_key_and(
    input_tokens: torch.Tensor, roi: torch.Tensor | None, values: torch.Tensor | None
) -> Callable[[], tuple[np.ndarray, list[int]]]:
    """The lookup key (the tokens the roi selects, on the host) and a few int64 device values
    (or none), read back together (one wait for the device, not two): queued now, the call
    that returns waits for them, so that the host can work out other things while they
    travel. Tokens on the host cost no read back."""
    tokens = input_tokens.detach()
    if values is None and tokens.device.type == "cpu":
        key = masked_tokens(input_tokens, roi)
        return lambda: (key, [])
    if values is not None and tokens.device != values.device:
        key, read_values = masked_tokens(input_tokens, roi), _to_host(values)
        return lambda: (key, read_values().tolist())
    parts = [tokens.to(torch.int64)]
    if roi is not None:  # applied on the host: a boolean mask on the device would wait too
        parts.append(roi.to(device=tokens.device, dtype=torch.int64))
    if values is not None:
        parts.append(values)
    read = _to_host(torch.cat(parts))
    count = tokens.numel()
    values_at = count if roi is None else 2 * count

    def result() -> tuple[np.ndarray, list[int]]:
        host = read()
        key = host[:count] if roi is None else host[:count][host[count:values_at].astype(bool)]
        return key, host[values_at:].tolist()

    return result


def _to_host(values: torch.Tensor) -> Callable[[], np.ndarray]:
    """`values` on the host, the copy queued now: the call that returns waits for the device's
    stream once. A GPU copy lands in pinned memory (a pageable copy of a long prompt's tokens
    costs the loop a synchronous staging copy)."""
    if values.device.type != "cuda":
        return values.numpy
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)  # cached by torch once freed
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(values.device))

    def result() -> np.ndarray:
        copied.synchronize()
        return host.numpy().copy()  # the pinned block goes back to torch's cache; the key may live long

    return result


PRODUCER_IO_THREADS: Final = 2
TRIM_AFTER_DEPARTURES: Final = 256
"""Peers forgotten since the last heap trim that make the next one worth it."""


def _trim_heap() -> None:
    """Give freed heap memory back to the system (glibc's `malloc_trim`; nothing elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


class _RateLimit:
    """At most one log line per `per_s` for a kind of event a peer can cause at will (a flood
    of refused messages must not become a flood of log lines); the others are counted."""

    def __init__(self, per_s: float) -> None:
        self._per_s = per_s
        self._next = 0.0
        self._suppressed = 0

    def allows(self, now: float) -> bool:
        if now >= self._next:
            self._next = now + self._per_s
            return True
        self._suppressed += 1
        return False

    def suppressed_note(self) -> str:
        note = f" ({self._suppressed} more not logged)" if self._suppressed else ""
        self._suppressed = 0
        return note


class _Unencodable(Exception):
    """A message the core built that the wire cannot carry (a bug: every value is checked first)."""


def _encoded(message: m.Message) -> bytes:
    try:
        return m.encode(message)
    except (OverflowError, TypeError, ValueError) as exc:
        raise _Unencodable(f"{type(message).__name__}: {exc}") from exc


def _frame_bytes(frame: bytes | memoryview) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def _earliest(*deadlines: float | None) -> float | None:
    return min((deadline for deadline in deadlines if deadline is not None), default=None)


def _fill(item: BufferedItem) -> None:
    """Write a finished stream's storage before it is read whole (see `BufferedItem.fill`)."""
    fill, item.fill = item.fill, None
    if fill is not None:
        fill(item)


def _release_layers(stream: StreamState) -> None:
    """Free an ended stream's own copies of its layers, though the caller may keep its handle
    (a transfer still reading one holds it until it ran)."""
    stream.keys.clear()
    stream.values.clear()
    stream.ready.clear()


def _host_of(endpoint: str) -> str:
    """The host part of a bound tcp:// endpoint, as peers can reach it."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host in ("*", "0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


MAX_HEARTBEAT_S = 3600.0
"""The longest heartbeat period (libzmq counts its own heartbeats' timeout in ms, up to 6553 s
for the one it sends its peer)."""


def _heartbeat(value: object) -> float:
    heartbeat_s = seconds(value, "heartbeat_s")
    assert heartbeat_s is not None
    if heartbeat_s * HEARTBEAT_MISSES > MAX_HEARTBEAT_S or heartbeat_s < 0.001:
        raise InvalidInputError(
            f"heartbeat_s must be between 0.001 and {MAX_HEARTBEAT_S / HEARTBEAT_MISSES:g} s "
            f"(a peer is lost after {HEARTBEAT_MISSES} of them), got {value!r}"
        )
    return heartbeat_s


class Producer(AsyncService):
    """Buffers the KV of finished prefills and hands each to the consumer that asks for it.

    Use it as an async context manager (or `await start()` ... `await aclose()`):

        async with kvrt.Producer(bind="tcp://127.0.0.1:0") as producer:
            await producer.insert(input_tokens, roi, key, value, hidden)

    `bind` is a ZeroMQ address (port 0 picks a free one; `endpoint` tells which). Tensors
    are copied to `device` at insert. `insert` waits while the buffer holds more than
    `buffer_bytes` (items handed to a consumer count until it confirms receipt).
    `curve`: CURVE keys (`CurveKeys.server(...)`) to encrypt the control endpoint and admit
    only known consumers; None (the default) is for loopback and trusted networks.
    `item_ttl_s`: an item nobody took within this many seconds is dropped (counted as
    expired in stats and metrics); None keeps items until taken or evicted.
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        device: torch.device | str = "cpu",
        buffer_bytes: int = 1 << 30,
        *,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        name: str | None = None,
        transport: str | None = None,
        item_ttl_s: float | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        buffer_bytes = byte_count(buffer_bytes, "buffer_bytes")
        heartbeat_s = _heartbeat(heartbeat_s)
        item_ttl_s = seconds(item_ttl_s, "item_ttl_s", none=True)
        bind = endpoint(bind, "bind", binding=True)
        if curve is not None and not isinstance(curve, CurveKeys):
            raise InvalidInputError(f"curve must be None or kvrt.CurveKeys, got {type(curve).__name__}")
        self.device = usable_device(device)
        self.buffer_bytes = buffer_bytes
        self._bind = bind
        self._curve = curve
        self._authenticator: Any = None
        self._transport_names = transport_preference(transport, self.device)
        self._transports: dict[str, Transport] = {}
        self._core = ProducerCore(
            producer_id=name or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            heartbeat_s=heartbeat_s,
            transports=self._transport_names,
            buffer_limit_bytes=buffer_bytes,
            item_ttl_s=item_ttl_s,
            host=host_identity(),
            same_host_only=SAME_HOST_ONLY,
        )
        self._send_lock = asyncio.Lock()
        self._refusal_log = _RateLimit(per_s=1.0)
        self._peer_log = _RateLimit(per_s=0.1)
        """Consumers joining and leaving: a storm of connections must not become one of log lines."""
        self._departed_since_trim = 0
        self._pools: PoolTable | None = None
        self._chunk_bytes = DEFAULT_CHUNK_BYTES
        self._taper = False
        """Whether the first and the last chunk of a publish are small (see `register_pools`)."""
        self._gathers: concurrent.futures.ThreadPoolExecutor | None = None
        """Queues a publish's gathers off the loop (see `publish`)."""
        self._to_host: torch.cuda.Stream | None = None
        """Where the gather thread copies stream messages' tensors to the host (see `_host_frames`)."""
        self._peer_left = asyncio.Event()
        """Set whenever a consumer left and its pair was released (tests and metrics await it)."""
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._io: SocketIO | None = None
        self._outboxes: RouterOutboxes | None = None
        self._endpoint: str | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._room = asyncio.Event()
        self._closed = False
        self._failure: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> Self:
        """Bind the endpoint and start serving; returns once `endpoint` is known."""
        if self._socket is not None or self._closed:
            raise ClosedError("a producer starts once; create a new one")
        # Two I/O threads: handshakes and ZMTP heartbeats of many connections (a storm of them)
        # do not queue every consumer's bytes behind one thread.
        self._context = zmq.Context(io_threads=PRODUCER_IO_THREADS)
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.MAXMSGSIZE, m.MAX_INBOUND_MESSAGE_BYTES)
        # A consumer keeps one identity across reconnects (its receipts must still count): a new
        # connection under a known identity takes over from a stale one.
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # No ZMTP heartbeats of the producer's own: libzmq answers the consumers' (whose TTL closes
        # the connection of a consumer that stopped), and its heartbeat timer asserts in an engine
        # whose input is stopped when its connection fails (libzmq 4.3's `out_event` checks
        # `!_io_error`): a peer that floods a producer and then drops its connection would
        # abort the producer's process.
        if self._curve is not None:
            self._authenticator = secure_server(self._context, socket, self._curve)
        try:
            socket.bind(self._bind)
        except zmq.ZMQError as exc:
            socket.close()
            if self._authenticator is not None:
                self._authenticator.stop()
            self._context.term()
            raise translate_zmq_error(exc, endpoint=self._bind) from None
        self._socket = socket
        self._core.started_at = self._now()
        self._io = SocketIO(socket)
        self._outboxes = RouterOutboxes(self._io, stall_s=self._core.peer_timeout_s)
        self._endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._transports = make_transports(self._transport_names, self.device, store_host=_host_of(self._endpoint))
        self._update_room()
        _metrics.track_producer(self)
        self._serve_task = asyncio.create_task(self._serve(), name=f"kvrt-producer-{self._endpoint}")
        self._serve_task.add_done_callback(self._serve_ended)
        return self

    async def aclose(self) -> None:
        """Say Bye to every consumer, fail every pending insert with `ClosedError`, and stop."""
        if self._closed:
            return
        self._closed = True
        self._room.set()  # wake waiting inserts: they see `_closed` and fail
        if self._io is not None:
            for out in self._core.close("producer closed"):
                with contextlib.suppress(zmq.ZMQError):  # a consumer already gone needs no Bye
                    self._io.send_nowait([out.peer, m.encode(out.message)])
        self._release_departed()
        for transport in self._transports.values():
            await transport.aclose()
        if self._gathers is not None:
            self._gathers.shutdown(wait=False)
        if self._serve_task is not None:
            self._serve_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serve_task
        if self._io is not None:
            self._io.close()
        if self._socket is not None:
            self._socket.close(linger=_BYE_LINGER_MS)
        if self._authenticator is not None:
            self._authenticator.stop()
        if self._context is not None:
            self._context.term()

    # -- API ------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The address actually bound (with the real port when `bind` asked for port 0)."""
        if self._endpoint is None:
            raise ClosedError("the producer is not started: use `async with` or `await start()`")
        return self._endpoint

    @on_caller_stream
    async def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor | None,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor | None = None,
        *,
        timeout: float | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Buffer one request's KV. Returns once it is buffered; nothing the caller holds is kept.

        Waits while the buffer is over `buffer_bytes`; `timeout` bounds that wait (None: until
        room appears or the producer closes). On a GPU the copy is queued on `stream` (None: the
        caller's current stream, see `kvrt._caller_stream`), after the work that wrote the
        tensors there; sends wait for it on the GPU. Raises `InvalidInputError` for tensors that
        disagree, `KVRTTimeoutError` (phase "insert") and `ClosedError`.
        """
        self._check_open()
        timer = _metrics.Timer("insert")
        check_item(input_tokens, roi, key, value, hidden)
        check_timeout(timeout, what="insert")
        await self._wait_for_room(timeout)
        self._reclaim()
        item = buffered_item(
            (input_tokens, roi, key, value, hidden),
            self.device,
            item_id=self._core.new_item_id(),
            seq=self._core.buffer.next_seq(),
        )
        await self._buffer(item)
        timer.done()

    async def _buffer(self, item: BufferedItem) -> None:
        """Hand a built item to the transports and the core (room was waited for already)."""
        self._prepare(item)
        await self._perform(self._core.insert(item, self._now()))

    def _prepare(self, item: BufferedItem) -> None:
        """A GPU item's bytes were written on the current stream: the event every GPU send of it
        waits on (recorded once, for all transports); then each transport gets ready to send it."""
        if item.storage.device.type == "cuda":
            item.ready_event = torch.cuda.Event()
            item.ready_event.record(torch.cuda.current_stream(item.storage.device))
        for transport in self._transports.values():
            transport.prepare(item)

    def register_pools(self, pools: PoolTable, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, taper: bool = False) -> None:
        """Register the engine's KV pools (every replica, copy and layer) that `publish` reads.

        Called by the engine once, after it allocated its pools and before the first
        `publish`; a later call replaces the table for later publishes. `pools` must be on this
        producer's device. A published request travels in chunks of whole layers holding about
        `chunk_bytes` of K and V (at least one layer): on a GPU each chunk is sent as soon as it
        is gathered, and a pulling consumer scatters it as soon as it lands. With `taper`, the
        last chunk is a quarter of that, which leaves less to scatter once the wire is idle.

        Raises `InvalidInputError` for pools on another device or a `chunk_bytes` that is not
        a positive int. The pools stay the engine's: kvrt keeps a reference to the table and
        reads the pools only inside `publish` (see there), never writes them."""
        if pools.device != self.device:
            raise InvalidInputError(f"the pools are on {pools.device}, this producer is on {self.device}")
        if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise InvalidInputError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self._pools = pools
        self._chunk_bytes = chunk_bytes
        self._taper = bool(taper)

    @on_caller_stream
    async def publish(
        self,
        input_tokens: torch.Tensor,
        slots: torch.Tensor,
        replica: torch.Tensor | int = 0,
        roi: torch.Tensor | None = None,
        *,
        timeout: float | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Buffer a finished prefill from the registered pools, for a consumer to `pull` (or
        `drop_select`).

        Called by the engine once per request, after its prefill wrote the KV: token i's KV is
        at `slots[i]` of replica `replica[i]` (an int: one replica for every token). `slots` and
        `replica` are 1-D int32 or int64 tensors on the pools' device or on the host; `roi` masks
        the tokens that count for matching, as in `insert`. The KV is gathered into an item of
        kvrt's own (one kernel launch per chunk, all layers) and buffered like an insert;
        waits while the buffer is over `buffer_bytes`, `timeout` bounds that wait.

        Raises `InvalidInputError` (no pools registered, tokens and slots that disagree, a
        slot or replica outside the pools: checked before anything is read or buffered),
        `KVRTTimeoutError` (phase "insert") and `ClosedError`. Memory: on a GPU every gather is
        queued on `stream` (None: the calling thread's current stream, after the prefill's
        writes) before this returns, so writes the engine queues on that stream afterwards come
        after the gathers read the pools (writes from another stream must wait for it); on the
        CPU the KV is copied before this returns. The item is kvrt's until a consumer takes it."""
        pools = self._pools
        if pools is None:
            raise InvalidInputError("publish needs pools: call register_pools first")
        check_tokens(input_tokens, roi, what="publish")
        from kvrt.kernels.paged_kv import gather_into_any, prepare_gather_into

        replicas = per_token(replica, slots)
        if slots.numel() != input_tokens.numel():
            raise InvalidInputError(f"publish: {slots.numel()} slots for {input_tokens.numel()} tokens")
        self._check_open()
        check_timeout(timeout, what="publish")
        await self._wait_for_room(timeout)
        self._reclaim()
        read_back = None
        if self.device.type == "cuda":
            ranges = None
            if slots.device.type == "cpu" and replicas.device.type == "cpu":
                # Indexes on the host, as an engine's scheduler holds a request's pages: checked
                # here, with no device round trip, and copied to the pools' device on the
                # caller's stream, which the gathers run after.
                replicas, slots = checked_indexes(pools, replicas, slots)
            else:
                ranges = index_ranges(pools, replicas, slots)
            # The lookup key (and the index ranges) come back in one read, queued first: the
            # item's layout and its gathers' plan are worked out while they travel. Nothing is
            # launched on the pools, or buffered, before the indexes are known to be in range.
            read_back = _lookup_key_and(input_tokens, roi, ranges)
        # The item's buffer is laid out first and the KV gathered straight into it: one pass
        # over the bytes, no staging copy.
        g, tokens = pools.geometry, slots.numel()
        kv_shape = (pools.layers, tokens, g.heads, g.head_dim)
        value_shape = kv_shape if g.kv == 2 else (pools.layers, tokens, 1, 0)
        packed = pack_empty(
            [(input_tokens.shape, input_tokens.dtype), None if roi is None else (roi.shape, roi.dtype),
             (kv_shape, pools.dtype), (value_shape, pools.dtype), None],
            self.device,
        )  # fmt: skip
        item_tokens, item_roi, key, value, _ = packed.tensors
        _, _, key_meta, value_meta, _ = packed.metas
        assert item_tokens is not None and key is not None and value is not None
        assert key_meta is not None and value_meta is not None
        for into, source in ((item_tokens, input_tokens), (item_roi, roi)):
            if into is not None and source is not None:
                copy_into(into, source)
        layer_bytes = (key.nbytes + value.nbytes) // max(1, pools.layers)
        per_chunk = max(1, self._chunk_bytes // max(1, layer_bytes))
        chunks = chunk_plan(pools.layers, per_chunk, small_last=self._taper)
        segments, segment_chunks = layer_segments(key_meta, value_meta, packed.storage.numel(), chunks)
        gathers: _Gathers | None = None
        if read_back is not None:
            # A chunk's keys and values are gathered apart, each before its own segment (the
            # values follow the keys in the payload): the first segment leaves once the first
            # chunk's keys are gathered, half of the first gather.
            parts: list[Part] = ["key", "value"] if g.kv == 2 else ["key"]
            segment_gathers = [
                chunk * len(parts) + (1 if len(parts) == 2 and offset >= value_meta.offset else 0)
                for (offset, _), chunk in zip(segments, segment_chunks, strict=True)
            ]

            def plan(replicas: torch.Tensor = replicas, slots: torch.Tensor = slots) -> list[PreparedGather]:
                """Planned once for every layer; a chunk only moves the grid (no new checks,
                views or compilation per chunk)."""
                whole = [prepare_gather_into(pools, replicas, slots, key, value, part=part) for part in parts]
                return [part.for_layers(first, end) for first, end in chunks for part in whole]

            ready = [torch.cuda.Event() for _ in range(len(chunks) * len(parts))]
            # The send path queues each gather right before the sends of its bytes, once the
            # Deliver header has left (the consumer posts its receives meanwhile); a first
            # launch compiles, for about a second, in a worker thread. They are planned now
            # while index ranges travel back from the device, else after the header left.
            gathers = _Gathers(plan, ready, torch.cuda.current_stream(self.device), self._gather_thread)
            if ranges is not None:
                gathers.plan()
            masked, read_ranges = read_back()
            if read_ranges and not ranges_fit(pools, read_ranges):
                check_indices(pools, replicas, slots)  # raises, naming the index
        else:
            masked = masked_tokens(input_tokens, roi)
            gather_into_any(pools, replicas, slots, key, value)
        item = item_from_packed(
            packed, item_id=self._core.new_item_id(), seq=self._core.buffer.next_seq(), masked=masked
        )
        item.segments = segments
        if gathers is not None:
            item.segment_ready = [ready[gather] for gather in segment_gathers]
            item.segment_gathers = segment_gathers
            item.gathers = gathers
        # Buffered before the other gathers are queued: a waiting pull gets its Deliver header
        # first and posts its receives while they are queued.
        await self._buffer(item)
        if gathers is not None:
            try:
                await _all_gathers_queued(item)
            except GathersFailed as failed:
                self._core.discard(item)
                raise KVRTError(f"publish: queuing the gathers on {self.device} failed: {failed}") from failed

    def _reclaim(self) -> None:
        """Before allocating an item: memory that finished transfers still reference is freed
        (else a GPU item allocates anew, a device allocation on the loop)."""
        for transport in self._transports.values():
            transport.reclaim()

    async def _host_frames(self, tensors: Sequence[torch.Tensor], ready: torch.cuda.Event | None) -> list[memoryview]:
        """A stream message's tensors as frames for an in-band transport. GPU tensors are
        copied to the host in a kvrt thread once the prefill wrote them: the loop never waits
        for the device."""
        if all(tensor.device.type == "cpu" for tensor in tensors):
            return [tensor_bytes(tensor) for tensor in tensors]
        if ready is None:  # written on this thread's current stream, which the copy must follow
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensors[0].device))

        if self._to_host is None:
            self._to_host = torch.cuda.Stream(tensors[0].device)
        to_host_stream = self._to_host

        def to_host() -> list[memoryview]:
            ready.synchronize()
            # On a stream of kvrt's own: a copy on the thread's default stream would also wait
            # for everything queued on the legacy default stream, a whole prefill if it runs there.
            with torch.cuda.stream(to_host_stream):
                return [tensor_bytes(tensor.cpu()) for tensor in tensors]

        return await asyncio.wrap_future(self._gather_thread().submit(to_host))

    def _gather_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._gathers is None:
            self._gathers = gpu_worker(self.device, "kvrt-gather")
        return self._gathers

    @on_caller_stream
    async def open_stream(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor | None = None,
        *,
        layers: int | None = None,
        slots: torch.Tensor | None = None,
        replica: torch.Tensor | int = 0,
        stream: torch.cuda.Stream | None = None,
    ) -> ProducerStream:
        """Announce a prefill that will publish `layers` layers of KV for these tokens, layer by
        layer (`put_layer`), so that a consumer can read layer i while later ones are computed.
        A reader paired over NCCL gets each layer over NCCL as soon as the prefill's stream
        wrote it (see `kvrt._streams`); others get it as frames, over TCP.

        With `slots` (and `replica`, as for `publish`) the layers are read from the registered
        pools: token i's KV at `slots[i]` of replica `replica[i]`, every layer of the pools
        (`layers` may be left out). Indexes on the host are checked there; on the GPU the
        check reads a flag back, which waits for `stream` (None: the caller's current stream)
        once."""
        self._check_open()
        check_tokens(input_tokens, roi, what="open_stream")
        placement = None
        if slots is not None:
            placement = self._placement(input_tokens, slots, replica)
            if layers is not None and layers != placement.pools.layers:
                raise InvalidInputError(f"a stream of the pools has its {placement.pools.layers} layers, not {layers}")
            layers = placement.pools.layers
        if not isinstance(layers, int) or layers <= 0:
            raise InvalidInputError(f"layers must be a positive int, got {layers!r}")
        packed = pack((input_tokens, roi), torch.device("cpu"))
        item = item_from_tokens(packed, item_id=self._core.new_item_id(), seq=self._core.buffer.next_seq())
        item.stream = StreamState(layers)
        await self._perform(self._core.open_stream(item, self._now()))
        return ProducerStream(self, item, layers, int(input_tokens.numel()), placement)

    def _placement(self, input_tokens: torch.Tensor, slots: torch.Tensor, replica: torch.Tensor | int) -> Placement:
        pools = self._pools
        if pools is None:
            raise InvalidInputError("a stream of the pools needs them: call register_pools first")
        replicas = per_token(replica, slots)
        if slots.numel() != input_tokens.numel():
            raise InvalidInputError(f"open_stream: {slots.numel()} slots for {input_tokens.numel()} tokens")
        return Placement(pools, *checked_indexes(pools, replicas, slots))

    async def _gathered_layer(
        self, placement: Placement, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """Layer `layer` of a stream of the pools, gathered into a block of its own (key and
        value back to back: one transfer), and on a GPU the event after the gather, queued on
        the current stream. A first launch compiles, for about a second, in the gather thread
        (the loop must not wait for that), queued on the same stream all the same."""
        from kvrt.kernels.paged_kv import gather_layer_into_any, prepare_gather_layer

        pools = placement.pools
        g, tokens = pools.geometry, placement.slots.numel()
        shape = (tokens, g.heads, g.head_dim)
        block = torch.empty((g.kv, *shape), dtype=pools.dtype, device=pools.device)
        key = block[0]
        value = block[1] if g.kv == 2 else torch.empty((tokens, 1, 0), dtype=pools.dtype, device=pools.device)
        if pools.device.type != "cuda":
            gather_layer_into_any(pools, placement.replicas, placement.slots, layer, key, value)
            return key, value, None
        prepared = prepare_gather_layer(pools, placement.replicas, placement.slots, layer, key, value)
        caller = torch.cuda.current_stream(pools.device)
        await launch_on(prepared, caller, self._gather_thread)
        ready = torch.cuda.Event()
        ready.record(caller)
        return key, value, ready

    async def _stream_layer(
        self, item: BufferedItem, key: torch.Tensor, value: torch.Tensor, ready: torch.cuda.Event | None
    ) -> None:
        await self._perform(self._core.stream_layer(item, key, value, ready))

    async def _finish_stream(self, item: BufferedItem, hidden: torch.Tensor | None) -> None:
        """The stream as one whole item (what a reader confirms, or what `drop_select` takes if
        nobody read it): its layers stacked straight into the item's buffer, one copy."""
        stream = item.stream
        assert stream is not None
        first_key, first_value = stream.keys[0], stream.values[0]
        packed = pack_empty(
            [(item.input_tokens.shape, item.input_tokens.dtype),
             None if item.roi is None else (item.roi.shape, item.roi.dtype),
             ((stream.layers, *first_key.shape), first_key.dtype),
             ((stream.layers, *first_value.shape), first_value.dtype),
             None if hidden is None else (hidden.shape, hidden.dtype)],
            self.device,
        )  # fmt: skip
        tokens, roi, key, value, whole_hidden = packed.tensors
        assert tokens is not None and key is not None and value is not None
        for into, source in ((tokens, item.input_tokens), (roi, item.roi), (whole_hidden, hidden)):
            if into is not None and source is not None:
                copy_into(into, source)
        whole = item_from_packed(packed, item_id=item.item_id, seq=item.seq, masked=item.masked_tokens)
        keys, values, written = list(stream.keys), list(stream.values), list(stream.ready)

        def fill(whole: BufferedItem) -> None:
            """The layers stacked straight into the item's buffer (one copy), on the current
            stream, after the streams that wrote them; the transports then prepare it."""
            if self.device.type == "cuda":
                current = torch.cuda.current_stream(self.device)
                for event in written:
                    if event is not None:
                        current.wait_event(event)
                for tensor in (*keys, *values):
                    tensor.record_stream(current)  # freed with this closure, maybe before the stack ran
            torch.stack(keys, out=key)
            torch.stack(values, out=value)
            self._prepare(whole)

        if stream.reader is None:
            fill(whole)
        else:
            # The reader has every layer on its way: the whole item is written only if it must
            # travel whole after all (its reader leaves before confirming it). Stacking every
            # layer now would share the producer's GPU with the last layers' sends (a 1 GiB
            # stack slowed the last send of `kvrt bench stream` from ~0.11 to ~0.26 ms).
            whole.fill = fill
            if self.device.type == "cuda":  # the end's hidden states are written on this stream
                whole.ready_event = torch.cuda.Event()
                whole.ready_event.record(torch.cuda.current_stream(self.device))
        await self._perform(self._core.finish_stream(item, whole, self._now()))
        _release_layers(stream)

    async def _abort_stream(self, item: BufferedItem, reason: str) -> None:
        stream = item.stream
        await self._perform(self._core.abort_stream(item, reason))
        if stream is not None:
            _release_layers(stream)

    def refusals(self) -> dict[str, int]:
        """Error replies sent so far, by error code."""
        return dict(self._core.refusals)

    def stats(self) -> ProducerStats:
        buffer = self._core.buffer
        return ProducerStats(
            endpoint=self._endpoint or self._bind,
            items=len(buffer),
            buffer_bytes=buffer.nbytes,
            in_flight=buffer.held,
            waiting_requests=self._core.waiting_count,
            peers=self._core.peer_count,
            totals=self._core.counters,
            transports=self._core.peers_by_transport(),
        )

    # -- internals ------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _check_open(self) -> None:
        if self._closed or self._socket is None:
            reason = "closed" if self._closed else "not started: use `async with` or `await start()`"
            raise ClosedError(f"the producer is {reason}") from self._failure

    def _update_room(self) -> None:
        if self._core.buffer.nbytes <= self.buffer_bytes:
            self._room.set()
        else:
            self._room.clear()

    async def _wait_for_room(self, timeout: float | None) -> None:
        try:
            async with asyncio.timeout(timeout):
                while self._core.buffer.nbytes > self.buffer_bytes and not self._closed:
                    await self._room.wait()
        except TimeoutError:
            raise KVRTTimeoutError(
                f"the buffer stayed over {self.buffer_bytes} bytes for {timeout} s: "
                "no consumer is taking items; check that decode instances are connected",
                phase="insert",
            ) from None
        self._check_open()

    async def _serve(self) -> None:
        io, outboxes = self._io, self._outboxes
        assert io is not None and outboxes is not None
        core = self._core
        while True:
            first = await io.next(_earliest(core.next_deadline(), outboxes.next_retry()))
            now = self._now()
            batch = [] if first is None else [first, *io.drain()]
            for frames in batch:
                if len(frames) >= 2:
                    # Answered one by one: a burst's first item goes out (and its transfer
                    # starts) before the rest of the burst is looked up.
                    out = self._answer(frames[0].bytes, frames[1].buffer, len(frames) - 2, now)
                    if out:
                        await self._perform(out)
                    if outboxes.waiting(frames[0].bytes):  # a peer that sends may have read too
                        await self._perform(self._dropped(outboxes.flush(now, only=frames[0].bytes), now))
            if outboxes.next_retry() is not None:
                await self._perform(self._dropped(outboxes.flush(now), now))
            expired = core.expire(now)
            if expired:
                await self._perform(expired)
            self._release_departed()
            self._update_room()  # receipts in the batch may have made room
            if len(batch) > MAX_BATCH:
                # A flood never suspends `io.next`: yield once a full batch, so that inserts
                # and the engine's other tasks on this loop still run while one peer floods.
                await asyncio.sleep(0)

    def _answer(self, peer: bytes, frame: memoryview, extra_frames: int, now: float) -> list[Outgoing]:
        """The core's answer to one frame. A frame the core fails on (a bug, or a peer's input
        nobody foresaw) fails alone: its peer gets an internal error, everyone else is served."""
        try:
            return self._core.receive(peer, frame, extra_frames, now)
        except Exception as exc:
            log.exception("a frame could not be handled", extra={"peer": peer})
            return [self._core.refusal(peer, m.peek_request_id(frame), ErrorCode.INTERNAL, f"{type(exc).__name__}")]

    def _dropped(self, dropped: list[Dropped], now: float) -> list[Outgoing]:
        """Forget the peers the outboxes gave up on (their items go back once their lease ends)."""
        out: list[Outgoing] = []
        for gone in dropped:
            log.warning("dropped a consumer: %s", gone.reason, extra={"peer": gone.peer})
            out += self._core.peer_unreachable(gone.peer, now, gone.reason)
        return out

    def _post(self, peer: bytes, frames: list[bytes | memoryview], dropped: list[Dropped]) -> None:
        """Send to one peer without waiting on it (see `RouterOutboxes`)."""
        assert self._outboxes is not None
        gone = self._outboxes.post(peer, frames, self._now())
        if gone is not None:
            dropped.append(gone)

    async def _perform(self, out: list[Outgoing]) -> None:
        """Send what the core answered; a peer found unreachable, or not reading, is forgotten.

        No send waits for a peer: each peer's messages wait in its own outbox when its queue is
        full. Under one lock all the same: an out-of-band transport's sends must be issued in
        the order their Deliver headers are posted, and `insert` and the serve loop both come
        here. A message that cannot be built fails its own request only.
        """
        dropped: list[Dropped] = []
        async with self._send_lock:
            while out:
                send = out.pop(0)
                try:
                    await self._send_one(send, dropped)
                except (zmq.ZMQError, PeerLostError) as exc:
                    if isinstance(exc, zmq.ZMQError):
                        error = translate_zmq_error(exc, endpoint=self.endpoint)
                        if not isinstance(error, PeerLostError):
                            raise error from exc
                    out += self._core.peer_unreachable(send.peer, self._now(), "it is no longer connected")
                except GathersFailed:
                    # The consumer may hold a header whose bytes will never come: its pair
                    # cannot be trusted any more. The item is gone (`publish` raises).
                    for item in (send.item,) if send.item is not None else send.items:
                        if item.gathers is not None and item.gathers.failed:
                            self._core.discard(item)
                    out += self._core.peer_unreachable(send.peer, self._now(), "an item's gathers failed")
                except _Unencodable as exc:
                    log.error("could not build a reply: %s", exc, extra={"peer": send.peer})
                    out += self._core.unsendable(send, str(exc), self._now())
                if dropped:
                    out += self._dropped(dropped, self._now())
                    dropped = []
            self._release_departed()
        self._update_room()

    async def _send_one(self, send: Outgoing, dropped: list[Dropped]) -> None:
        """Build and post one message the core answered, with its payload."""
        message = send.message
        item = send.item
        if (
            type(message) is m.Deliver and item is not None and item.frames is not None
            and item.gathers is None and item.fill is None
            and self._core.transport_of(send.peer) == Capability.TCP
        ):  # fmt: skip
            # The common case on a CPU host, without a coroutine in the way: an inserted item's
            # bytes, framed once at insert, go with its header.
            self._post_delivery(send.peer, message, item.frames, dropped)
            return
        if isinstance(message, m.ErrorReply) and self._refusal_log.allows(self._now()):
            log.info(
                "refused a message: %s%s", message.message, self._refusal_log.suppressed_note(),
                extra={"peer": send.peer, "request_id": message.request_id, "code": message.code.value},
            )  # fmt: skip
        frames: Sequence[bytes | memoryview] = ()
        if isinstance(message, m.Welcome):
            assert self._outboxes is not None
            self._outboxes.unmute(send.peer)
            # A second hello ended the peer's old session first: its pair goes now,
            # not after the new one is offered (the peer's identity is the same).
            self._release_departed()
            if self._peer_log.allows(self._now()):
                log.info("a consumer joined; its items travel over %s%s", message.transport,
                         self._peer_log.suppressed_note(),
                         extra={"peer": send.peer, "transport": message.transport})  # fmt: skip
            rendezvous = self._transports[message.transport].offer(send.peer)
            if rendezvous:
                message = msgspec.structs.replace(message, rendezvous=rendezvous)
        for item in (send.item, *send.items):
            if item is not None and item.fill is not None and not isinstance(message, m.StreamEnd):
                _fill(item)  # a finished stream read whole after all
        if isinstance(message, m.StreamStart):
            assert send.item is not None
            await _all_gathers_queued(send.item)  # a published item's layers follow: gathered first
            # The frame: the tokens (and roi) at the head of the item's buffer, read
            # back in a kvrt thread for a GPU item (written before its ready event).
            head = send.item.storage[: message.payload_bytes]
            frames = await self._host_frames([head], send.item.ready_event)
        elif isinstance(message, m.StreamLayer | m.StreamEnd):
            transport_name = self._core.transport_of(send.peer)
            if transport_name is None:
                return  # the peer left meanwhile; the core took the stream back
            transport = self._transports[transport_name]
            ready = send.ready if send.item is None else send.item.written
            if transport.out_of_band and send.tensors:
                # The header first, as for a Deliver: the consumer posts the receive
                # while the send waits (on the GPU) for the prefill to write the layer.
                self._post(send.peer, [_encoded(message)], dropped)
                await transport.send_tensors(send.peer, send.tensors, ready)
                return
            if transport.streams_tensors and not transport.out_of_band:
                frames = await transport.stream_frames(send.peer, message.item_id, send.tensors, ready)
            else:
                frames = await self._host_frames(send.tensors, ready)
        elif isinstance(message, m.DeliverMany):
            transport_name = self._core.transport_of(send.peer)
            if transport_name is None:
                return  # the peer left meanwhile; the core took the items back
            transport = self._transports[transport_name]
            for item in send.items:  # a published item is read whole: every gather queued
                await _all_gathers_queued(item)
            if transport.out_of_band:
                self._post(send.peer, [_encoded(message)], dropped)
                await transport.send_many(send.peer, message, send.items)
                return
            frames = await transport.send_many(send.peer, message, send.items)
            self._post_delivery(send.peer, message, frames, dropped)
            return
        elif send.item is not None:
            transport_name = self._core.transport_of(send.peer)
            if transport_name is None:
                return  # the peer left meanwhile; the core took the item back
            transport = self._transports[transport_name]
            if transport.out_of_band:
                # The header first: the consumer posts its receives while the sends
                # are queued here (one per chunk of a publish, each chunk's gather
                # queued right before). Under the send lock an item's header and sends
                # still go before the next item's.
                self._post(send.peer, [_encoded(message)], dropped)
                await _gathers_prepared(send.item)
                await transport.send(send.peer, send.item)
                return
            await _all_gathers_queued(send.item)
            frames = await transport.send(send.peer, send.item)
            if isinstance(message, m.Deliver):
                self._post_delivery(send.peer, message, frames, dropped)
                return
        self._post(send.peer, [_encoded(message), *frames], dropped)

    def _post_delivery(
        self, peer: bytes, message: m.Deliver | m.DeliverMany, frames: Sequence[bytes | memoryview],
        dropped: list[Dropped],
    ) -> None:  # fmt: skip
        """An in-band delivery: with its frames, or, when they are large (the bytes themselves,
        over TCP; not a cuda_ipc share that names them), its header first and the frames in a
        `payload` message right behind (see `SPLIT_PAYLOAD_BYTES`)."""
        if not frames or sum(_frame_bytes(frame) for frame in frames) < m.SPLIT_PAYLOAD_BYTES:
            self._post(peer, [_encoded(message), *frames], dropped)
            return
        self._post(peer, [_encoded(message)], dropped)
        self._post(peer, [_encoded(m.Payload(request_id=message.request_id)), *frames], dropped)

    def _release_departed(self) -> None:
        departed = self._core.take_departed()
        for departure in departed:
            if self._peer_log.allows(self._now()):
                log.info("consumer left; what it held is back in the buffer%s", self._peer_log.suppressed_note(),
                         extra={"peer": departure.peer})  # fmt: skip
            self._transports[departure.transport].forget(departure.peer, departure.unconfirmed)
            self._peer_left.set()
        self._departed_since_trim += len(departed)
        if self._departed_since_trim >= TRIM_AFTER_DEPARTURES and self._core.peer_count < self._departed_since_trim:
            # After a storm of peers, give the memory their connections and records held back
            # to the system (glibc keeps freed memory in its arenas otherwise).
            self._departed_since_trim = 0
            _trim_heap()

    def _serve_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        failure = task.exception()
        if failure is not None:
            # The serve loop owns the protocol; without it nothing can be served. Close,
            # so that every later call says so instead of waiting for ever.
            self._failure = failure
            self._closed = True
            self._room.set()


__all__ = ["DEFAULT_HEARTBEAT_S", "KVRTError", "Producer", "ProducerStats"]
