"""kvrt for synchronous engines: `kvrt.blocking.Producer` and `kvrt.blocking.Consumer`.

Serving engines call their KV transfer layer from ordinary threads (a worker's model
runner, a scheduler), not from an asyncio loop. These two take the same arguments as
`kvrt.Producer` and `kvrt.Consumer` and offer the same operations as plain methods:

    producer = kvrt.blocking.Producer(bind="tcp://0.0.0.0:5555", device="cuda:0")
    producer.insert(input_tokens, roi, key, value, hidden)       # returns once buffered

    with kvrt.blocking.Consumer(connect=producer.endpoint, device="cuda:0") as consumer:
        item = consumer.drop_select(input_tokens, roi, timeout=0.0)

Who runs what: each object owns one thread, named after it ("kvrt-producer",
"kvrt-consumer"), that runs an asyncio event loop with the async producer or consumer in
it, reached through anyio's `BlockingPortal`. A method hands its call to that loop and
blocks the calling thread until the call returns; any number of threads may call at once
(their calls are in flight together, as `asyncio.gather` would have them). The thread
starts in the constructor, which returns once the producer is bound (`endpoint` is known)
or the consumer has its handshake; the constructor raises what `start()` would.

Errors, timeouts and results are those of the async API, raised in the calling thread.
`close()` (or leaving the `with` block), from any thread, ends every call still waiting
with `ClosedError`, then stops the thread; it returns within `CLOSE_TIMEOUT_S` whatever
the peers do, and a second `close()` returns once the first is done. A call made after
`close()` raises `ClosedError`. An object dropped without `close()` is closed when it is
garbage-collected, or at interpreter exit. A thread interrupted while it waits (Ctrl-C)
cancels its own call, as cancelling a task would.

CUDA streams: `stream=` defaults to the current stream of the calling thread (on the
object's device), captured there before the call crosses to kvrt's thread, whose current
stream is not the engine's (`kvrt._caller_stream`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Self, TypeVar

import torch

from kvrt import _client, _consumer, _producer
from kvrt._caller_stream import caller_stream
from kvrt._errors import ClosedError, KVRTError, KVRTTimeoutError
from kvrt._item import KVItem
from kvrt._loop_thread import CLOSE_TIMEOUT_S, LoopThread
from kvrt._messages import Evicted, ItemList, Probed, ProbeReply, StatsReply
from kvrt._producer import ProducerStats
from kvrt._signatures import takes
from kvrt._streams import ConsumerStream as _AsyncConsumerStream
from kvrt._streams import ProducerStream as _AsyncProducerStream

if TYPE_CHECKING:
    from kvrt._consumer import ConsumerCounters

log = logging.getLogger("kvrt.blocking")

_T = TypeVar("_T")
_P = ParamSpec("_P")
_Service = TypeVar("_Service", _producer.Producer, _consumer.Consumer, _client.Client)


def _close(loop: LoopThread, service: _producer.Producer | _consumer.Consumer | _client.Client) -> None:
    """Close `service` on its loop (its byes, every pending call ended), then stop the loop."""
    try:
        loop.call(service.aclose, "close", timeout_s=CLOSE_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        log.warning("closing did not finish within %s s; what was left is cancelled", CLOSE_TIMEOUT_S)
    except KVRTError:
        pass  # closed already
    finally:
        loop.stop()


def _finalize(loop: LoopThread, service: _producer.Producer | _consumer.Consumer | _client.Client) -> None:
    """Close an object that was dropped without `close()`. The garbage collector may run this
    on kvrt's loop thread itself, which cannot wait for its own loop: a thread does it then."""
    if loop.on_this_thread:
        threading.Thread(target=_close, args=(loop, service), name="kvrt-close", daemon=True).start()
    else:
        _close(loop, service)


