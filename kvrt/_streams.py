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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import torch

from kvrt._buffer import BufferedItem
from kvrt._errors import InvalidInputError, KVRTError, RemoteProtocolError
from kvrt._tensors import copy_into

if TYPE_CHECKING:
    from kvrt._producer import Producer


class StreamAbortedError(KVRTError):
    """The prefill behind a stream failed; what arrived of it is void."""


class ConsumerStream:
    """One request's KV arriving layer by layer. Created by `Consumer.open_stream`."""

    def __init__(
        self, input_tokens: torch.Tensor, roi: torch.Tensor | None, matched: int, layers: int,
        confirm: Callable[[], None],
    ) -> None:  # fmt: skip
        self.input_tokens = input_tokens
        self.roi = roi
        self.matched = matched
        self.layers = layers
        self._confirm = confirm
        loop = asyncio.get_running_loop()
        self._layers: list[asyncio.Future[_Layer]] = [loop.create_future() for _ in range(layers)]
        self._end: asyncio.Future[torch.Tensor | None] = loop.create_future()
        self._error: KVRTError | None = None
        self.arriving: asyncio.Future[list[torch.Tensor]] | None = None
        """Out-of-band links: the receive posted last for this stream (receives land in the
        order they were posted, so its landing is the landing of everything before it)."""

    # -- what the link calls, in arrival order ------------------------------------------

    def deliver_layer(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, landed: torch.cuda.Event | None = None
    ) -> None:
        """Layer `layer` is here (or, with `landed`, will be once that event fired)."""
        if 0 <= layer < self.layers and not self._layers[layer].done():
            self._layers[layer].set_result((key, value, landed))

    def finish(self, hidden: torch.Tensor | None) -> None:
        if not self._end.done():
            for index, future in enumerate(self._layers):
                if not future.done():  # a producer that ended early: nobody may wait for ever
                    future.set_exception(RemoteProtocolError(f"the stream ended without layer {index}"))
                    future.exception()
            self._end.set_result(hidden)
            self._confirm()

    def fail(self, error: KVRTError) -> None:
        """End the stream with `error`; the layers already received are dropped."""
        self._error = error
        for index, future in enumerate(self._layers):
            if future.done() and not future.cancelled() and future.exception() is None:
                self._layers[index] = asyncio.get_running_loop().create_future()  # release the tensors
            if not self._layers[index].done():
                self._layers[index].set_exception(error)
                self._layers[index].exception()  # retrieved: nobody may wait on every layer
        if not self._end.done():
            self._end.set_exception(error)
            self._end.exception()

    # -- what the caller uses -------------------------------------------------------------

    async def layer(self, index: int, *, stream: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s key and value, [tokens, heads, head_dim] each, once it arrived; on a
        GPU, once its receive is posted, with `stream` (default: the current one) made to wait
        for its landing."""
        if not 0 <= index < self.layers:
            raise IndexError(f"layer {index} of a stream of {self.layers}")
        key, value, landed = await asyncio.shield(self._layers[index])  # a cancelled waiter leaves it to others
        if landed is not None:
            (stream if stream is not None else torch.cuda.current_stream(key.device)).wait_event(landed)
        return key, value

    async def finished(self) -> torch.Tensor | None:
        """Wait for the end of the stream; its hidden states (None if the item has none)."""
        return await asyncio.shield(self._end)

    async def __aiter__(self) -> AsyncIterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for index in range(self.layers):
            key, value = await self.layer(index)
            yield index, key, value


_Layer = tuple[torch.Tensor, torch.Tensor, "torch.cuda.Event | None"]
"""A delivered layer: key, value, and (GPU) the event of its landing."""


class ProducerStream:
    """A prefill publishing one request's KV layer by layer. Created by `Producer.open_stream`."""

    def __init__(self, producer: Producer, item: BufferedItem, layers: int, tokens: int) -> None:
        self._producer = producer
        self._item = item
        self.layers = layers
        self.tokens = tokens
        self.published = 0
        self._ended = False

    async def put_layer(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Publish the next layer, [tokens, heads, head_dim] each; copied before this returns
        (on a GPU producer: the copy queued on the current stream, which is not made to wait;
        the caller may overwrite its tensors in later work on that stream)."""
        if self._ended:
            raise InvalidInputError("the stream has ended")
        if self.published == self.layers:
            raise InvalidInputError(f"all {self.layers} layers were published already")
        for name, tensor in (("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 or tensor.shape[0] != self.tokens:
                raise InvalidInputError(f"put_layer: {name} must be [tokens={self.tokens}, heads, head_dim]")
        self.published += 1
        await self._producer._stream_layer(self._item, *_owned(key, value, self._producer.device))

    async def finish(self, hidden: torch.Tensor | None = None) -> None:
        """End the stream after its last layer; `hidden` [tokens, hidden] travels with the end."""
        if self.published != self.layers:
            raise InvalidInputError(f"finish after {self.published} of {self.layers} layers: publish them all")
        if hidden is not None and (hidden.dim() != 2 or hidden.shape[0] != self.tokens):
            raise InvalidInputError(f"finish: hidden must be [tokens={self.tokens}, hidden]")
        self._ended = True
        await self._producer._finish_stream(self._item, hidden)

    async def abort(self, reason: str = "the prefill failed") -> None:
        """Fail the stream: its reader gets `StreamAbortedError`; what it published is dropped."""
        if not self._ended:
            self._ended = True
            await self._producer._abort_stream(self._item, reason)


def _owned(
    key: torch.Tensor, value: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
    """A layer's own copy on the producer's device. On a GPU: one block [2, ...] when key and
    value are alike, so that the layer travels as one transfer without packing, copied on the
    current stream, and the event after the copy."""
    if device.type != "cuda":
        return key.detach().cpu().contiguous().clone(), value.detach().cpu().contiguous().clone(), None
    with torch.cuda.device(device):
        if key.shape == value.shape and key.dtype == value.dtype:
            block = torch.empty((2, *key.shape), dtype=key.dtype, device=device)
            own_key, own_value = block[0], block[1]
        else:
            own_key = torch.empty(key.shape, dtype=key.dtype, device=device)
            own_value = torch.empty(value.shape, dtype=value.dtype, device=device)
        copy_into(own_key, key)  # a pinned host source is copied before this returns
        copy_into(own_value, value)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
    return own_key, own_value, ready
