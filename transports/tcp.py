"""TCP transport: an item's packed tensors ride as one extra ZeroMQ frame of its Deliver
(a DeliverMany: one frame per hit, in order). A payload of `SPLIT_PAYLOAD_BYTES` or more
travels in a `payload` message of its own right after the header, so that the consumer has
its answer before the bytes are all on the wire (the producer's driver sends it so).

The frame is sent zero-copy (pyzmq copies only frames under its 64 KiB threshold) and the
tensors are rebuilt on the consumer as views over the received buffer, so the bytes are
copied by the kernel's socket path alone. The producer's storage stays alive until the
consumer's `Received`, and pyzmq holds a reference to the frame until libzmq sent it.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import torch
import zmq

from kvrt._errors import IntegrityError, RemoteProtocolError
from kvrt._item_bytes import ItemBytes
from kvrt._messages import SPLIT_PAYLOAD_BYTES, Deliver, DeliverMany, Hit, Payload
from kvrt._tensors import tensor_bytes, unpack
from kvrt._threads import CheckWorkers, pass_outcome
from kvrt.transports._base import (
    Arrival,
    HostCopies,
    ItemTensors,
    Post,
    Receiver,
    Sender,
    Transfer,
    batch_hits,
    checks_landing,
    item_metas,
    landed_check,
)

_T = TypeVar("_T")

CHECK_ON_LOOP_BYTES: Final = 1 << 20
"""The most payload bytes a delivery's check reads on the event loop. A larger delivery is
checked and rebuilt on one of the receiver's check workers (`kvrt._threads.CheckWorkers`): XXH3
reads about 10 GB/s, and a GPU producer's checksum, checked here with the kernel's torch
reference, under 1 GB/s on a host core; on the loop a large item's check would hold every
other call of the consumer."""

MAX_FOLLOWING: Final = 4096
"""Most deliveries one link keeps waiting for their `payload` message."""


class TcpSender(Sender):
    """The producer's half: an item's packed bytes, framed at its first send, kept while the
    item lives; a stream message's tensors as host frames."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.name = "tcp"
        self.device = torch.device(device)
        self._frames: weakref.WeakKeyDictionary[ItemBytes, memoryview] = weakref.WeakKeyDictionary()
        """The frame of each item sent so far (a GPU item's: of its host copy): made once
        however often the item is delivered, and dropped with the item."""
        self._host = HostCopies()

    async def send(self, peer: bytes, transfer: Transfer, post: Post) -> None:
        if transfer.tensors:
            post(await self._host.frames(transfer.tensors, transfer.ready))
            return
        await transfer.written()
        post([self._frame(item) for item in transfer.items])

    def _frame(self, item: ItemBytes) -> memoryview:
        frame = self._frames.get(item)
        if frame is None:
            storage = item.storage
            if storage.device.type != "cpu":  # a GPU item for a consumer without a GPU transport
                written = item.written  # on the inserting caller's stream, not this thread's
                if written is not None:
                    torch.cuda.current_stream(storage.device).wait_event(written)
                storage = storage.cpu()
            frame = self._frames[item] = tensor_bytes(storage)
        return frame

    async def aclose(self) -> None:
        self._host.close()