class _Blocking(Generic[_Service]):
    """What both sides share: the loop thread, calls through it, and close."""

    _what: str

    def __init__(self, start: Callable[[], Awaitable[_Service]], thread_name: str) -> None:
        self._loop = LoopThread(thread_name, self._what)
        try:
            self._service: _Service = self._loop.call(start, f"starting the {self._what}")
        except BaseException:
            self._loop.stop()
            raise
        self._closing = threading.Lock()
        self._closed = False
        self._finalizer: weakref.finalize[..., _Blocking[_Service]] = weakref.finalize(
            self, _finalize, self._loop, self._service
        )

    @property
    def device(self) -> torch.device:
        return self._service.device

    def _call(self, function: Callable[_P, Awaitable[_T]], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`function(*args, **kwargs)` awaited on kvrt's loop; its result in this thread."""
        what = getattr(function, "__name__", "call")
        if self._closed:
            raise ClosedError(f"{what}: the {self._what} is closed")
        return self._loop.call(functools.partial(function, *args, **kwargs), what)

    def _read(self, function: Callable[[], _T]) -> _T:
        """`function()` run on kvrt's loop (what it reads is the loop's to change)."""

        async def read() -> _T:
            return function()

        read.__name__ = getattr(function, "__name__", "read")
        return self._call(read)

    def _stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream | None:
        """The calling thread's stream for this object's device (see the module docstring)."""
        return caller_stream(stream, self.device)

    def _streamed(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A call's keyword arguments with `stream=` the calling thread's (see `_stream`)."""
        return {**kwargs, "stream": self._stream(kwargs.get("stream"))}

    def close(self) -> None:
        """End every call still waiting with `ClosedError`, say bye to the peers, stop the
        thread. From any thread; idempotent; returns within `CLOSE_TIMEOUT_S`."""
        if self._loop.on_this_thread:
            raise KVRTError("close: called on kvrt's own loop thread; use the async API there")
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._finalizer.detach()
            _close(self._loop, self._service)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Producer(_Blocking[_producer.Producer]):
    """`kvrt.Producer` for synchronous callers (see the module docstring): the same
    arguments, started by the constructor, the same operations as plain methods."""

    _what = "producer"

    @takes(_producer.Producer.__init__)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        async def start() -> _producer.Producer:
            return await _producer.Producer(*args, **kwargs).start()

        super().__init__(start, "kvrt-producer")
        self.endpoint: str = self._service.endpoint
        """The address actually bound (with the real port when `bind` asked for port 0)."""
        self.buffer_bytes: int = self._service.buffer_bytes

    @takes(_producer.Producer.insert)
    def insert(self, *args: Any, **kwargs: Any) -> None:
        """`kvrt.Producer.insert`: returns once the item is buffered, waiting while the buffer
        is full (`timeout` bounds that wait)."""
        self._call(self._service.insert, *args, **self._streamed(kwargs))

    @takes(_producer.Producer.register_pools)
    def register_pools(self, *args: Any, **kwargs: Any) -> None:
        """`kvrt.Producer.register_pools`."""
        self._read(functools.partial(self._service.register_pools, *args, **kwargs))

    @takes(_producer.Producer.publish)
    def publish(self, *args: Any, **kwargs: Any) -> None:
        """`kvrt.Producer.publish`: a finished prefill from the registered pools."""
        self._call(self._service.publish, *args, **self._streamed(kwargs))

    @takes(_producer.Producer.open_stream)
    def open_stream(self, *args: Any, **kwargs: Any) -> ProducerStream:
        """`kvrt.Producer.open_stream`: a prefill that publishes its KV layer by layer."""
        return ProducerStream(self, self._call(self._service.open_stream, *args, **self._streamed(kwargs)))

    def stats(self) -> ProducerStats:
        """`kvrt.Producer.stats`: a snapshot of what the producer holds and has done."""
        return self._read(self._service.stats)

    def refusals(self) -> dict[str, int]:
        """`kvrt.Producer.refusals`: error replies sent so far, by error code."""
        return self._read(self._service.refusals)


class ProducerStream:
    """`kvrt.ProducerStream` for synchronous callers, made by `Producer.open_stream`."""

    def __init__(self, owner: Producer, stream: _AsyncProducerStream) -> None:
        self._owner = owner
        self._stream = stream
        self.layers = stream.layers
        self.tokens = stream.tokens

    @property
    def published(self) -> int:
        """Layers published so far."""
        return self._stream.published

    @takes(_AsyncProducerStream.put_layer)
    def put_layer(self, *args: Any, **kwargs: Any) -> None:
        """`kvrt.ProducerStream.put_layer`: publish the next layer."""
        self._owner._call(self._stream.put_layer, *args, **self._owner._streamed(kwargs))

    @takes(_AsyncProducerStream.put_layers)
    def put_layers(self, *args: Any, **kwargs: Any) -> None:
        """`kvrt.ProducerStream.put_layers`: publish the next layers, which the pools hold already."""
        self._owner._call(self._stream.put_layers, *args, **self._owner._streamed(kwargs))

    @takes(_AsyncProducerStream.finish)
    def finish(self, *args: Any, **kwargs: Any) -> None:
        """`kvrt.ProducerStream.finish`: end the stream after its last layer."""
        self._owner._call(self._stream.finish, *args, **self._owner._streamed(kwargs))

    @takes(_AsyncProducerStream.abort)
    def abort(self, *args: Any, **kwargs: Any) -> None:
        """`kvrt.ProducerStream.abort`: fail the stream; its reader gets StreamAbortedError."""
        self._owner._call(self._stream.abort, *args, **kwargs)


class Consumer(_Blocking[_consumer.Consumer]):
    """`kvrt.Consumer` for synchronous callers (see the module docstring): the same
    arguments, connected by the constructor, the same operations as plain methods."""

    _what = "consumer"

    @takes(_consumer.Consumer.__init__)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        async def start() -> _consumer.Consumer:
            return await _consumer.Consumer(*args, **kwargs).start()

        super().__init__(start, "kvrt-consumer")

    @property
    def endpoints(self) -> list[str]:
        return self._service.endpoints

    @property
    def transports(self) -> dict[str, str | None]:
        """`kvrt.Consumer.transports`: per producer endpoint, the transport its items travel over."""
        return self._read(lambda: self._service.transports)

    @property
    def pending_requests(self) -> int:
        """Calls waiting for an answer."""
        return self._read(lambda: self._service.pending_requests)

    @property
    def counters(self) -> ConsumerCounters:
        """What this consumer received and what failed, since start (a copy)."""

        def snapshot() -> ConsumerCounters:
            counters = self._service.counters
            return type(counters)(counters.items, counters.bytes, dict(counters.errors))

        return self._read(snapshot)

    @takes(_consumer.Consumer.drop_select)
    def drop_select(self, *args: Any, **kwargs: Any) -> KVItem | None:
        """`kvrt.Consumer.drop_select`: the best match, or None; `timeout` is how long to wait
        for one to be inserted (0 answers at once, None waits until one is or either side closes);
        `into`, the caller's buffers to land it in; `heads`, only that range of its KV heads."""
        return self._call(self._service.drop_select, *args, **self._streamed(kwargs))

    @takes(_consumer.Consumer.drop_select_many)
    def drop_select_many(self, *args: Any, **kwargs: Any) -> list[KVItem | None]:
        """`kvrt.Consumer.drop_select_many`: several lookups answered at once (`into`: buffers per query)."""
        return self._call(self._service.drop_select_many, *args, **self._streamed(kwargs))

    @takes(_consumer.Consumer.pull)
    def pull(self, *args: Any, **kwargs: Any) -> KVItem | None:
        """`kvrt.Consumer.pull`: take a published prefill and write it into `into` at `slots`."""
        return self._call(self._service.pull, *args, **self._streamed(kwargs))

    @takes(_consumer.Consumer.open_stream)
    def open_stream(self, *args: Any, **kwargs: Any) -> ConsumerStream | None:
        """`kvrt.Consumer.open_stream`: a request's KV layer by layer; None on a miss."""
        opened = self._call(self._service.open_stream, *args, **self._streamed(kwargs))
        return None if opened is None else ConsumerStream(self, opened)

    @takes(_consumer.Consumer.fetch)
    def fetch(self, *args: Any, **kwargs: Any) -> Fetch:
        """`kvrt.Consumer.fetch`: a step's requests into pools, started; returns at once, without
        waiting for kvrt's thread (the second phase: `Fetch.landed`). What it refuses is raised
        by `landed`."""
        if self._closed:
            raise ClosedError(f"fetch: the {self._what} is closed")
        service, kwargs = self._service, self._streamed(kwargs)

        async def start() -> _consumer.Fetch:
            return service.fetch(*args, **kwargs)

        return Fetch(self, self._loop.post(start, "fetch"))


class Fetch:
    """`kvrt.Fetch` for synchronous callers, made by `Consumer.fetch`."""

    def __init__(self, owner: Consumer, started: concurrent.futures.Future[_consumer.Fetch]) -> None:
        self._owner = owner
        self._started = started

    def landed(self, timeout: float | None = None) -> list[int]:
        """`kvrt.Fetch.landed`: per query, the tokens its item matched, once every item was
        written; waits `timeout` seconds at most (None: until the fetch ends, which its own
        timeouts bound), then raises `KVRTTimeoutError` and the fetch goes on."""
        try:
            started = self._started.result(timeout)
        except concurrent.futures.TimeoutError:
            raise KVRTTimeoutError(f"fetch: not started within {timeout} s", phase="reply") from None

        async def landed() -> list[int]:
            return await started.landed()

        try:
            return self._owner._loop.call(landed, "landed", timeout_s=timeout)
        except concurrent.futures.TimeoutError:
            raise KVRTTimeoutError(f"fetch: its items did not land within {timeout} s", phase="transfer") from None

    def done(self) -> bool:
        """Whether `landed` would return (or raise) at once."""
        started = self._started
        return started.done() and (started.exception() is not None or started.result().done())

    def cancel(self) -> None:
        """`kvrt.Fetch.cancel`: items whose bytes had not come go back to their producer."""
        started = self._started

        async def cancel() -> None:
            (await asyncio.wrap_future(started)).cancel()

        self._owner._loop.post(cancel, "cancel")


class ConsumerStream:
    """`kvrt.ConsumerStream` for synchronous callers, made by `Consumer.open_stream`."""

    def __init__(self, owner: Consumer, stream: _AsyncConsumerStream) -> None:
        self._owner = owner
        self._stream = stream
        self.input_tokens = stream.input_tokens
        self.roi = stream.roi
        self.matched = stream.matched
        self.layers = stream.layers

    @takes(_AsyncConsumerStream.layer)
    def layer(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """`kvrt.ConsumerStream.layer`: layer `index`'s key and value once it arrived; on a GPU
        `stream` (None: the calling thread's current stream) waits for its landing."""
        return self._owner._call(_layer, self._stream, *args, **self._owner._streamed(kwargs))

    def layer_event(self, index: int) -> torch.cuda.Event | None:
        """`kvrt.ConsumerStream.layer_event`."""
        return self._owner._call(self._stream.layer_event, index)

    def finished(self) -> torch.Tensor | None:
        """Wait for the end of the stream; its hidden states (None if the item has none)."""
        return self._owner._call(self._stream.finished)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Each layer in order; the loop ends once the stream is `finished()` (see
        `kvrt.ConsumerStream.__aiter__`)."""
        for index in range(self.layers):
            key, value = self.layer(index)
            yield index, key, value
        self.finished()


class Client(_Blocking[_client.Client]):
    """`kvrt.Client` for synchronous callers (a scheduler, a router): the same arguments,
    connected by the constructor, the same questions as plain methods. It never takes an item."""

    _what = "client"

    @takes(_client.Client.__init__)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        async def start() -> _client.Client:
            return await _client.Client(*args, **kwargs).start()

        super().__init__(start, "kvrt-client")
        self.endpoint: str = self._service.endpoint

    @takes(_client.Client.probe)
    def probe(self, *args: Any, **kwargs: Any) -> ProbeReply:
        """`kvrt.Client.probe`: what a drop_select with these tokens would take, without taking it."""
        return self._call(self._service.probe, *args, **kwargs)

    @takes(_client.Client.probe_many)
    def probe_many(self, *args: Any, **kwargs: Any) -> list[Probed]:
        """`kvrt.Client.probe_many`: a probe for each query, in one message."""
        return self._call(self._service.probe_many, *args, **kwargs)

    def stats(self) -> StatsReply:
        """`kvrt.Client.stats`."""
        return self._call(self._service.stats)

    @takes(_client.Client.list_items)
    def list_items(self, *args: Any, **kwargs: Any) -> ItemList:
        """`kvrt.Client.list_items`."""
        return self._call(self._service.list_items, *args, **kwargs)

    @takes(_client.Client.evict)
    def evict(self, *args: Any, **kwargs: Any) -> Evicted:
        """`kvrt.Client.evict`: drop a buffered item; `NotFoundError` if it is not buffered."""
        return self._call(self._service.evict, *args, **kwargs)


async def _layer(
    source: _AsyncConsumerStream, index: int, *, stream: torch.cuda.Stream | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer of `source` for a caller on another thread: `stream` waits for its landing, and
    for what the loop's thread queued on its own stream for it (a layer that came as frames)."""
    key, value = await source.layer(index, stream=stream)
    if stream is not None and key.device.type == "cuda":
        stream.wait_stream(torch.cuda.current_stream(key.device))
    return key, value


__all__ = ["CLOSE_TIMEOUT_S", "Client", "Consumer", "ConsumerStream", "Producer", "ProducerStream"]
