"""TCP transport: an item's packed tensors ride as one extra ZeroMQ frame of its Deliver
(a DeliverMany: one frame per hit, in order).

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
from kvrt._messages import Deliver, DeliverMany, Hit
from kvrt._tensors import tensor_bytes, unpack
from kvrt.transports._base import Arrival, ItemTensors, Transport, batch_hits, item_metas


class TcpTransport(Transport):
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.name = "tcp"
        self.device = torch.device(device)

    def prepare(self, item: BufferedItem) -> None:
        if item.storage.device.type == "cpu":
            item.frames = [tensor_bytes(item.storage)]

    async def send(self, peer: bytes, item: BufferedItem) -> list[memoryview]:
        if item.frames is None:  # a GPU item for a consumer without a GPU transport
            written = item.written  # on the inserting caller's stream, not this thread's
            if written is not None:
                torch.cuda.current_stream(item.storage.device).wait_event(written)
            item.frames = [tensor_bytes(item.storage.cpu())]
        return item.frames

    async def send_many(self, peer: bytes, message: DeliverMany, items: Sequence[BufferedItem]) -> list[memoryview]:
        return [frame for item in items for frame in await self.send(peer, item)]

    def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> Arrival:
        if len(frames) != 1:
            raise RemoteProtocolError(f"deliver needs one payload frame, {len(frames)} followed")
        done: asyncio.Future[ItemTensors] = asyncio.get_running_loop().create_future()
        done.set_result(self._unpacked(deliver, frames[0]))
        return Arrival(done)

    def receive_many(self, message: DeliverMany, frames: Sequence[zmq.Frame]) -> asyncio.Future[list[ItemTensors]]:
        hits = batch_hits(message)
        if len(frames) != len(hits):
            raise RemoteProtocolError(
                f"deliver_many with {len(hits)} hits needs as many frames, {len(frames)} followed"
            )
        done: asyncio.Future[list[ItemTensors]] = asyncio.get_running_loop().create_future()
        done.set_result([self._unpacked(hit, frame) for hit, frame in zip(hits, frames, strict=True)])
        return done

    def _unpacked(self, entry: Deliver | Hit, frame: zmq.Frame) -> ItemTensors:
        buffer = frame.buffer
        if buffer.nbytes != entry.payload_bytes:
            raise RemoteProtocolError(
                f"item {entry.item_id}: {entry.payload_bytes} payload bytes announced, {buffer.nbytes} came"
            )
        tensors = unpack(item_metas(entry), buffer)
        if self.device.type != "cpu":
            tensors = [None if tensor is None else tensor.to(self.device) for tensor in tensors]
        input_tokens, roi, key, value, hidden = tensors
        assert input_tokens is not None and key is not None and value is not None  # the messages' types say so
        return input_tokens, roi, key, value, hidden
