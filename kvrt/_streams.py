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
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import torch

from kvrt._buffer import BufferedItem
from kvrt._errors import InvalidInputError, KVRTError

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
        self._layers: list[asyncio.Future[tuple[torch.Tensor, torch.Tensor]]] = [
            loop.create_future() for _ in range(layers)
        ]
        self._end: asyncio.Future[torch.Tensor | None] = loop.create_future()
        self._error: KVRTError | None = None

    # -- what the link calls, in arrival order ------------------------------------------

    def deliver_layer(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if 0 <= layer < self.layers and not self._layers[layer].done():
            self._layers[layer].set_result((key, value))

    def finish(self, hidden: torch.Tensor | None) -> None:
        if not self._end.done():
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

    async def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s key and value, [tokens, heads, head_dim] each, once it arrived."""
        if not 0 <= index < self.layers:
            raise IndexError(f"layer {index} of a stream of {self.layers}")
        return await asyncio.shield(self._layers[index])  # a cancelled waiter leaves the layer to others

    async def finished(self) -> torch.Tensor | None:
        """Wait for the end of the stream; its hidden states (None if the item has none)."""
        return await asyncio.shield(self._end)

    async def __aiter__(self) -> AsyncIterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for index in range(self.layers):
            key, value = await self.layer(index)
            yield index, key, value


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
        """Publish the next layer, [tokens, heads, head_dim] each; copied before this returns."""
        if self._ended:
            raise InvalidInputError("the stream has ended")
        if self.published == self.layers:
            raise InvalidInputError(f"all {self.layers} layers were published already")
        for name, tensor in (("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3 or tensor.shape[0] != self.tokens:
                raise InvalidInputError(f"put_layer: {name} must be [tokens={self.tokens}, heads, head_dim]")
        self.published += 1
        await self._producer._stream_layer(self._item, _owned(key), _owned(value))

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


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().clone()
