"""TCP transport: an item's packed tensors ride as one extra ZeroMQ frame of its Deliver
(a DeliverMany: one frame per hit, in order). A payload of `SPLIT_PAYLOAD_BYTES` or more
travels in a `payload` message of its own right after the header, so that the consumer has
its answer before the bytes are all on the wire (the producer's driver sends it so).

The frame is sent zero-copy (pyzmq copies only frames under its 64 KiB threshold) and the
tensors are rebuilt on the consumer as views over the received buffer, so the bytes are
copied by the kernel's socket path alone. The producer's storage stays alive until the
consumer's `Received`, and pyzmq holds a reference to the frame until libzmq sent it.

libzmq receives each frame into memory it allocates with `malloc`, which glibc serves from
memory it keeps only up to 32 MiB (`kvrt._heap`): a larger frame is a fresh mapping, its
pages faulted in one by one inside the request (16,385 faults for 64 MiB, 3-6 µs each on a
virtual machine: 1.7 to 2.8 times the consumer's CPU for the item) and unmapped when it is
freed.
So a payload of `FRAMED_FROM_BYTES` or more goes to a consumer that takes it so
(`Capability.TCP_FRAMES`, in its hello) in frames of `FRAME_BYTES` (zero-copy slices of the
item's storage), each received into kept memory, and the consumer copies them into a region
of memory it keeps for the purpose (`RECEIVE_ARENA_BYTES`, reused once the item's tensors
are gone): one copy at memory speed instead of a fault per page. A smaller payload comes in
one frame, which malloc serves from kept memory, and is used where it landed, without a copy.
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
from kvrt._heap import HEAP_ALLOCATIONS_UP_TO, keep_extra_heaps
from kvrt._item_bytes import ItemBytes
from kvrt._messages import SPLIT_PAYLOAD_BYTES, Deliver, DeliverMany, Hit, Payload
from kvrt._tensors import tensor_bytes, unpack
from kvrt._threads import CheckWorkers, pass_outcome
from kvrt.transports._arena import RegisteredArena
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

FRAMED_FROM_BYTES: Final = HEAP_ALLOCATIONS_UP_TO - (1 << 20)
"""Payloads of this size or more go in frames to a consumer that takes them so: glibc's
malloc serves an allocation from memory it keeps only below `HEAP_ALLOCATIONS_UP_TO`, and
libzmq's message and malloc's own headers come on top of the payload."""
FRAME_BYTES: Final = 8 << 20
"""The largest frame of a framed payload: well inside what malloc serves from kept memory,
and large enough that a frame's own cost (a libzmq message, a Python object) is nothing
beside its bytes."""
RECEIVE_ARENA_BYTES: Final = 1 << 30
"""The most memory a consumer's TCP receiver keeps for payloads that came in several frames
(slabs of `RECEIVE_SLAB_BYTES`, made as needed); past it such a payload lands in memory
allocated for it alone."""
RECEIVE_SLAB_BYTES: Final = 256 << 20


def _never(peer: bytes) -> bool:
    return False


def framed(frame: memoryview) -> list[memoryview]:
    """`frame` cut into frames of at most `FRAME_BYTES` (zero-copy slices) if it has at least
    `FRAMED_FROM_BYTES`; else `frame` alone."""
    if frame.nbytes < FRAMED_FROM_BYTES:
        return [frame]
    flat = frame.cast("B")
    return [flat[start : start + FRAME_BYTES] for start in range(0, flat.nbytes, FRAME_BYTES)]


class TcpSender(Sender):
    """The producer's half: an item's packed bytes, framed at its first send, kept while the
    item lives (a payload of `FRAMED_FROM_BYTES` or more in frames of `FRAME_BYTES` for a
    consumer that `takes_frames`, a call the producer's driver answers from the consumer's
    hello); a stream message's tensors as host frames."""

    def __init__(self, device: torch.device | str = "cpu", takes_frames: Callable[[bytes], bool] | None = None) -> None:
        self.name = "tcp"
        self.device = torch.device(device)
        self._takes_frames = takes_frames or _never
        self._frames: weakref.WeakKeyDictionary[ItemBytes, memoryview] = weakref.WeakKeyDictionary()
        """The frame of each item sent so far (a GPU item's: of its host copy): made once
        however often the item is delivered, and dropped with the item."""
        self._host = HostCopies()

    async def send(self, peer: bytes, transfer: Transfer, post: Post) -> None:
        if transfer.tensors:
            post(await self._host.frames(transfer.tensors, transfer.ready))
            return
        await transfer.written()
        frames = [self._frame(item) for item in transfer.items]
        if self._takes_frames(peer) and any(frame.nbytes >= FRAMED_FROM_BYTES for frame in frames):
            frames = [piece for frame in frames for piece in framed(frame)]
        post(frames)

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