class TcpReceiver(Receiver):
    """The consumer's half: an item's tensors rebuilt as views over the frame that carried them."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.name = "tcp"
        self.device = torch.device(device)
        self._following: dict[int, tuple[Deliver | DeliverMany, asyncio.Future[Any]]] = {}
        """Deliveries whose frames follow in a `payload` message, by request id."""
        self._checks = CheckWorkers()
        """This link's: one producer's large checks never wait behind another's."""

    def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> Arrival:
        done: asyncio.Future[ItemTensors] = asyncio.get_running_loop().create_future()
        if not frames and deliver.payload_bytes >= SPLIT_PAYLOAD_BYTES:
            self._follows(deliver, done)
            return Arrival(done)
        self._complete(done, [deliver], lambda: self._item(deliver, frames))
        return Arrival(done)

    def receive_many(self, message: DeliverMany, frames: Sequence[zmq.Frame]) -> asyncio.Future[list[ItemTensors]]:
        done: asyncio.Future[list[ItemTensors]] = asyncio.get_running_loop().create_future()
        if not frames and message.payload_bytes >= SPLIT_PAYLOAD_BYTES and any(message.hits):
            self._follows(message, done)
            return done
        self._complete(done, batch_hits(message), lambda: self._batch(message, frames))
        return done

    def _complete(self, done: asyncio.Future[_T], entries: Sequence[Deliver | Hit], build: Callable[[], _T]) -> None:
        """Complete `done` with `build()` (check and rebuild what came): here, raising what it
        raises, or on one of the receiver's check workers when it checks more than `CHECK_ON_LOOP_BYTES`."""
        checked = sum(entry.payload_bytes for entry in entries if checks_landing(self, entry, host=True))
        if checked <= CHECK_ON_LOOP_BYTES:
            done.set_result(build())
            return
        built = asyncio.wrap_future(self._checks.submit(build))
        built.add_done_callback(functools.partial(pass_outcome, done))
        done.add_done_callback(lambda _: built.cancel())  # the link closed, or abandoned the call

    def payload(self, message: Payload, frames: Sequence[zmq.Frame]) -> None:
        """The frames of a delivery whose header came first: its receive completes (or fails,
        if they do not fit it). Frames nobody waits for (their session was abandoned) are dropped."""
        following = self._following.pop(message.request_id, None)
        if following is None:
            return
        delivery, done = following
        if done.done():
            return
        try:
            if isinstance(delivery, Deliver):
                self._complete(done, [delivery], lambda: self._item(delivery, frames))
            else:
                self._complete(done, batch_hits(delivery), lambda: self._batch(delivery, frames))
        except (RemoteProtocolError, IntegrityError) as exc:
            done.set_exception(exc)

    def abandon(self) -> None:
        """The link failed its calls: what was to follow belongs to them."""
        following, self._following = self._following, {}
        for _, done in following.values():
            done.cancel()

    async def aclose(self) -> None:
        self._checks.close()

    def _follows(self, delivery: Deliver | DeliverMany, done: asyncio.Future[Any]) -> None:
        if len(self._following) >= MAX_FOLLOWING:
            raise RemoteProtocolError(f"more than {MAX_FOLLOWING} deliveries wait for their payload")
        if delivery.request_id in self._following:
            raise RemoteProtocolError(f"a second delivery for request {delivery.request_id} before its payload")
        self._following[delivery.request_id] = (delivery, done)

    def _item(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> ItemTensors:
        if len(frames) != 1:
            raise RemoteProtocolError(f"deliver needs one payload frame, {len(frames)} followed")
        return self._unpacked(deliver, frames[0])

    def _batch(self, message: DeliverMany, frames: Sequence[zmq.Frame]) -> list[ItemTensors]:
        hits = batch_hits(message)
        if len(frames) != len(hits):
            raise RemoteProtocolError(
                f"deliver_many with {len(hits)} hits needs as many frames, {len(frames)} followed"
            )
        return [self._unpacked(hit, frame) for hit, frame in zip(hits, frames, strict=True)]

    def _unpacked(self, entry: Deliver | Hit, frame: zmq.Frame) -> ItemTensors:
        buffer = frame.buffer
        if buffer.nbytes != entry.payload_bytes:
            raise RemoteProtocolError(
                f"item {entry.item_id}: {entry.payload_bytes} payload bytes announced, {buffer.nbytes} came"
            )
        # Checked in host memory, where the frame lies (a GPU producer's item with the kernel's reference).
        payload = torch.frombuffer(buffer, dtype=torch.uint8) if buffer.nbytes else torch.empty(0, dtype=torch.uint8)
        check = landed_check(self, payload, [(entry, 0)])
        if check is not None:
            check()
        tensors = unpack(item_metas(entry), buffer)
        if self.device.type != "cpu":
            tensors = [None if tensor is None else tensor.to(self.device) for tensor in tensors]
        input_tokens, roi, key, value, hidden = tensors
        assert input_tokens is not None and key is not None and value is not None  # the messages' types say so
        return input_tokens, roi, key, value, hidden
