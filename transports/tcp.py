"""TCP transport: tensors ride as extra ZeroMQ frames of the Deliver message.

Frames are sent zero-copy (pyzmq copies only frames under its 64 KiB threshold) and
rebuilt on the consumer over the received buffers, so a tensor is copied by the kernel's
socket path alone. The producer's tensors stay alive until the consumer's `Received`,
and pyzmq holds a reference to each frame until libzmq has sent it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import zmq

from kvrt._buffer import BufferedItem
from kvrt._errors import RemoteProtocolError
from kvrt._messages import Deliver, TensorMeta
from kvrt._tensors import tensor_bytes, tensor_from_buffer
from kvrt.transports._base import ItemTensors, Transport


class TcpTransport(Transport):
    name: ClassVar[str] = "tcp"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def prepare(self, item: BufferedItem) -> None:
        item.frames = [tensor_bytes(tensor) for tensor in item.tensors() if tensor is not None]

    def payload(self, peer: bytes, item: BufferedItem) -> list[memoryview]:
        if item.frames is None:
            self.prepare(item)
        assert item.frames is not None
        return item.frames

    async def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> ItemTensors:
        metas: list[TensorMeta | None] = [deliver.input_tokens, deliver.roi, deliver.key, deliver.value, deliver.hidden]
        present = sum(meta is not None for meta in metas)
        if present != len(frames):
            raise RemoteProtocolError(f"deliver describes {present} tensors but {len(frames)} frames followed")
        tensors: list[torch.Tensor | None] = []
        frame_iter = iter(frames)
        for meta in metas:
            if meta is None:
                tensors.append(None)
                continue
            tensor = tensor_from_buffer(meta, next(frame_iter).buffer)
            if self.device.type != "cpu":
                tensor = tensor.to(self.device, non_blocking=False)
            tensors.append(tensor)
        input_tokens, roi, key, value, hidden = tensors
        assert input_tokens is not None and key is not None and value is not None  # Deliver's types say so
        return input_tokens, roi, key, value, hidden
