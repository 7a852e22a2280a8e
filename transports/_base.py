"""The transport interface: how one delivery's bytes get from producer to consumer.

The control plane decides what moves (a `Deliver` message names the item and describes its
packed tensors); a transport moves the bytes, in two halves: a `Sender` on the producer, a `Receiver` on
the consumer (each transport module provides one of each, built by `select.make_senders` and
`select.make_receivers`). Who calls what:

`Sender`, the producer side, all on the producer's event loop:
* `start`: `Producer.start`, once, after the endpoint is bound and before any peer is
  served: set-up that blocks (NIXL's agent) runs there, off the loop.
* `offer`: once per consumer that chose this transport in its hello; returns what the
  consumer needs to join (sent in the welcome). Transports without pairs return {}.
* `send`: the producer's send path, once per delivery that moves bytes, under the producer's
  send lock. The driver lowers every such delivery (an item, a batch of hits, a stream's
  layer or end) into one `Transfer`; the sender moves it and posts the delivery's message
  exactly once, through the `post` it is given: with the frames that carry the bytes (TCP)
  or name them (cuda_ipc's shares, NIXL's descriptors), or, when the bytes travel apart
  from the message (NCCL, gloo), first, so that the consumer posts its receives while the
  sends are queued. The producer keeps the items, so their storage, until the consumer
  answers `Received`: a transport may read them until then without copying. A transport
  builds what it needs for an item (TCP's frames, NIXL's registration) when the item is
  first sent over it, and keeps it while the item lives: nothing for items its peers never
  take.
* `reclaim`: before the producer allocates an item: drop references finished transfers
  still hold.
* `allocate`: the producer's item allocations (insert, publish), asked of each transport in
  turn: memory the transport registered, that its sends move without a new share (cuda_ipc's
  slabs); None: the producer allocates the item itself. `note_written`: once the producer
  recorded an item's `ready_event`: memory the transport allocated is reused only after it.
* `forget`: once per consumer that left (bye, silence, unreachable): release its pair, and
  whatever it held on the consumer's behalf for the items it never confirmed (those items
  are back in the buffer, their storage alive).

`Receiver`, the consumer side, on the consumer's event loop:
* `join`: once per welcome, before any request: join the producer's rendezvous.
* `receive_many`: as `receive`, once per DeliverMany: the hits' tensors, in order, once
  all have landed.
* `receive_tensors`: once per stream message with tensors (a layer, an end's hidden states), in
  arrival order, as `receive`: the tensors at once, an event for their landing (GPU), and a
  future done once they landed.
* `refuse`, `refuse_unread`, `refuse_stream`: the link's arrivals and streams, when the link
  refuses a message (its receive failed, it came outside the lease, its stream failed): the
  receiver does to the link what that leaves to do (`Refusing`): its items given back, or,
  for a transport whose bytes travel apart from the message and are still on their way
  (NCCL, gloo), the session given up and a new one started, the pair being out of step.
* `skip`: once per message of a stream the link gave back: what came with it dropped, or its
  bytes, still on their way, received and dropped.
* `pools_in_place`: a pull whose indexes live on the device: the pools as this transport
  lands an item there (`receive_in_place`), its indexes read back to the host if it writes
  them itself.
* `abandon`: whenever the link fails its pending calls (the producer went silent, a new
  session starts, the link closes).
* `receive`: the link's reader, once per Deliver, in arrival order, which is the order an
  out-of-band transport must post its receives in. Posts now; the returned `Arrival`'s
  `complete` is a future of the loop, done with the five tensors on the consumer's device
  (which the consumer then owns) once they landed: the consumer completes the call from its
  done-callback, so a transport hands out a future, not a coroutine.
  A GPU transport also hands out the tensors at once with an event per payload segment,
  so that a pull can scatter the first layers while the last are still on the wire.
* `receive_in_place`: instead of `receive`, for the Deliver of a pull, or of a drop_select
  with `into=` buffers, from one producer and no group: a transport that can land K and V
  in the caller's memory itself (nixl: one READ whose descriptors name the pools' slots, or
  the buffers) does so and says so (`InPlace.landed`); the others `receive` as usual, and
  the call scatters or copies the item.

Both halves: `aclose` when the producer or consumer closes.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import zmq

from kvrt._checksum import DeviceChecksum, device_checksum_mismatch, item_checksum
from kvrt._errors import IntegrityError, KVRTError, RemoteProtocolError
from kvrt._item_bytes import ItemBytes, all_gathers_queued
from kvrt._messages import BATCH_ALIGNMENT, Deliver, DeliverMany, Hit, TensorMeta
from kvrt._pools import PoolTable
from kvrt._tensors import check_batch_segments, check_metas, tensor_bytes, unpack
from kvrt._threads import gpu_worker

ItemTensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""input_tokens, roi, key, value, hidden: the order they travel in."""


