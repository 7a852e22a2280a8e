"""Layer-wise streams: decode reads layer i while prefill still computes layer i+1.

Producer side (`Producer.open_stream`): a prefill opens a stream for its request as it
starts, publishes each layer as it is written (`put_layer`), and ends it (`finish`) or
fails it (`abort`). A consumer can take the stream at any point: it gets every layer
published so far at once, then each new one as it comes. A stream nobody took by its end
becomes an ordinary item that `drop_select` can take.

Consumer side (`Consumer.open_stream`): `await stream.layer(i)`, or `async for layer, key,
value in stream`, while later layers are still in flight; `await stream.finished()` gives the
hidden states. If the prefill aborts, every wait raises `StreamAbortedError` and the layers
already received are dropped.

On GPUs (a GPU producer, a consumer paired over NCCL) no host waits for a layer: `put_layer`
copies it on the prefill's current stream and records an event there; the layer's send,
queued at once on kvrt's send stream, waits for that event on the GPU, and the consumer
posted its receive when the layer's header came, long before the prefill wrote it. So the
transfer starts when the layer is written. `layer(i)` returns as soon as the receive is
posted and makes the caller's current stream (or the one it names) wait for the landing:
decode work queued after it reads the layer, and the host never waited for the wire.

Paged pools, on either side or both: a prefill that writes its KV into registered pools opens
its stream with the request's slots (`Producer.open_stream(..., slots=)`), and `put_layer()`
gathers each layer from them; a reader that opens the stream with its own pools and slots
(`Consumer.open_stream(..., into=, slots=)`) has each layer written there as it lands (a
`PoolWriter`), and `layer(i)` then stands for the write.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvrt._caller_stream import on_caller_stream
from kvrt._errors import InvalidInputError, KVRTError, RemoteProtocolError
from kvrt._item_bytes import TensorsSum
from kvrt._pools import PoolTable
from kvrt._protocol.lookup_buffer import BufferedItem
from kvrt._tensors import copy_into
from kvrt._threads import launch_on


class StreamingProducer(Protocol):
    """What a `ProducerStream` asks of the producer part that opened it (`kvrt._producer`'s
    `StreamPublisher`): this module names no driver, so that the drivers depend on it, not it on them."""

    @property
    def device(self) -> torch.device: ...

    def gather_thread(self) -> concurrent.futures.ThreadPoolExecutor: ...

    async def gathered_layer(
        self, placement: Placement, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]: ...

    async def gathered_layers(
        self, placement: Placement, layers: range
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]]: ...

    async def stream_layer(
        self, item: BufferedItem, key: torch.Tensor, value: torch.Tensor, ready: torch.cuda.Event | None
    ) -> None: ...

    async def finish_stream(self, item: BufferedItem, hidden: torch.Tensor | None) -> None: ...

    async def abort_stream(self, item: BufferedItem, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request sits in a node's paged pools: token i at `slots[i]` of replica
    `replicas[i]`, both checked and on the pools' device."""

    pools: PoolTable
    replicas: torch.Tensor
    slots: torch.Tensor


