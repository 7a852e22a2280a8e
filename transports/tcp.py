"""TCP transport: an item's packed tensors ride as one extra ZeroMQ frame of its Deliver.

The frame is sent zero-copy (pyzmq copies only frames under its 64 KiB threshold) and the
tensors are rebuilt on the consumer as views over the received buffer, so the bytes are
copied by the kernel's socket path alone. The producer's storage stays alive until the
consumer's `Received`, and pyzmq holds a reference to the frame until libzmq sent it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import zmq

from kvrt._buffer import BufferedItem
from kvrt._errors import RemoteProtocolError
from kvrt._messages import Deliver
from kvrt._tensors import tensor_bytes, unpack
from kvrt.transports._base import ItemTensors, Transport


class TcpTransport(Transport):
    name: ClassVar[str] = "tcp"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def prepare(self, item: BufferedItem) -> None:
        item.frames = [tensor_bytes(item.storage)]

    def payload(self, peer: bytes, item: BufferedItem) -> list[memoryview]:
        if item.frames is None:
            self.prepare(item)
        assert item.frames is not None
        return item.frames

    async def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> ItemTensors:
        if len(frames) != 1:
            raise RemoteProtocolError(f"deliver needs one payload frame, {len(frames)} followed")
        buffer = frames[0].buffer
        if buffer.nbytes != deliver.payload_bytes:
            raise RemoteProtocolError(f"deliver announced {deliver.payload_bytes} payload bytes, {buffer.nbytes} came")
        metas = (deliver.input_tokens, deliver.roi, deliver.key, deliver.value, deliver.hidden)
        tensors = unpack(metas, buffer)
        if self.device.type != "cpu":
            tensors = [None if tensor is None else tensor.to(self.device) for tensor in tensors]
        input_tokens, roi, key, value, hidden = tensors
        assert input_tokens is not None and key is not None and value is not None  # Deliver's types say so
        return input_tokens, roi, key, value, hidden