def item_metas(entry: Deliver | Hit) -> tuple[TensorMeta | None, ...]:
    """The metas of a delivered item's five tensors, in travel order."""
    return entry.input_tokens, entry.roi, entry.key, entry.value, entry.hidden


def five(tensors: Sequence[torch.Tensor | None]) -> ItemTensors:
    """An item's five tensors, unpacked in travel order, typed as such."""
    input_tokens, roi, key, value, hidden = tensors
    assert input_tokens is not None and key is not None and value is not None  # Deliver's types say so
    return input_tokens, roi, key, value, hidden


def batch_hits(message: DeliverMany) -> list[Hit]:
    """A DeliverMany's hits, in order (its misses left out)."""
    return [hit for hit in message.hits if hit is not None]


def checked_batch(message: DeliverMany, hits: Sequence[Hit]) -> list[tuple[tuple[TensorMeta | None, ...], int]]:
    """The hits of a batch that travels as one payload, checked before anything is read: their
    segments lie in the payload without overlap, each starts aligned, and its metas fit its
    bytes (`RemoteProtocolError` otherwise). Each hit's metas and offset, for `batch_views`."""
    check_batch_segments(
        [(0, message.payload_bytes)] if message.payload_bytes else [],
        [(hit.offset, hit.payload_bytes) for hit in hits],
        message.payload_bytes,
    )
    entries = [(item_metas(hit), hit.offset) for hit in hits]
    for hit, (metas, _) in zip(hits, entries, strict=True):
        if hit.offset % BATCH_ALIGNMENT:
            raise RemoteProtocolError(f"item {hit.item_id} at offset {hit.offset} of its batch is misaligned")
        check_metas(metas, hit.payload_bytes)
    return entries


@dataclass(frozen=True, slots=True)
class Arrival:
    """A posted receive."""

    complete: asyncio.Future[ItemTensors]
    """The five tensors, once the whole item has landed (done already when they came with
    the header)."""
    early: ItemTensors | None = None
    """GPU transports: the same tensors at once, to be read only on a stream that waited on
    the `landed` event of the segments it reads."""
    landed: tuple[torch.cuda.Event, ...] = ()
    """One event per payload segment (`Deliver.segments`, or one for the whole payload), in
    send order, recorded on the receive stream after that segment's receive."""


@dataclass(frozen=True, slots=True)
class TensorsArrival:
    """A posted receive of a stream message's tensors (`receive_tensors`)."""

    complete: asyncio.Future[list[torch.Tensor]]
    """The tensors, once they landed."""
    tensors: list[torch.Tensor]
    """The same tensors at once: on a GPU, to be read on a stream that waited on `landed`."""
    landed: torch.cuda.Event | None = None
    """GPU: recorded on the receive stream after the tensors' receive."""


Post = Callable[[Sequence[memoryview]], None]
"""Posts a delivery's message to its consumer with the frames that travel with it (the
producer's driver gives one to each `Sender.send`)."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """What one delivery moves to one consumer: the one value the producer lowers every
    delivery into, and all a `Sender` is given of it.

    Either the bytes of `items`: one item's storage (a Deliver), in the ranges `segments` (the
    Deliver's; empty: one transfer of the whole storage), or a batch's hits in order, each at its
    offset of one payload that travels in the batch's segments (`batch`, the DeliverMany); or a
    stream message's `tensors` (a layer's key and value, a stream end's hidden states) of the
    stream `stream_id`, written on the GPU once `ready` fired. An item says itself when its bytes
    are written (`ItemBytes.written`; a published item's per segment, once its gathers are
    queued: `written` queues them). A sender is given the items' bytes only, never the
    protocol's records of them."""

    items: tuple[ItemBytes, ...] = ()
    segments: tuple[tuple[int, int], ...] = ()
    batch: DeliverMany | None = None
    tensors: tuple[torch.Tensor, ...] = ()
    ready: torch.cuda.Event | None = None
    stream_id: int = 0

    async def written(self) -> None:
        """Every item's writes queued (a published item's gathers): before anything reads an
        item's whole storage or waits on its `written` event. Raises `GathersFailed`."""
        for item in self.items:
            if item.gathers is not None:  # else nothing to queue (no coroutine in the way)
                await all_gathers_queued(item)