class PoolWriter:
    """Where a reader of the pools (`Consumer.open_stream(..., into=)`) writes each layer that
    lands: into its pools at its slots. On a GPU the write is queued by a kvrt thread (a first
    launch compiles, for about a second; the loop must not wait for that) on a stream of the
    consumer's own, after the landing; the reader's stream waits for the write, never the host.
    """

    def __init__(
        self,
        placement: Placement,
        thread: Callable[[], concurrent.futures.Executor],
        stream: Callable[[], torch.cuda.Stream],
        indexes_ready: torch.cuda.Event | None,
        *,
        skip: int = 0,
        heads: tuple[int, int] | None = None,
    ) -> None:
        self.placement = placement
        self._thread = thread
        self._stream = stream
        self._indexes_ready = indexes_ready
        """GPU: the caller's stream may still be writing the slots when it opened the stream."""
        self.skip = skip
        """The first tokens of each layer, which the caller holds already: not written."""
        self.heads = heads
        """Which heads of the pools a layer's heads land in (None: all of them)."""
        self._queued: list[asyncio.Future[torch.cuda.Event | None]] = []
        """Every write handed to the scatter thread (GPU): what `written` waits for."""

    async def written(self, stream: torch.cuda.Stream | None) -> None:
        """`stream` (GPU) waits for every write queued so far, whatever became of its layer."""
        done = await asyncio.gather(*(asyncio.shield(future) for future in self._queued), return_exceptions=True)
        for event in done:
            if stream is not None and isinstance(event, torch.cuda.Event):
                stream.wait_event(event)

    def write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, landed: torch.cuda.Event | None
    ) -> asyncio.Future[torch.cuda.Event | None]:
        """Write layer `layer` (its tokens from `skip` on, as many as there are slots) into the
        pools; the future gives the event after the write (GPU)."""
        from kvrt.kernels.paged_kv import scatter_layer_from_any

        pools = self.placement.pools
        if pools.device.type != "cuda":
            written: asyncio.Future[torch.cuda.Event | None] = asyncio.get_running_loop().create_future()
            try:
                scatter_layer_from_any(
                    pools, *self._rows(key, value), *self._indexes(key), layer, heads=self.heads
                )
            except Exception as exc:
                written.set_exception(exc)
            else:
                written.set_result(None)
            return written
        if landed is None:  # it came as frames: copied to the device on this thread's stream
            landed = torch.cuda.Event()
            landed.record(torch.cuda.current_stream(pools.device))
        queued: asyncio.Future[torch.cuda.Event | None] = asyncio.wrap_future(
            self._thread().submit(self._queue_write, layer, key, value, landed)
        )
        self._queued.append(queued)
        return queued

    def write_all(
        self, key: torch.Tensor, value: torch.Tensor, landed: torch.cuda.Event | None
    ) -> asyncio.Future[torch.cuda.Event | None]:
        """Write every layer of a whole item (K and V [layers, tokens, heads, head_dim], as it
        arrived in one transfer) into the pools: one launch on a GPU, after `landed`; the
        future gives the event after the write (GPU)."""
        from kvrt.kernels.paged_kv import scatter_from_any

        pools = self.placement.pools
        replicas, slots = self._indexes(key[0])
        key, value = self._rows_of_all(key, value)
        if pools.device.type != "cuda":
            written: asyncio.Future[torch.cuda.Event | None] = asyncio.get_running_loop().create_future()
            try:
                scatter_from_any(pools, key, value, replicas, slots, heads=self.heads)
            except Exception as exc:
                written.set_exception(exc)
            else:
                written.set_result(None)
            return written
        if landed is None:
            landed = torch.cuda.Event()
            landed.record(torch.cuda.current_stream(pools.device))
        queued: asyncio.Future[torch.cuda.Event | None] = asyncio.wrap_future(
            self._thread().submit(self._queue_write_all, key, value, replicas, slots, landed)
        )
        self._queued.append(queued)
        return queued

    def _queue_write_all(
        self, key: torch.Tensor, value: torch.Tensor, replicas: torch.Tensor, slots: torch.Tensor,
        landed: torch.cuda.Event,
    ) -> torch.cuda.Event:  # fmt: skip
        from kvrt.kernels.paged_kv import scatter_from

        stream = self._stream()
        with torch.cuda.stream(stream):
            if self._indexes_ready is not None:
                stream.wait_event(self._indexes_ready)
            stream.wait_event(landed)
            for tensor in (key, value, replicas, slots):
                tensor.record_stream(stream)
            scatter_from(self.placement.pools, key, value, replicas, slots, heads=self.heads, check=False)
            written = torch.cuda.Event()
            written.record(stream)
        return written

    def _rows_of_all(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole item's key and value from token `skip` on (a latent's empty value as it is)."""
        if not self.skip:
            return key, value
        return key[:, self.skip :], value if value.numel() == 0 else value[:, self.skip :]

    def _queue_write(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, landed: torch.cuda.Event
    ) -> torch.cuda.Event:
        from kvrt.kernels.paged_kv import scatter_layer_from

        stream = self._stream()
        replicas, slots = self._indexes(key)
        with torch.cuda.stream(stream):
            if self._indexes_ready is not None:
                stream.wait_event(self._indexes_ready)
            stream.wait_event(landed)
            for tensor in (key, value, replicas, slots):
                tensor.record_stream(stream)  # freed by their owners while the write may still run
            scatter_layer_from(
                self.placement.pools, *self._rows(key, value), replicas, slots, layer, heads=self.heads, check=False
            )
            written = torch.cuda.Event()
            written.record(stream)
        return written

    def _rows(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's key and value from token `skip` on (value stays whole for a latent: it is empty)."""
        if not self.skip:
            return key, value
        return key[self.skip :], value if value.numel() == 0 else value[self.skip :]

    def _indexes(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The replica and slot indexes of the tokens both the layer (from `skip` on) and the
        slots have."""
        count = max(0, min(key.shape[0] - self.skip, self.placement.slots.numel()))
        return self.placement.replicas[:count], self.placement.slots[:count]


class ConsumerStream:
    """One request's KV arriving layer by layer. Created by `Consumer.open_stream`."""

    def __init__(
        self, input_tokens: torch.Tensor, roi: torch.Tensor | None, matched: int, layers: int,
        confirm: Callable[[], KVRTError | None], writer: PoolWriter | None = None,
    ) -> None:  # fmt: skip
        self.input_tokens = input_tokens
        self.roi = roi
        self.matched = matched
        self.layers = layers
        self._confirm = confirm
        self.writer = writer
        """Set for a reader of the pools: each layer is written there before it is delivered."""
        self._writing: set[int] = set()
        """Layers whose write into the pools is under way: the end waits for their delivery."""
        self._posted: set[int] = set()
        """Layers whose receive was posted: each comes once."""
        self._end_waits: tuple[torch.Tensor | None] | None = None
        loop = asyncio.get_running_loop()
        self._layers: dict[int, asyncio.Future[_Layer]] = {}
        """Per layer delivered or waited for, its future (made as first needed: a stream of
        tens of thousands of layers costs nothing up front)."""
        self._delivered = 0
        """Layers delivered so far."""
        self._end: asyncio.Future[torch.Tensor | None] = loop.create_future()
        self._error: KVRTError | None = None
        self.sums: dict[int, TensorsSum] = {}
        """From a producer on a GPU, whose layers carry no checksum: per layer landed, its
        checksum being computed, for the stream's end to compare (`StreamEnd.layer_checksums`)."""
        self.arriving: asyncio.Future[list[torch.Tensor]] | None = None
        """Out-of-band links: the receive posted last for this stream (receives land in the
        order they were posted, so its landing is the landing of everything before it)."""

    # -- what the link calls, in arrival order ------------------------------------------

    def deliver_layer(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, landed: torch.cuda.Event | None = None
    ) -> None:
        """Layer `layer` is here (or, with `landed`, will be once that event fired)."""
        if 0 <= layer < self.layers and not (future := self._layer(layer)).done():
            future.set_result((key, value, landed))
            self._delivered += 1
        self._writing.discard(layer)
        if not self._writing and self._end_waits is not None:
            self.finish(*self._end_waits)

    def posting(self, layer: int) -> None:
        """Layer `layer`'s receive is being posted: a layer that came already is a protocol
        error (a second copy would replace what the reader may have, and its checksum)."""
        if not 0 <= layer < self.layers:
            raise RemoteProtocolError(f"stream_layer {layer} of a stream of {self.layers}")
        if layer in self._posted:
            raise RemoteProtocolError(f"layer {layer} of the stream came twice")
        self._posted.add(layer)

    def writing(self, layer: int) -> None:
        """Layer `layer`'s write into the pools is under way: the end waits for its delivery."""
        self._writing.add(layer)

    def _layer(self, index: int) -> asyncio.Future[_Layer]:
        """Layer `index`'s future (made now if nobody needed it yet; failed if the stream did)."""
        future = self._layers.get(index)
        if future is None:
            future = self._layers[index] = asyncio.get_running_loop().create_future()
            if self._error is not None:
                future.set_exception(self._error)
                future.exception()
        return future

    def every_layer_came(self) -> bool:
        """Whether every layer was delivered (only the end is still to come)."""
        return self._delivered == self.layers and not self._writing

    def first_missing_layer(self) -> int | None:
        """The first layer that neither came nor is being written (a layer message lost or
        misdirected on the way); None when every layer did."""
        return next(
            (
                index for index in range(self.layers)
                if not (index in self._layers and self._layers[index].done()) and index not in self._writing
            ),
            None,
        )  # fmt: skip

    def finish(self, hidden: torch.Tensor | None) -> None:
        if self._writing:  # every layer written is delivered before the end
            self._end_waits = (hidden,)
            return
        self._end_waits = None
        if not self._end.done():
            refused = self._confirm()
            if refused is not None:  # the link's lease ended: the stream may be another reader's
                self.fail(refused)
                return
            for index in range(self.layers):
                future = self._layer(index)
                if not future.done():  # a producer that ended early: nobody may wait for ever
                    future.set_exception(RemoteProtocolError(f"the stream ended without layer {index}"))
                    future.exception()
            self._end.set_result(hidden)

    def fail(self, error: KVRTError) -> None:
        """End the stream with `error`; the layers already received are dropped."""
        self._error = error
        for index, future in list(self._layers.items()):
            if future.done() and not future.cancelled() and future.exception() is None:
                del self._layers[index]  # release the tensors: a later wait gets the error
            elif not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: nobody may wait on every layer
        if not self._end.done():
            self._end.set_exception(error)
            self._end.exception()

    # -- what the caller uses -------------------------------------------------------------

    async def layer(self, index: int, *, stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s key and value, [tokens, heads, head_dim] each, once it arrived; on a
        GPU, once its receive is posted, with `stream` (default: the thread's current one
        when the layer is handed out; `kvrt.blocking` passes the engine thread's) made to wait
        for its landing. For a reader of the pools: once the layer is written there (GPU: once
        the write is queued, with `stream` made to wait for it)."""
        if not 0 <= index < self.layers:
            raise InvalidInputError(f"layer {index} of a stream of {self.layers}")
        key, value, landed = await asyncio.shield(self._layer(index))  # a cancelled waiter leaves it to others
        if landed is not None:
            (stream if stream is not None else torch.cuda.current_stream(key.device)).wait_event(landed)
        return key, value

    async def layer_event(self, index: int) -> torch.cuda.Event | None:
        """The CUDA event after which layer `index` can be read on the reader's GPU (its
        landing; for a reader of the pools, its write there), once its receive is posted
        (over cuda_ipc: once the producer wrote the layer, as its copy starts only then):
        for work that waits on it by other means than `layer(i, stream=)` (a CUDA graph's
        stream, another library's). None when the layer is already there (CPU, TCP)."""
        if not 0 <= index < self.layers:
            raise InvalidInputError(f"layer {index} of a stream of {self.layers}")
        _, _, landed = await asyncio.shield(self._layer(index))
        return landed

    async def finished(self) -> torch.Tensor | None:
        """Wait for the end of the stream; its hidden states (None if the item has none). The
        stream is this reader's once this returns: its end confirmed the item to the producer
        (and, from a producer on a GPU, every layer matched its checksum). A reader that
        leaves before, having read every layer, hands the stream to the next reader."""
        return await asyncio.shield(self._end)

    def landed_layers(self) -> list[torch.cuda.Event | None] | None:
        """Every layer's landing event (None: there, nothing to wait for), once every layer
        arrived (a finished item read whole arrives at once); None while one is still to come
        or failed. For a caller on another thread that then waits on the events itself, with
        no hop to the loop per layer. Called on the loop."""
        if self._error is not None or self._delivered != self.layers:
            return None
        return [self._layers[index].result()[2] for index in range(self.layers)]

    async def writes_done(self, *, stream: torch.cuda.Stream | None = None) -> None:
        """For a reader of the pools: `stream` (default: the current one) waits for every
        write into the pools this stream queued, also of layers a failure kept from being
        handed out. An engine that gives up a stream's pages (to recompute them) calls it
        before it writes them itself, so that no late write of kvrt's lands over its own."""
        if self.writer is None:
            return
        on = stream
        if on is None and self.writer.placement.pools.device.type == "cuda":
            on = torch.cuda.current_stream(self.writer.placement.pools.device)
        await self.writer.written(on)

    async def __aiter__(self) -> AsyncIterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Each layer in order, as `layer(i)`; the loop ends once the stream is `finished()`,
        not at its last layer: a reader that leaves right after its loop keeps what it read."""
        for index in range(self.layers):
            key, value = await self.layer(index)
            yield index, key, value
        await self.finished()


_Layer = tuple[torch.Tensor, torch.Tensor, "torch.cuda.Event | None"]
"""A delivered layer: key, value, and (GPU) the event of its landing."""


class ProducerStream:
    """A prefill publishing one request's KV layer by layer. Created by `Producer.open_stream`."""

    def __init__(
        self,
        producer: StreamingProducer,
        item: BufferedItem,
        layers: int,
        tokens: int,
        placement: Placement | None = None,
    ) -> None:
        self._producer = producer
        self._item = item
        self.layers = layers
        self.tokens = tokens
        self.placement = placement
        """Set for a stream of the registered pools (`open_stream(..., slots=)`): where its
        layers are read."""
        self.published = 0
        self._ended = False

    @property
    def device(self) -> torch.device:
        """The producer's device, where the layers' own copies live."""
        return self._producer.device

    @on_caller_stream
    async def put_layer(
        self,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Publish the next layer.

        A plain stream takes its key and value, [tokens, heads, head_dim] each, copied before
        this returns (on a GPU producer: the copy queued on `stream`, None meaning the caller's
        current stream, which is not made to wait; the caller may overwrite its tensors in
        later work on that stream).

        A stream of the pools takes none: the layer is gathered from the pools at the
        stream's slots, once the prefill wrote it (on a GPU: the gather queued on `stream`
        after the prefill's work there, which is not made to wait; the caller may overwrite
        those slots in later work on that stream)."""
        if self._ended:
            raise InvalidInputError("the stream has ended")
        if self.published == self.layers:
            raise InvalidInputError(f"all {self.layers} layers were published already")
        if self.placement is not None:
            if key is not None or value is not None:
                raise InvalidInputError("a stream of the pools gathers its layers there: put_layer() takes no tensors")
        else:
            for name, tensor in (("key", key), ("value", value)):
                if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 or tensor.shape[0] != self.tokens:
                    raise InvalidInputError(f"put_layer: {name} must be [tokens={self.tokens}, heads, head_dim]")
        layer = self.published
        try:
            if self.placement is not None:
                layer_tensors = await self._producer.gathered_layer(self.placement, layer)
            else:
                assert key is not None and value is not None
                layer_tensors = await _owned(key, value, self._producer.device, self._producer.gather_thread)
            self.published += 1
            await self._producer.stream_layer(self._item, *layer_tensors)
        except KVRTError:
            raise
        except Exception as exc:
            raise await self._failed_inside("put_layer", layer, exc) from exc

    @on_caller_stream
    async def put_layers(self, count: int | None = None, *, stream: torch.cuda.Stream | None = None) -> None:
        """Publish the next `count` layers (None: every layer left) of a stream of the pools
        whose pages hold them already (a prefill that publishes once its forward pass ended).
        They are gathered together, on the host in one hand-off to kvrt's gather thread rather
        than one a layer, then offered in order, each as `put_layer()` offers it; on a GPU the
        same as `put_layer()` `count` times. A plain stream takes its layers one by one with
        `put_layer(key, value)`."""
        if self._ended:
            raise InvalidInputError("the stream has ended")
        if self.placement is None:
            raise InvalidInputError("put_layers gathers from the pools: a plain stream publishes put_layer(key, value)")
        left = self.layers - self.published
        if left == 0:
            raise InvalidInputError(f"all {self.layers} layers were published already")
        wanted = left if count is None else count
        if type(wanted) is not int or not 1 <= wanted <= left:
            raise InvalidInputError(f"put_layers: count must be an int from 1 to the {left} layers left, not {count!r}")
        layer = self.published
        try:
            gathered = await self._producer.gathered_layers(self.placement, range(layer, layer + wanted))
            for layer_tensors in gathered:
                self.published += 1
                await self._producer.stream_layer(self._item, *layer_tensors)
                layer += 1
        except KVRTError:
            raise
        except Exception as exc:
            raise await self._failed_inside("put_layers", layer, exc) from exc

    async def _failed_inside(self, call: str, layer: int, exc: Exception) -> KVRTError:
        """Something of kvrt's own broke as a layer went out (a bug, an error no boundary
        translated): the prefill gets one of kvrt's errors, and the stream's reader fails now
        instead of waiting for a layer that will not come."""
        why = f"publishing layer {layer} failed inside kvrt ({type(exc).__name__}: {exc})"
        with contextlib.suppress(Exception):
            await self.abort(why)
        return KVRTError(f"{call}: {why}; the stream was aborted")

    @on_caller_stream
    async def finish(self, hidden: torch.Tensor | None = None, *, stream: torch.cuda.Stream | None = None) -> None:
        """End the stream after its last layer; `hidden` [tokens, hidden] travels with the end
        (on a GPU copied on `stream`, None meaning the caller's current stream)."""
        if self.published != self.layers:
            raise InvalidInputError(f"finish after {self.published} of {self.layers} layers: publish them all")
        if hidden is not None and (hidden.dim() != 2 or hidden.shape[0] != self.tokens):
            raise InvalidInputError(f"finish: hidden must be [tokens={self.tokens}, hidden]")
        self._ended = True
        await self._producer.finish_stream(self._item, hidden)

    async def abort(self, reason: str = "the prefill failed") -> None:
        """Fail the stream: its reader gets `StreamAbortedError`; what it published is dropped."""
        if not self._ended:
            self._ended = True
            await self._producer.abort_stream(self._item, reason)


async def _owned(
    key: torch.Tensor, value: torch.Tensor, device: torch.device, thread: Callable[[], concurrent.futures.Executor]
) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
    """A layer's own copy on the producer's device. On a GPU: one block [2, ...] when key and
    value are alike, so that the layer travels as one transfer without packing, copied on the
    current stream, and the event after the copy. Key and value on the GPU whose tokens' rows
    are contiguous (views of a wider output too) are copied by one kernel launch
    (`kvrt.kernels.layer_copy`); its first launch compiles, for about a second, in `thread`."""
    if device.type != "cuda":
        return key.detach().cpu().contiguous().clone(), value.detach().cpu().contiguous().clone(), None
    with torch.cuda.device(device):
        caller = torch.cuda.current_stream(device)
        if key.shape == value.shape and key.dtype == value.dtype:
            block = torch.empty((2, *key.shape), dtype=key.dtype, device=device)
            own_key, own_value = block[0], block[1]
            if _one_launch(key, value, device):
                from kvrt.kernels.layer_copy import PreparedCopy

                await launch_on(PreparedCopy(block, key, value), caller, thread)
            else:
                copy_into(own_key, key)  # a pinned host source is copied before this returns
                copy_into(own_value, value)
        else:
            own_key = torch.empty(key.shape, dtype=key.dtype, device=device)
            own_value = torch.empty(value.shape, dtype=value.dtype, device=device)
            copy_into(own_key, key)
            copy_into(own_value, value)
        ready = torch.cuda.Event()
        ready.record(caller)
    return own_key, own_value, ready


def _one_launch(key: torch.Tensor, value: torch.Tensor, device: torch.device) -> bool:
    from kvrt.kernels.layer_copy import rows_contiguous

    return key.device == device and value.device == device and rows_contiguous(key) and rows_contiguous(value)
