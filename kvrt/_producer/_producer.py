"""The producer (prefill side): `Producer` composes its parts (`_serve`, `_insert`,
`_publish`, `_streams`) over the shared fields of `_state`, and adds starting, closing and stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Self

import zmq

from kvrt import _messages as m
from kvrt import _metrics
from kvrt._auth import secure_server
from kvrt._errors import (
    ClosedError,
    translate_zmq_error,
)
from kvrt._metrics import ProducerStats
from kvrt._producer._publish import _Publishing
from kvrt._producer._serve import _host_of
from kvrt._producer._state import PRODUCER_IO_THREADS
from kvrt._producer._streams import _Streaming
from kvrt._service import AsyncService
from kvrt._zmqio import RouterOutboxes, SocketIO
from kvrt.transports._arena import SLAB_BYTES
from kvrt.transports.select import make_senders

log = logging.getLogger("kvrt.producer")

_BYE_LINGER_MS = 200
"""How long closing waits for its Bye messages to leave."""


class Producer(_Publishing, _Streaming, AsyncService):
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
    """

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