class HostCopies:
    """Tensors as frames for the host: a CPU tensor's own bytes; GPU tensors copied to the
    host on a thread of their own once the GPU wrote them (`ready`), so that the loop never
    waits for the device."""

    def __init__(self) -> None:
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None

    async def frames(self, tensors: Sequence[torch.Tensor], ready: torch.cuda.Event | None) -> list[memoryview]:
        if all(tensor.device.type == "cpu" for tensor in tensors):
            return [tensor_bytes(tensor) for tensor in tensors]
        device = tensors[0].device
        if ready is None:  # written on this thread's current stream, which the copy must follow
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        if self._thread is None:
            self._thread = gpu_worker(device, "kvrt-to-host")
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        written = ready

        def to_host() -> list[memoryview]:
            written.synchronize()
            # On a stream of kvrt's own: a copy on the thread's default stream would also wait
            # for everything queued on the legacy default stream, a whole prefill if it runs there.
            with torch.cuda.stream(stream):
                return [tensor_bytes(tensor.cpu()) for tensor in tensors]

        return await asyncio.wrap_future(self._thread.submit(to_host))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False)


class Sender(abc.ABC):
    """The producer's half of a transport: moves the bytes of the deliveries it is given."""

    name: str
    """What the handshake calls it: "tcp", "nccl", "gloo"."""

    async def start(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Producer side, once before serving: set up what blocks (nothing by default)."""

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """Producer side: a 1-D uint8 tensor of `nbytes` on the producer's device in memory this
        transport registered (None by default: the producer allocates it)."""
        return None

    def note_written(self, item: ItemBytes) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Producer side: `item`'s bytes are written once `item.written` fires; memory this
        transport allocated (`allocate`) is reused only after it (nothing by default)."""

    def reclaim(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Producer side, before an item is allocated: drop what finished transfers still
        hold, so that their memory can serve the new item (nothing by default)."""

    def offer(self, peer: bytes) -> dict[str, str]:
        """Producer side: the rendezvous a consumer needs to join (none by default)."""
        return {}

    @abc.abstractmethod
    async def send(self, peer: bytes, transfer: Transfer, post: Post) -> None:
        """Producer side: move `transfer` to `peer`, and post its message exactly once (see
        the module's doc for when, and with which frames)."""

    def forget(self, peer: bytes, unconfirmed: Sequence[ItemBytes] = ()) -> None:  # noqa: B027
        """Producer side: `peer` left without confirming `unconfirmed`; release what its pair
        held (nothing by default)."""

    async def aclose(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Release threads, streams and pairs."""


def caller_ready(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on the current stream of `device` (the calling call's, inside a
    kvrt call), or None on the host."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass(slots=True)
class InPlace:
    """Memory of the caller's that one call's item may be written into by the transport
    itself (`Receiver.receive_in_place`). On a GPU, `ready` was recorded on the call's stream
    when it began: the memory is written only after it. `landed` is set by a transport that
    writes there, with `reading`, done once it stopped writing."""

    ready: torch.cuda.Event | None
    landed: bool = field(default=False, init=False)
    reading: asyncio.Future[Any] | None = field(default=None, init=False)
    stop: bool = field(default=False, init=False)
    """Set by `ended`: the write is to be given up (the call ended without it)."""
    _writing: bool = field(default=False, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def may_write(self) -> bool:
        """Called by the transport (any thread) right before it starts writing: False when the
        call ended first (then it must not start)."""
        with self._lock:
            self._writing = not self.stop
            return self._writing

    async def ended(self) -> None:
        """Return once nothing writes the memory any more: a write that has not started (queued
        behind others) never will; one going (the call failed or was cancelled before it
        landed) is told to stop, and waited for: the transport gives it up at its next look."""
        reading = self.reading
        if reading is None or reading.done():
            return
        with self._lock:
            self.stop = True
            if not self._writing:
                return
        await asyncio.wait([reading])


@dataclass(slots=True)
class PoolLanding(InPlace):
    """A pull's pools: token i goes to `slots[i]` of replica `replicas[i]` (host arrays,
    checked in range; None where the pull's indexes live on the device and were not read
    back: the item is then received as usual), for as many tokens as both have."""

    table: PoolTable = field(kw_only=True)
    replicas: np.ndarray | None = field(kw_only=True)
    slots: np.ndarray | None = field(kw_only=True)


@dataclass(slots=True)
class BufferLanding(InPlace):
    """A drop_select's `into=` buffers (contiguous, on the consumer's device): the item's key,
    value (and hidden states, where `hidden` is given) in their leading elements, where they
    fit; an item that does not is received as usual (and refused by the call)."""

    key: torch.Tensor = field(kw_only=True)
    value: torch.Tensor = field(kw_only=True)
    hidden: torch.Tensor | None = field(kw_only=True)


class Refusing(Protocol):
    """What a receiver may do to its link when the link refuses a message (see `Receiver.refuse`):
    give the message's items back (its call fails), or give the session up for a new one, in
    which the producer takes back what the old one held."""

    def give_back(self, future: asyncio.Future[Any] | None, item_ids: Sequence[int], error: BaseException) -> None:
        """The items go back to the producer; the call of `future` fails with `error`."""

    def release(self, item_ids: Sequence[int]) -> None:
        """The items go back to the producer."""

    def start_afresh(self, future: asyncio.Future[Any] | None, error: KVRTError) -> None:
        """The call of `future` fails with `error`, every other one too, and a new session starts."""


class Receiver(abc.ABC):
    """The consumer's half of a transport: posts the receives of the items delivered to it."""

    name: str
    """What the handshake calls it, the same as its producer's `Sender`."""
    device: torch.device
    """Where what it receives lands."""
    device_checksum: DeviceChecksum | None = None
    """How to check an item a producer on a GPU checksummed (`Deliver.device_checksum`): the
    consumer sets it (the kernel lives above the transports); None leaves it unchecked."""

    async def join(self, rendezvous: dict[str, str], timeout_s: float) -> None:  # noqa: B027
        """Consumer side: join the producer's rendezvous (nothing by default)."""

    @abc.abstractmethod
    def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> Arrival:
        """Consumer side: post the receive of one item now."""

    @abc.abstractmethod
    def receive_many(self, message: DeliverMany, frames: Sequence[zmq.Frame]) -> asyncio.Future[list[ItemTensors]]:
        """Post the receive of a DeliverMany's hits; their tensors, in order, once all landed."""

    def receive_in_place(self, deliver: Deliver, frames: Sequence[zmq.Frame], target: InPlace) -> Arrival:
        """As `receive`, for a call that lands its item in the caller's memory: a pull's pools
        or a drop_select's `into=` buffers. A transport that writes the item's K and V (and
        hidden states) there itself sets `target.landed` (a pull's arrival's key and value
        then hold no bytes; a drop_select's are views of its buffers); by default the item is
        received as any other, for the call to scatter or copy."""
        return self.receive(deliver, frames)

    def receive_tensors(self, metas: Sequence[TensorMeta], frames: Sequence[zmq.Frame]) -> TensorsArrival:
        """Post the receive of a stream message's tensors now. By default they came as host
        frames, one a tensor (the sender's `HostCopies`): here already, moved to `device`."""
        if len(frames) != len(metas):
            raise RemoteProtocolError(
                f"a stream message of {len(metas)} tensors needs as many frames, {len(frames)} came"
            )
        tensors = []
        for meta, frame in zip(metas, frames, strict=True):
            (tensor,) = unpack([meta], frame.buffer)
            assert tensor is not None  # a meta unpacks to a tensor
            tensors.append(tensor.to(self.device))
        done: asyncio.Future[list[torch.Tensor]] = asyncio.get_running_loop().create_future()
        done.set_result(tensors)
        return TensorsArrival(done, tensors)

    def discard(self, frames: Sequence[zmq.Frame]) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Consumer side: the frames of a message this side will not read (nothing by default)."""

    def refuse(
        self, link: Refusing, future: asyncio.Future[Any] | None, item_ids: Sequence[int], error: KVRTError
    ) -> None:
        """Consumer side: a delivery (or a batch) whose receive failed with `error`: its items
        go back and its call fails (what came with its message goes with it)."""
        link.give_back(future, item_ids, error)

    def refuse_unread(
        self, link: Refusing, future: asyncio.Future[Any] | None, item_ids: Sequence[int], error: KVRTError,
        frames: Sequence[zmq.Frame],
    ) -> None:  # fmt: skip
        """Consumer side: a delivery this side will not read (it came outside the lease): what
        came with it is dropped (`discard`), its items go back, its call fails with `error`."""
        self.discard(frames)
        link.give_back(future, item_ids, error)

    def refuse_stream(self, link: Refusing, item_id: int, error: KVRTError) -> None:
        """Consumer side: a stream whose message failed with `error` (its reader failed
        already): its item goes back."""
        link.release([item_id])

    def skip(self, metas: Sequence[TensorMeta], frames: Sequence[zmq.Frame]) -> asyncio.Future[Any] | None:
        """Consumer side: a message of a stream this side gave back, with tensors of `metas`
        (none for an abort): what came with it is dropped (`discard`). A future for the link to
        own when its bytes are still to land (None here)."""
        self.discard(frames)
        return None

    async def pools_in_place(
        self, ready: torch.cuda.Event | None, into: PoolTable, replicas: torch.Tensor, slots: torch.Tensor
    ) -> PoolLanding:
        """Consumer side: a pull's pools, whose indexes live on the device, as this transport
        lands an item there (`receive_in_place`): without the indexes by default (the item is
        received as usual and scattered)."""
        return PoolLanding(ready, table=into, replicas=None, slots=None)

    def abandon(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Consumer side: the link gave the producer up (silent, or a new session starts):
        stop waiting on anything only the producer could still do (nothing by default)."""

    async def aclose(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Release threads, streams and pairs."""


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make `device` the current GPU, unless it already is: engines keep their GPU current,
    and a switch is cheap alone but cost milliseconds beside another thread's CUDA wait
    (measured on an H200 host)."""
    if torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


class OnStream:
    """`stream` current on its device (the current device) inside the block: `torch.cuda.stream`
    without its lookups of the current device (which ask whether CUDA is available, and read
    the environment, each time: ~20 us a transfer on an H200 host, on the loop's thread)."""

    __slots__ = ("_previous", "_stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream

    def __enter__(self) -> None:
        self._previous = torch.cuda.current_stream(self._stream.device)
        torch.cuda.set_stream(self._stream)

    def __exit__(self, *_: object) -> None:
        torch.cuda.set_stream(self._previous)


def checks_landing(receiver: Receiver, entry: Deliver | Hit, *, host: bool) -> bool:
    """Whether `receiver` checks what lands of `entry`: its XXH3 checksum in host memory (`host`),
    a GPU producer's checksum wherever the receiver has the kernel (`Receiver.device_checksum`)."""
    return (entry.checksum is not None and host) or (
        entry.device_checksum is not None and receiver.device_checksum is not None
    )


def landed_check(
    receiver: Receiver, payload: torch.Tensor, entries: Sequence[tuple[Deliver | Hit, int]]
) -> Callable[[], None] | None:
    """What checks the items of a payload once all of it landed, on the thread that waited for
    it (on a GPU, on the stream current there), before the call sees them: each entry is a
    delivered item (a `deliver`, or a hit of a batch) and where its bytes start in `payload`.
    None when none carries a checksum this side can check. A mismatch raises `IntegrityError`
    (a batch's call fails whole)."""
    host = payload.device.type == "cpu"
    checked = [(entry, start) for entry, start in entries if checks_landing(receiver, entry, host=host)]
    if not checked:
        return None

    def check() -> None:
        for entry, start in checked:
            metas, what = item_metas(entry), f"item {entry.item_id}"
            landed = payload[start : start + entry.payload_bytes]
            if entry.checksum is not None and host and item_checksum(tensor_bytes(landed), metas) != entry.checksum:
                raise IntegrityError(
                    f"{what}: its {landed.numel()} bytes, or the description of its tensors, do not match the "
                    "checksum its producer computed where it wrote them (damaged on the way): it went back whole"
                )
            error = device_checksum_mismatch(receiver.device_checksum, landed, metas, entry.device_checksum, what)
            if error is not None:
                raise error

    return check
