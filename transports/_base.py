"""The transport interface: how one delivered item's tensors get from producer to consumer.

The control plane decides what moves (a `Deliver` message names the item and describes its
tensors); a transport moves the bytes. Who calls what:

* `prepare`: `Producer.insert`, once per item, in the inserting task, right after the
  tensors were copied; it may store what `payload` will need on `item.frames`.
* `payload`: the producer's serve loop, once per Deliver, on the producer's event loop,
  right before it sends the Deliver header. It returns the frames that travel with the
  header (TCP: the tensors' bytes, zero-copy) and starts any out-of-band send. The
  producer keeps the item, and so its tensors, until the consumer answers `Received`,
  so a transport may read them until then without copying.
* `receive`: the consumer's link loop, once per Deliver, in arrival order (the order an
  out-of-band transport must post its receives in). It returns the five tensors on the
  consumer's device; from then on the consumer owns them.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

import torch
import zmq

from kvrt._buffer import BufferedItem
from kvrt._messages import Deliver

ItemTensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""input_tokens, roi, key, value, hidden: the order they travel in."""


class Transport(abc.ABC):
    name: ClassVar[str]

    def prepare(self, item: BufferedItem) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Producer side: get ready to send `item` (nothing by default)."""

    @abc.abstractmethod
    def payload(self, peer: bytes, item: BufferedItem) -> list[memoryview]:
        """Producer side: frames to send after the Deliver header for `item`."""

    @abc.abstractmethod
    async def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> ItemTensors:
        """Consumer side: the item's tensors, from the frames that followed its Deliver header."""
