"""TCP transport: an item's packed tensors ride as one extra ZeroMQ frame of its Deliver.

The frame is sent zero-copy (pyzmq copies only frames under its 64 KiB threshold) and the
tensors are rebuilt on the consumer as views over the received buffer, so the bytes are
copied by the kernel's socket path alone. The producer's storage stays alive until the
consumer's `Received`, and pyzmq holds a reference to the frame until libzmq sent it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch
import zmq

from kvrt._buffer import BufferedItem
from kvrt._errors import RemoteProtocolError
from kvrt._messages import Deliver
from kvrt._tensors import tensor_bytes, unpack
from kvrt.transports._base import Arrival, ItemTensors, Transport


class TcpTransport(Transport):
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.name = "tcp"
        self.device = torch.device(device)

    def prepare(self, item: BufferedItem) -> None:
        if item.storage.device.type == "cpu":
            item.frames = [tensor_bytes(item.storage)]

    async def send(self, peer: bytes, item: BufferedItem) -> list[memoryview]:
        if item.frames is None:  # a GPU item for a consumer without a GPU transport
            item.frames = [tensor_bytes(item.storage.cpu())]
        return item.frames

    def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> Arrival:
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
        done: asyncio.Future[ItemTensors] = asyncio.get_running_loop().create_future()
        done.set_result((input_tokens, roi, key, value, hidden))
        return Arrival(done)
