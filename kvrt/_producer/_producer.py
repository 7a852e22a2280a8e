"""The producer (prefill side): `Producer` holds the shared fields (`_state`) and its parts:
the serve loop (`_serve`), the inserter (`_insert`), the publisher (`_publish`) and the stream
publisher (`_streams`), to which its public calls go; and it starts, closes and reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from functools import cached_property
from typing import Self

import torch
import zmq

from kvrt import _messages as m
from kvrt import _metrics
from kvrt._auth import secure_server
from kvrt._caller_stream import on_caller_stream
from kvrt._errors import (
    ClosedError,
    translate_zmq_error,
)
from kvrt._heap import keep_freed_memory
from kvrt._loop_watch import LoopWatch, unwatch, watch_running_loop
from kvrt._metrics import ProducerStats
from kvrt._pools import PoolTable
from kvrt._producer._insert import Inserter
from kvrt._producer._publish import Publisher
from kvrt._producer._serve import ServeLoop, _host_of
from kvrt._producer._state import DEFAULT_CHUNK_BYTES, PRODUCER_IO_THREADS, ProducerState
from kvrt._producer._streams import StreamPublisher
from kvrt._service import AsyncService
from kvrt._streams import ProducerStream
from kvrt._zmqio import RouterOutboxes, SocketIO
from kvrt.transports._arena import SLAB_BYTES
from kvrt.transports.select import make_senders

log = logging.getLogger("kvrt.producer")

_BYE_LINGER_MS = 200
"""How long closing waits for its Bye messages to leave."""


class Producer(ProducerState, AsyncService):
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

    # -- the prefill engine's calls, each given to the part whose job it is -------------------

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
        await self._inserter.insert(input_tokens, roi, key, value, hidden, timeout=timeout, stream=stream)

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
        self._publisher.register_pools(pools, chunk_bytes=chunk_bytes, taper=taper)

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
        await self._publisher.publish(input_tokens, slots, replica, roi, timeout=timeout, stream=stream)

    @on_caller_stream
    async def open_stream(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor | None = None,
        *,
        layers: int | None = None,
        slots: torch.Tensor | None = None,
        replica: torch.Tensor | int = 0,
        timeout: float | None = None,
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
        once.

        Waits while the buffer is over `buffer_bytes`, as `insert` does; `timeout` bounds that
        wait (0: a prefill that must not wait is refused at once with `KVRTTimeoutError`, phase
        "insert", and publishes nothing)."""
        return await self._stream_publisher.open_stream(
            input_tokens, roi, layers=layers, slots=slots, replica=replica, timeout=timeout, stream=stream
        )

    @cached_property
    def _serving(self) -> ServeLoop:
        return ServeLoop(self)

    @cached_property
    def _inserter(self) -> Inserter:
        return Inserter(self, self._serving)

    @cached_property
    def _publisher(self) -> Publisher:
        return Publisher(self, self._inserter, self._serving)

    @cached_property
    def _stream_publisher(self) -> StreamPublisher:
        return StreamPublisher(self, self._inserter, self._serving)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> Self:
        """Bind the endpoint and start serving; returns once `endpoint` is known."""
        if self._socket is not None or self._closed:
            raise ClosedError("a producer starts once; create a new one")
        keep_freed_memory()
        await self.warm_device_checksums()
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
        self._transports = make_senders(
            self._transport_names,
            self.device,
            store_host=_host_of(self._endpoint),
            # Room for a full buffer and the one insert that may pass it, and a slab to spare.
            registered_bytes=2 * self.buffer_bytes + SLAB_BYTES,
        )
        for transport in self._transports.values():
            await transport.start()
        self._update_room()
        _metrics.track_producer(self)
        self._serve_task = asyncio.create_task(self._serving.run(), name=f"kvrt-producer-{self._endpoint}")
        self._serve_task.add_done_callback(self._serving.ended)
        self._watch = watch_running_loop()
        return self

    async def aclose(self) -> None:
        """Say Bye to every consumer, fail every pending insert with `ClosedError`, and stop."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            unwatch(self._watch)
        self._room.set()  # wake waiting inserts: they see `_closed` and fail
        if self._io is not None:
            for out in self._core.close("producer closed"):
                with contextlib.suppress(zmq.ZMQError):  # a consumer already gone needs no Bye
                    self._io.send_nowait([out.peer, m.encode(out.message)])
        self._serving.release_departed()
        for transport in self._transports.values():
            await transport.aclose()
        if self._gathers is not None:
            self._gathers.shutdown(wait=False)
        if self._checksums is not None:
            self._checksums.shutdown(wait=False)
        self._host_copies.close()
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
            endpoint=self._endpoint or self._bind,
            items=len(buffer),
            buffer_bytes=buffer.nbytes,
            in_flight=buffer.held,
            waiting_requests=self._core.waiting_count,
            peers=self._core.peer_count,
            totals=self._core.counters,
            transports=self._core.peers_by_transport(),
        )
