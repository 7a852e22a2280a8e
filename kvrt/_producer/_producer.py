"""The producer (prefill side): `Producer` makes its parts and hands each what it uses (the
shared ones in `_parts`): the serve loop (`_serve`), the inserter (`_insert`), the publisher
(`_publish`) and the stream publisher (`_stream_publisher`), to which its public calls go; and it
starts, closes and reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from functools import partial
from typing import Any, Self

import torch
import zmq

from kvrt import _messages as m
from kvrt import _metrics
from kvrt._arguments import byte_count, endpoint, seconds
from kvrt._auth import CurveKeys, secure_server
from kvrt._caller_stream import run_on_caller_stream
from kvrt._checksum import checksum_wanted
from kvrt._devices import usable_device
from kvrt._errors import ClosedError, InvalidInputError, translate_zmq_error
from kvrt._heads import head_range
from kvrt._heap import keep_freed_memory
from kvrt._loop_watch import LoopWatch, unwatch, watch_running_loop
from kvrt._metrics import ProducerStats
from kvrt._producer._parts import (
    PRODUCER_IO_THREADS,
    Gate,
    ItemKeeper,
    ProducerConfig,
    RegisteredPools,
    Workers,
    loop_time,
)
from kvrt._producer._publish import Publisher
from kvrt._producer._serve import Inserter, ServeLoop, _host_of
from kvrt._producer._stream_publisher import StreamPublisher
from kvrt._protocol import DEFAULT_HEARTBEAT_S, ProducerCore, _heartbeat
from kvrt._service import AsyncService
from kvrt._signatures import takes
from kvrt._streams import ProducerStream
from kvrt._zmqio import RouterOutboxes, SocketIO
from kvrt.transports import Sender
from kvrt.transports._arena import SLAB_BYTES
from kvrt.transports.cuda_ipc import host_identity
from kvrt.transports.select import SAME_HOST_ONLY, make_senders, producer_transports

log = logging.getLogger("kvrt.producer")

_BYE_LINGER_MS = 200
"""How long closing waits for its Bye messages to leave."""


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
    `heads`: which of the model's KV heads this producer's items hold, `slice(h0, h1)` (a
    prefill TP rank's share; inserts check it). Consumers then ask for heads in the model's
    numbering, and one whose heads lie with several producers asks each for its part (see
    `Consumer.drop_select`); None: consumers number this producer's heads from 0.
    `checksum`: each item inserted carries an XXH3-64 checksum of its bytes, computed at
    insert; a consumer checks what lands against it before its caller sees it, and a
    mismatch fails the call with `IntegrityError` while the item goes back whole (None: the
    `KVRT_CHECKSUM` environment variable, 1 for on; off by default). It covers whole items
    inserted into host memory (`device="cpu"`), delivered one at a time; published prefills,
    streams, pieces and `drop_select_many` batches carry none yet.
    """

    _watch: LoopWatch | None = None
    """The loop it serves on, watched while it runs (`kvrt._loop_watch`)."""

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
        heads: slice | None = None,
        checksum: bool | None = None,
    ) -> None:
        buffer_bytes = byte_count(buffer_bytes, "buffer_bytes")
        wanted = checksum_wanted(checksum)
        heartbeat_s = _heartbeat(heartbeat_s)
        item_ttl_s = seconds(item_ttl_s, "item_ttl_s", none=True)
        bind = endpoint(bind, "bind", binding=True)
        if curve is not None and not isinstance(curve, CurveKeys):
            raise InvalidInputError(f"curve must be None or kvrt.CurveKeys, got {type(curve).__name__}")
        usable = usable_device(device)
        config = ProducerConfig(
            bind=bind, device=usable, buffer_bytes=buffer_bytes, heartbeat_s=heartbeat_s,
            producer_id=name or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            transport_names=tuple(producer_transports(transport, usable)), item_ttl_s=item_ttl_s, curve=curve,
            heads=head_range(heads, "heads"), checksum=wanted,
        )  # fmt: skip
        self._config = config
        self.device = config.device
        self.buffer_bytes = config.buffer_bytes
        self.heads = config.heads
        """The model's KV heads this producer's items hold (a prefill TP rank's share), if told."""
        self.checksum = config.checksum
        """Whether each inserted item carries a checksum of its bytes (`KVRT_CHECKSUM` if None)."""
        self._transport_names = config.transport_names
        """What it offers its consumers, preferred first."""
        self._transports: dict[str, Sender] = {}
        """The producer's senders, by name (filled by `start`)."""
        self._workers = Workers(config.device)
        self._bytes = ItemKeeper(
            config.device, checksum=config.checksum, transports=self._transports, workers=self._workers
        )
        self._core = ProducerCore(
            producer_id=config.producer_id, heartbeat_s=config.heartbeat_s, transports=config.transport_names,
            buffer_limit_bytes=config.buffer_bytes, item_ttl_s=config.item_ttl_s, host=host_identity(),
            same_host_only=SAME_HOST_ONLY, cut=self._bytes.cut, heads=config.heads, checksum=config.checksum,
        )  # fmt: skip
        self._gate = Gate(self._core.buffer, config.buffer_bytes)
        registered = RegisteredPools()
        self._serving = ServeLoop(self._core, self._gate, self._bytes, self._transports)
        self._inserter = Inserter(self._core, self._gate, self._bytes, self._serving, heads=config.heads)
        self._publisher = Publisher(
            self._core, self._gate, self._bytes, self._workers, registered, self._inserter, self._serving
        )
        self._stream_publisher = StreamPublisher(
            self._core, self._gate, self._bytes, self._workers, registered, self._serving
        )
        self._authenticator: Any = None
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._io: SocketIO | None = None
        self._endpoint: str | None = None
        self._serve_task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        """The address actually bound (with the real port when `bind` asked for port 0)."""
        if self._endpoint is None:
            raise ClosedError("the producer is not started: use `async with` or `await start()`")
        return self._endpoint

    # -- the prefill engine's calls, each given to the part whose job it is -------------------

    @takes(Inserter.insert)
    async def insert(self, *args: Any, **kwargs: Any) -> None:
        """Buffer one request's KV. Returns once it is buffered; nothing the caller holds is kept.

        Waits while the buffer is over `buffer_bytes`; `timeout` bounds that wait (None: until
        room appears or the producer closes). On a GPU the copy is queued on `stream` (None: the
        caller's current stream, see `kvrt._caller_stream`), after the work that wrote the
        tensors there; sends wait for it on the GPU. Raises `InvalidInputError` for tensors that
        disagree, `KVRTTimeoutError` (phase "insert") and `ClosedError`.
        """
        await run_on_caller_stream(self._inserter.insert(*args, **kwargs), self.device, kwargs.get("stream"))

    @takes(Publisher.register_pools)
    def register_pools(self, *args: Any, **kwargs: Any) -> None:
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
        self._publisher.register_pools(*args, **kwargs)

    @takes(Publisher.publish)
    async def publish(self, *args: Any, **kwargs: Any) -> None:
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
        await run_on_caller_stream(self._publisher.publish(*args, **kwargs), self.device, kwargs.get("stream"))

    @takes(StreamPublisher.open_stream)
    async def open_stream(self, *args: Any, **kwargs: Any) -> ProducerStream:
        """Announce a prefill that will publish `layers` layers of KV for these tokens, layer by
        layer (`put_layer`), so that a consumer can read layer i while later ones are computed.
        A reader paired over NCCL gets each layer over NCCL as soon as the prefill's stream
        wrote it (see `kvrt._streams`); others get it as frames, over TCP.

        With `slots` (and `replica`, as for `publish`) the layers are read from the registered
        pools: token i's KV at `slots[i]` of replica `replica[i]`, every layer of the pools
        (`layers` may be left out). Indexes on the host are checked there; on the GPU the
        check reads a flag back, which waits for `stream` (None: the caller's current stream)
        once.

        Waits while the buffer is over `buffer_bytes`, as `insert` does; `timeout` bounds that
        wait (0: a prefill that must not wait is refused at once with `KVRTTimeoutError`, phase
        "insert", and publishes nothing)."""
        return await run_on_caller_stream(
            self._stream_publisher.open_stream(*args, **kwargs), self.device, kwargs.get("stream")
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> Self:
        """Bind the endpoint and start serving; returns once `endpoint` is known."""
        if self._socket is not None or self._gate.closed:
            raise ClosedError("a producer starts once; create a new one")
        keep_freed_memory()
        await self._bytes.warm_device_checksums()
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
        config = self._config
        if config.curve is not None:
            self._authenticator = secure_server(self._context, socket, config.curve)
        try:
            socket.bind(config.bind)
        except zmq.ZMQError as exc:
            socket.close()
            if self._authenticator is not None:
                self._authenticator.stop()
            self._context.term()
            raise translate_zmq_error(exc, endpoint=config.bind) from None
        self._socket = socket
        self._core.started_at = loop_time()
        self._io = SocketIO(socket)
        self._endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._serving.bind(self._io, RouterOutboxes(self._io, stall_s=self._core.peer_timeout_s), self._endpoint)
        self._gate.started = True
        self._transports.update(
            make_senders(
                self._transport_names,
                self.device,
                store_host=_host_of(self._endpoint),
                # Room for a full buffer and the one insert that may pass it, and a slab to spare.
                registered_bytes=2 * self.buffer_bytes + SLAB_BYTES,
                takes_frames=partial(self._core.takes, capability=m.Capability.TCP_FRAMES),
            )
        )
        for transport in self._transports.values():
            await transport.start()
        self._gate.update_room()
        _metrics.track_producer(self)
        self._serve_task = asyncio.create_task(self._serving.run(), name=f"kvrt-producer-{self._endpoint}")
        self._serve_task.add_done_callback(self._serving.ended)
        self._watch = watch_running_loop()
        return self

    async def aclose(self) -> None:
        """Say Bye to every consumer, fail every pending insert with `ClosedError`, and stop."""
        if self._gate.closed:
            return
        if self._watch is not None:
            unwatch(self._watch)
        self._gate.close()  # waiting inserts wake up and fail
        if self._io is not None:
            for out in self._core.close("producer closed"):
                with contextlib.suppress(zmq.ZMQError):  # a consumer already gone needs no Bye
                    self._io.send_nowait([out.peer, m.encode(out.message)])
        self._serving.release_departed()
        for transport in self._transports.values():
            await transport.aclose()
        self._workers.close()
        self._serving.host_copies.close()
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

    def refusals(self) -> dict[str, int]:
        """Error replies sent so far, by error code."""
        return dict(self._core.refusals)

    def stats(self) -> ProducerStats:
        buffer = self._core.buffer
        return ProducerStats(
            endpoint=self._endpoint or self._config.bind,
            items=len(buffer),
            buffer_bytes=buffer.nbytes,
            in_flight=buffer.held,
            waiting_requests=self._core.waiting_count,
            peers=self._core.peer_count,
            totals=self._core.counters,
            transports=self._core.peers_by_transport(),
        )