class _Landing:
    """Where one delivered item's payload is: the one frame it came in, used where it lies, or
    the frames it came in and the memory they are copied into (`into`)."""

    __slots__ = ("frames", "into")

    def __init__(self, frames: list[zmq.Frame], into: torch.Tensor | None) -> None:
        self.frames = frames
        self.into = into

    @property
    def copied_bytes(self) -> int:
        return 0 if self.into is None else self.into.numel()

    def landed(self) -> memoryview:
        """The payload's bytes (the frames copied first, where there are several; they are let
        go at once, so that the memory libzmq received them into is reused)."""
        if self.into is None:
            return self.frames[0].buffer
        position = 0
        for frame in self.frames:
            piece = torch.frombuffer(frame.buffer, dtype=torch.uint8)
            self.into[position : position + piece.numel()].copy_(piece)
            position += piece.numel()
        self.frames = []
        return tensor_bytes(self.into)


class TcpReceiver(Receiver):
    """The consumer's half: an item's tensors rebuilt as views over the frame that carried them,
    or over the memory kept for payloads that came in several frames."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.name = "tcp"
        self.device = torch.device(device)
        self._following: dict[int, tuple[Deliver | DeliverMany, asyncio.Future[Any]]] = {}
        """Deliveries whose frames follow in a `payload` message, by request id."""
        self._checks = CheckWorkers()
        """This link's: one producer's large checks never wait behind another's."""
        self._kept = RegisteredArena(torch.device("cpu"), RECEIVE_ARENA_BYTES, RECEIVE_SLAB_BYTES)
        """Where payloads that came in several frames are copied: its regions come back when
        the last tensor over them goes, and are reused, their pages warm."""

    def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> Arrival:
        done: asyncio.Future[ItemTensors] = asyncio.get_running_loop().create_future()
        if not frames and deliver.payload_bytes >= SPLIT_PAYLOAD_BYTES:
            self._follows(deliver, done)
            return Arrival(done)
        landing = self._landings([deliver], frames, "deliver")
        self._complete(done, [deliver], landing, lambda: self._unpacked(deliver, landing[0]))
        return Arrival(done)

    def receive_many(self, message: DeliverMany, frames: Sequence[zmq.Frame]) -> asyncio.Future[list[ItemTensors]]:
        done: asyncio.Future[list[ItemTensors]] = asyncio.get_running_loop().create_future()
        if not frames and message.payload_bytes >= SPLIT_PAYLOAD_BYTES and any(message.hits):
            self._follows(message, done)
            return done
        hits = batch_hits(message)
        landings = self._landings(hits, frames, "deliver_many")
        self._complete(done, hits, landings, lambda: self._batch(hits, landings))
        return done

    def _complete(
        self, done: asyncio.Future[_T], entries: Sequence[Deliver | Hit], landings: Sequence[_Landing],
        build: Callable[[], _T],
    ) -> None:  # fmt: skip
        """Complete `done` with `build()` (copy, check and rebuild what came): here, raising what
        it raises, or on one of the receiver's check workers when it copies and checks more
        than `CHECK_ON_LOOP_BYTES`."""
        checked = sum(entry.payload_bytes for entry in entries if checks_landing(self, entry, host=True))
        if checked + sum(landing.copied_bytes for landing in landings) <= CHECK_ON_LOOP_BYTES:
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
                landing = self._landings([delivery], frames, "deliver")
                self._complete(done, [delivery], landing, lambda: self._unpacked(delivery, landing[0]))
            else:
                hits = batch_hits(delivery)
                landings = self._landings(hits, frames, "deliver_many")
                self._complete(done, hits, landings, lambda: self._batch(hits, landings))
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

    def _landings(self, entries: Sequence[Deliver | Hit], frames: Sequence[zmq.Frame], what: str) -> list[_Landing]:
        """Each entry's payload in `frames`, in order: one frame, or consecutive frames whose
        bytes add up to its `payload_bytes` (from a producer that sends it so, `FRAME_BYTES`
        each), with kept memory to copy them into. On the loop: raises `RemoteProtocolError`
        for frames that do not add up to the entries."""
        landings, index = [], 0
        for entry in entries:
            group: list[zmq.Frame] = []
            got = 0
            while index < len(frames) and (not group or got < entry.payload_bytes):
                group.append(frames[index])
                got += len(frames[index])
                index += 1
            if got != entry.payload_bytes or not group:
                raise RemoteProtocolError(
                    f"{what}: item {entry.item_id}: {entry.payload_bytes} payload bytes announced, {got} came"
                    f" (in {len(group)} frames)"
                )
            into = None
            if len(group) > 1:
                keep_extra_heaps()  # before the frames go back: libzmq's thread may have needed a heap more
                into = self._kept.allocate(entry.payload_bytes)
                if into is None:  # the kept memory is all held by tensors still alive
                    into = torch.empty(entry.payload_bytes, dtype=torch.uint8)
            landings.append(_Landing(group, into))
        if index != len(frames):
            raise RemoteProtocolError(f"{what}: {len(frames) - index} frames past its {len(entries)} items' payloads")
        return landings

    def _batch(self, hits: Sequence[Hit], landings: Sequence[_Landing]) -> list[ItemTensors]:
        return [self._unpacked(hit, landing) for hit, landing in zip(hits, landings, strict=True)]

    def _unpacked(self, entry: Deliver | Hit, landing: _Landing) -> ItemTensors:
        buffer = landing.landed()
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
