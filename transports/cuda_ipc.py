"""Same-host GPU transport over CUDA IPC: the consumer's copy engines read the producer's
GPU memory over NVLink (or PCIe), no SM is spent on either side, and there is no
communicator to set up or keep in step.

Who writes what. The producer could write into buffers the consumer shares; kvrt does the
mirror image, the consumer reading what the producer shares, because the producer already
keeps every item until the consumer answers `Received` (the transport contract) and the
consumer allocates its receive buffer as the header arrives: each transfer then costs no
round trip, the consumer's memory is only ever written by the consumer (so a producer can
never write a buffer the consumer gave up), and the producer's GPU loses no SM and no copy
engine time to the transfer.

How a transfer goes:
* producer (`send`: an item, a batch's hits, a stream's layer): a kvrt stream of the pair waits (on the
  GPU) for the bytes to be written (the insert's event, each chunk's gather, a layer's
  event) and then writes the pair's next mark, a number, to the pair's word in the
  producer's memory (a stream memory operation: `_stream_words`); the storage is shared
  with torch's `_share_cuda_` (the allocation's handle and a reference counter); the frame
  after the header (`IpcShare`) carries both, and the mark of each range. Nothing waits on
  the host.
* consumer (`receive`, ...): opens the allocation (a mapping cached per allocation handle:
  opening one costs ~10 ms for 1 GiB, a cached one ~20 us), allocates the receive buffer,
  and on its receive stream waits until the pair's word reaches each range's mark, then
  copies it (`copy_` of device memory: a copy engine). A kvrt thread waits for the last
  copy, then drops the mapping's use, which decrements the counter so the producer's
  allocator can take the memory back (`reclaim` collects it: `torch.cuda.ipc_collect`).
  Torch counted the share once, so it is opened counted once, however many ranges are
  read from it (a share left unread is released once: `discard`).

Why a word and not a CUDA IPC event: a stream that waits on another process's event waits
for ever if that process dies before recording it, and with it every later call of this
process that waits for the whole device (a module load, a free, a synchronize). The word
the consumer can write itself: when the link gives the producer up (`abandon`) it writes
a number past every mark, every wait passes, and the copies read what the dead producer
left (an open mapping stays readable after its exporter died)
into buffers whose calls failed already. A pair's word is its own for good (a slot of a
slab the producer never frees), so that write can never hit memory reused since.

Choice of path: the consumer's hello says which machine it runs on (the boot id); the
producer chooses `cuda_ipc` only for a consumer on its own machine. The welcome carries a
probe (a small shared tensor of known bytes): joining opens and copies it, so anything
that keeps IPC from working between the two processes (no peer access between the GPUs,
another IPC namespace, memory this process cannot map) shows as `TransportUnavailableError`
at join, and the consumer falls back to the next transport it offered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import zmq

from kvrt import _messages as m
from kvrt._errors import (
    InvalidInputError,
    KVRTTimeoutError,
    PeerLostError,
    RemoteProtocolError,
    TransportUnavailableError,
)
from kvrt._item_bytes import ItemBytes
from kvrt._messages import Deliver, DeliverMany, TensorMeta
from kvrt._tensors import (
    back_to_back,
    batch_views,
    check_segments,
    pack_back_to_back,
    span_of,
    tensor_meta,
    transfer_segments,
    unpack_tensor,
)
from kvrt._threads import WaitThread, outcome_seen
from kvrt.transports._arena import RegisteredArena
from kvrt.transports._base import (
    Arrival,
    ItemTensors,
    OnStream,
    Post,
    Receiver,
    Sender,
    TensorsArrival,
    Transfer,
    batch_hits,
    checked_batch,
    five,
    item_metas,
    landed_check,
    on_device,
)
from kvrt.transports._stream_words import StreamWords, stream_words_unavailable

_T = TypeVar("_T")
_MARK_SLOTS = 4096
"""Mark words per slab (8 bytes each): a pair takes one for good, since its consumer may
write it (giving up) at any time, and must never hit memory reused since."""
_ABANDONED = m.MAX_IPC_MARK + 1
"""What a consumer giving the producer up writes to its pair's word: past every mark."""
_OPEN_ALLOCATIONS = 1024
"""Mappings of the producer's allocations a consumer keeps open (LRU): each pins that much of
the producer's memory until the consumer closes it."""
_PROBE_BYTES = 4096
_MAX_PAYLOAD_BYTES = 1 << 40


def host_identity() -> str:
    """This machine, as the hello tells it: the kernel's boot id (shared by the containers of
    one host), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot_id:
            return "boot:" + boot_id.read().strip()
    except OSError:
        return "host:" + socket.gethostname()


def ipc_unavailable(device: torch.device) -> str | None:
    """Why this process cannot use `cuda_ipc` on `device` at all (None: it can try)."""
    if device.type != "cuda":
        return f"cuda_ipc moves GPU tensors, and the device is {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not hasattr(torch.UntypedStorage, "_new_shared_cuda") or not os.path.isdir("/dev/shm"):
        return "this torch build or OS has no CUDA IPC sharing"
    return stream_words_unavailable()


def _probe_pattern(device: torch.device | str = "cpu") -> torch.Tensor:
    return (torch.arange(_PROBE_BYTES, dtype=torch.int64, device=device) * 131 % 251).to(torch.uint8)


@dataclass
class _Pair:
    """The producer's side of one consumer: the stream its marks are written on, in order,
    and the word they go to."""

    stream: torch.cuda.Stream
    address: int
    marked: int = 0

    def mark(self, words: StreamWords) -> int:
        """The pair's stream writes the next mark once what it waits for is written."""
        self.marked += 1
        words.write(self.stream, self.address, self.marked)
        return self.marked


@dataclass
class _Session:
    """The consumer's side of one welcome: a receive stream and waiter of its own, the word
    the producer marks its ranges in, and the allocations it opened."""

    device_index: int
    receive: torch.cuda.Stream
    idle: torch.cuda.Stream
    """Current on the waiter thread while it drops a mapping: torch synchronizes the current
    stream there, which must not be one that holds other work."""
    release: torch.cuda.Stream
    """Writes `_ABANDONED` to the mark word when the session ends (never behind a wait)."""
    waiter: WaitThread
    marks: torch.UntypedStorage | None = None
    """The mapping of the producer's mark slab (kept open for the session)."""
    marks_address: int = 0
    allocations: collections.OrderedDict[bytes, torch.UntypedStorage] = field(default_factory=collections.OrderedDict)
    """Per allocation handle, an uncounted storage that keeps its mapping open."""
    slabs: collections.OrderedDict[tuple[bytes, int, int], torch.Tensor] = field(
        default_factory=collections.OrderedDict
    )
    """The producer's registered slabs opened (LRU), as byte tensors: items are ranges of them."""
    evicted: list[torch.UntypedStorage | torch.Tensor] = field(default_factory=list)
    """Mappings to close, on the waiter thread (closing synchronizes the current stream)."""


@dataclass(frozen=True, slots=True)
class _Copy:
    """One range to copy: from a share (at `source` bytes after its start) into the payload."""

    share: m.IpcShare
    source: int
    target: int
    nbytes: int
    mark: int


class _CudaIpc:
    """What both halves of the CUDA IPC transport hold."""

    def __init__(self, device: torch.device) -> None:
        reason = ipc_unavailable(device)
        if reason is not None:
            raise InvalidInputError(f"the cuda_ipc transport cannot run here: {reason}")
        self.name = "cuda_ipc"
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self._pairs: dict[bytes, _Pair] = {}
        self._probe: torch.Tensor | None = None
        self._share_stream: torch.cuda.Stream | None = None
        self._session: _Session | None = None
        self._words = StreamWords()
        self._slabs: list[torch.Tensor] = []
        """Mark words, never freed while the transport lives (see `_MARK_SLOTS`)."""
        self._next_slot = _MARK_SLOTS
        self._unconfirmed: dict[bytes, weakref.WeakKeyDictionary[ItemBytes, list[m.IpcShare]]] = {}
        """Per consumer, the shares of the items sent to it, kept while the item lives: when the
        consumer leaves, those of the items it never confirmed are released here (`forget`)."""
        self._unconfirmed_layers: dict[bytes, dict[int, tuple[int, m.IpcShare, torch.Tensor | None]]] = {}
        """The same for the layers of streams, per consumer and share (by its id), while the bytes
        they were shared from live: the stream's item id, the share, and for a finished item's
        layer the buffer it was packed into for the reader (kept here, so that the count's slot
        is still that buffer's when `forget` releases it; torch alone would keep the buffer in
        its limbo for good)."""


class CudaIpcSender(_CudaIpc, Sender):
    """The producer's half: shares an item's storage with the consumer's process. Items in
    registered memory (`allocate`) are offsets of slabs each consumer maps once; any other
    storage is shared by torch, which counts its reads."""

    def __init__(self, device: torch.device, registered_bytes: int = 0) -> None:
        super().__init__(device)
        self._arena = RegisteredArena(self.device, registered_bytes)

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        return self._arena.allocate(nbytes)

    def note_written(self, item: ItemBytes) -> None:
        if item.storage.device.type == "cuda":
            self._arena.written(item.storage, item.written)

    def reclaim(self) -> None:
        # Items whose consumer already dropped its mapping, but which torch keeps in its
        # "limbo" until asked, go back to the allocator.
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]

    def offer(self, peer: bytes) -> dict[str, str]:
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            if self._probe is None:
                self._probe = _probe_pattern(self.device)
                torch.cuda.current_stream(self.device).synchronize()  # a few KiB, once
            if self._next_slot == _MARK_SLOTS:
                self._slabs.append(torch.zeros(_MARK_SLOTS, dtype=torch.int64, device=self.device))
                torch.cuda.current_stream(self.device).synchronize()  # zero before any mark
                self._next_slot = 0
        slab, slot = self._slabs[-1], self._next_slot
        self._next_slot += 1
        self._pairs[peer] = _Pair(stream, slab.data_ptr() + slot * slab.element_size())
        probe = self._share(peer, self._probe, [])  # written and synchronized already
        marks = self._share(peer, slab, [])
        return {
            "host": host_identity(),
            "probe": m.encode_share(probe).hex(),
            "marks": m.encode_share(marks).hex(),
            "slot": str(slot),
        }

    async def send(self, peer: bytes, transfer: Transfer, post: Post) -> None:
        """The frames name the shared memory and each range's mark: they go with the header."""
        if not transfer.items:
            post(self._layer_frames(peer, transfer.stream_id, transfer.tensors, transfer.ready))
            return
        await transfer.written()
        if transfer.batch is None:
            post(self._item_frames(peer, transfer.items[0], transfer.segments))
        else:
            post(self._batch_frames(peer, transfer.items))

    def _item_frames(self, peer: bytes, item: ItemBytes, segments: Sequence[tuple[int, int]]) -> list[memoryview]:
        if item.nbytes == 0:
            return []
        segments = transfer_segments(segments, item.storage.numel())
        if item.segment_ready:  # a published item: each chunk once its gather wrote it
            ready: list[torch.cuda.Event | None] = list(item.segment_ready)
        else:
            ready = [item.written] + [None] * (len(segments) - 1)
        share = self._share(peer, item.storage, ready)
        self._sent(peer, item, share)
        return [memoryview(m.encode_share(share))]

    def _batch_frames(self, peer: bytes, items: Sequence[ItemBytes]) -> list[memoryview]:
        """One frame per hit: each hit is read from its own storage."""
        frames = []
        for item in items:
            written = item.written
            share = self._share(peer, item.storage, [written])
            self._sent(peer, item, share)
            frames.append(memoryview(m.encode_share(share)))
        return frames

    def _layer_frames(
        self, peer: bytes, item_id: int, tensors: Sequence[torch.Tensor], ready: torch.cuda.Event | None
    ) -> list[memoryview]:
        placed, nbytes = back_to_back([tensor_meta(tensor) for tensor in tensors])
        if nbytes == 0:
            return []
        buffer = span_of(tensors, placed, nbytes)
        packed: torch.Tensor | None = None
        if buffer is not None:
            share = self._share(peer, buffer, [ready])
            source: object = tensors[0]  # the stream holds the layer, so its storage and count's slot
        else:
            # A finished item's layer, whose key and value lie apart: packed into a buffer of
            # its own, kept while the item lives (its storage: it leaves the buffer once confirmed).
            pair = self._pair(peer)
            with on_device(self.device), OnStream(pair.stream):
                if ready is not None:
                    pair.stream.wait_event(ready)
                packed = pack_back_to_back(tensors, placed, nbytes, self.device)
            share = self._share(peer, packed, [None])  # packed on the pair's stream: its marks come after
            source = tensors[0].untyped_storage()
        # Released by `forget` if the reader leaves without confirming the stream's item.
        layers = self._unconfirmed_layers.setdefault(peer, {})
        layers[id(share)] = (item_id, share, packed)
        weakref.finalize(source, layers.pop, id(share), None)
        return [memoryview(m.encode_share(share))]

    def forget(self, peer: bytes, unconfirmed: Sequence[ItemBytes] = ()) -> None:
        """Torch counted one reference per share, which the consumer gives back when it drops
        what it opened. A consumer killed (or lost) before that never will: the items it did
        not confirm keep their counts, and once the producer drops them (when another consumer
        confirms them) their memory would stay in torch's limbo for good. So their counts are
        released here, once per share. A consumer that dropped its opening and died before its
        `Received` left takes its count below zero, which frees the memory all the same
        (torch frees a shared block whose count is not above zero); the item is back in the
        buffer, so its storage, and the count's slot with it, are alive: no other storage's
        count is touched. A stream's layers are released the same way, for the stream items
        (open, or finished and not confirmed) the reader left with; a finished item's layers,
        packed for the reader, live here until then, so their slots are theirs too."""
        self._pairs.pop(peer, None)
        sent = self._unconfirmed.pop(peer, None)
        if sent is not None:
            for item in unconfirmed:
                for share in sent.pop(item, ()):
                    _release(share)
        streamed = self._unconfirmed_layers.pop(peer, {})
        unconfirmed_ids = {item.item_id for item in unconfirmed}  # a stream's, or its whole item's
        for item_id, share, _ in list(streamed.values()):
            if item_id in unconfirmed_ids:
                _release(share)
        streamed.clear()  # the packed buffers go (torch frees each once its count is not above zero)
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]

    def _sent(self, peer: bytes, item: ItemBytes, share: m.IpcShare) -> None:
        if not share.counter:
            return  # registered memory: nothing counted to release
        self._unconfirmed.setdefault(peer, weakref.WeakKeyDictionary()).setdefault(item, []).append(share)

    def _pair(self, peer: bytes) -> _Pair:
        pair = self._pairs.get(peer)
        if pair is None:
            raise PeerLostError("the consumer left before its item could be sent")
        return pair

    def _share(self, peer: bytes, tensor: torch.Tensor, ready: Sequence[torch.cuda.Event | None]) -> m.IpcShare:
        """`tensor`'s storage shared with `peer`, with one mark per range it travels in,
        recorded on the pair's stream after that range's `ready` event (None: nothing more
        to wait for), in order."""
        pair = self._pair(peer)
        marks = []
        with on_device(self.device):  # the driver's stream operations take the current context
            for event in ready:
                if event is not None and event.query():
                    # Written already (an insert's copy is long done by the time it is asked
                    # for): the consumer need not wait on anything of this process's GPU.
                    marks.append(0)
                    continue
                if event is not None:
                    pair.stream.wait_event(event)  # the GPU waits; the loop does not
                marks.append(pair.mark(self._words))
        placed = self._arena.place(tensor)
        if placed is not None:
            slab, start = placed
            if slab.share is None:
                slab.share = self._torch_share(slab.tensor)
            _, handle, storage_bytes, storage_offset, _, _, _, _ = slab.share
            # Uncounted: the slab outlives every delivery, and the region outlives every read
            # of it (see `kvrt.transports._arena`).
            return m.IpcShare(
                handle=handle,
                storage_offset=storage_offset,
                storage_bytes=storage_bytes,
                counter=b"",
                counter_offset=0,
                start=start,
                marks=marks,
            )
        _, handle, storage_bytes, storage_offset, counter, counter_offset, _, _ = self._torch_share(tensor)
        return m.IpcShare(
            handle=handle,
            storage_offset=storage_offset,
            storage_bytes=storage_bytes,
            counter=counter,
            counter_offset=counter_offset,
            start=int(tensor.storage_offset()) * tensor.element_size(),
            marks=marks,
        )

    def _torch_share(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        """torch's share of `tensor`'s storage: its allocation's handle, place, and a counter."""
        if self._share_stream is None:
            self._share_stream = torch.cuda.Stream(self.device)
        # torch records an event of its own on the current stream when it shares (and, past a
        # thousand shared storages alive, synchronizes that stream instead): one nothing runs on.
        with on_device(self.device), OnStream(self._share_stream):
            storage = tensor.untyped_storage()
            return tuple(storage._share_cuda_())  # type: ignore[no-untyped-call]

    async def aclose(self) -> None:
        self._pairs.clear()
        self._unconfirmed.clear()
        for slab in self._arena.slabs:
            if slab.share is not None:
                # torch's count of the slab's one share: the slab goes back to the allocator
                # once the last item in it does.
                _, _, _, _, counter, counter_offset, _, _ = slab.share
                with contextlib.suppress(RuntimeError):
                    torch.UntypedStorage._release_ipc_counter_cuda(counter, counter_offset)
                slab.share = None
        for layers in self._unconfirmed_layers.values():
            layers.clear()  # their finalizers keep the dicts: the packed buffers must go now
        self._unconfirmed_layers.clear()


class CudaIpcReceiver(_CudaIpc, Receiver):
    """The consumer's half: opens the producer's shares and copies out of them on its own streams."""

    async def join(self, rendezvous: dict[str, str], timeout_s: float) -> None:
        if rendezvous.get("host") != host_identity():
            raise TransportUnavailableError("cuda_ipc: the producer runs on another machine")
        try:
            probe = m.decode_share(bytes.fromhex(rendezvous["probe"]))
            marks = m.decode_share(bytes.fromhex(rendezvous["marks"]))
            slot = int(rendezvous["slot"])
        except (KeyError, ValueError):
            raise RemoteProtocolError(f"welcome has no usable cuda_ipc rendezvous: {rendezvous}") from None
        if not 0 <= slot < (marks.storage_bytes - marks.start) // 8:
            raise RemoteProtocolError(f"cuda_ipc mark slot {slot} is outside its slab")
        self._end_session()
        with torch.cuda.device(self.device):
            session = _Session(
                device_index=self.device.index or 0,
                receive=torch.cuda.Stream(),
                idle=torch.cuda.Stream(),
                release=torch.cuda.Stream(),
                waiter=WaitThread("kvrt-ipc-copy"),
            )
        try:
            await asyncio.wait_for(asyncio.to_thread(self._check_probe, session, probe, marks, slot), timeout_s)
        except TimeoutError:
            session.waiter.close()
            raise KVRTTimeoutError(
                f"opening the producer's cuda_ipc probe took over {timeout_s} s", phase="connect"
            ) from None
        except TransportUnavailableError:
            session.waiter.close()
            raise
        self._session = session

    def _check_probe(self, session: _Session, probe: m.IpcShare, marks: m.IpcShare, slot: int) -> None:
        """In a thread: open the probe, copy it, and compare its bytes; the counter file must be
        reachable too (else every item would stay pinned in the producer); open the mark word
        and wait on it once (the driver must take a stream wait on the producer's memory)."""
        counter_path = os.path.join("/dev/shm", probe.counter.decode(errors="replace").lstrip("/"))
        if not os.path.exists(counter_path):
            _release(probe)
            raise TransportUnavailableError(
                f"cuda_ipc: the producer's shared memory ({counter_path}) is not visible here "
                "(another IPC namespace or /dev/shm?)"
            )
        torch.cuda.set_device(self.device)
        try:
            with torch.cuda.stream(session.receive):
                source = self._opened(session, probe)
                copied = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=self.device)
                copied.copy_(source[probe.start : probe.start + _PROBE_BYTES])
                matches = bool(torch.equal(copied.cpu(), _probe_pattern()))
                del source
                session.marks = _new_shared(session.device_index, marks, counted=False)
                session.marks_address = session.marks.data_ptr() + marks.start + 8 * slot
                self._words.wait_at_least(session.receive, session.marks_address, 0)
                session.receive.synchronize()
        except RuntimeError as exc:
            raise TransportUnavailableError(f"cuda_ipc: the producer's memory cannot be opened here: {exc}") from None
        if not matches:
            raise TransportUnavailableError("cuda_ipc: the producer's probe read back wrong bytes")

    def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> Arrival:
        share = self._share_in(frames)
        try:
            segments = transfer_segments(deliver.segments, deliver.payload_bytes)
            check_segments(segments, deliver.payload_bytes)
            payload = self._payload(deliver.payload_bytes, share)
            tensors = five(unpack_tensor(item_metas(deliver), payload))  # refuses lying metas first
            if len(share.marks) != max(1, len(segments)) or (not segments and deliver.payload_bytes):
                raise RemoteProtocolError(
                    f"item {deliver.item_id}: {len(share.marks)} marks for {len(segments)} segments"
                )
        except BaseException:
            _release(share)
            raise
        if not segments:
            _release(share)
            done: asyncio.Future[ItemTensors] = asyncio.get_running_loop().create_future()
            done.set_result(tensors)
            return Arrival(done)
        parts = [
            [_Copy(share, offset, offset, nbytes, mark)]
            for (offset, nbytes), mark in zip(segments, share.marks, strict=True)
        ]
        completed, landed = self._post(payload, parts, tensors, landed_check(self, payload, [(deliver, 0)]))
        return Arrival(completed, tensors, tuple(landed))

    def receive_many(self, message: DeliverMany, frames: Sequence[zmq.Frame]) -> asyncio.Future[list[ItemTensors]]:
        hits = batch_hits(message)
        if len(frames) != len(hits):
            raise RemoteProtocolError(f"deliver_many with {len(hits)} hits needs as many frames, {len(frames)} came")
        shares = [self._share_in([frame]) for frame in frames]
        try:
            entries = checked_batch(message, hits)
            for hit, share in zip(hits, shares, strict=True):
                if len(share.marks) != 1 or share.storage_bytes - share.start < hit.payload_bytes:
                    raise RemoteProtocolError(f"item {hit.item_id}: its cuda_ipc share does not hold it")
            payload = self._payload(message.payload_bytes, None)
        except BaseException:
            for share in shares:
                _release(share)
            raise
        tensors = [five(views) for views in batch_views(entries, payload)]
        copies = [
            _Copy(share, 0, hit.offset, hit.payload_bytes, share.marks[0])
            for hit, share in zip(hits, shares, strict=True)
        ]
        if not copies:
            done: asyncio.Future[list[ItemTensors]] = asyncio.get_running_loop().create_future()
            done.set_result(tensors)
            return done
        check = landed_check(self, payload, [(hit, hit.offset) for hit in hits])
        return self._post(payload, [copies], tensors, check)[0]

    def receive_tensors(self, metas: Sequence[TensorMeta], frames: Sequence[zmq.Frame]) -> TensorsArrival:
        placed, nbytes = back_to_back(metas)
        if nbytes == 0:
            if frames:
                raise RemoteProtocolError(f"an empty cuda_ipc stream message carries no frames, {len(frames)} came")
            payload = torch.empty(0, dtype=torch.uint8, device=self.device)
            done: asyncio.Future[list[torch.Tensor]] = asyncio.get_running_loop().create_future()
            done.set_result([tensor for tensor in unpack_tensor(placed, payload) if tensor is not None])
            return TensorsArrival(done, done.result())
        share = self._share_in(frames)
        try:
            if len(share.marks) != 1:
                raise RemoteProtocolError(f"a cuda_ipc stream message has one mark, {len(share.marks)} came")
            payload = self._payload(nbytes, share)
            tensors = [tensor for tensor in unpack_tensor(placed, payload) if tensor is not None]
        except BaseException:
            _release(share)
            raise
        completed, landed = self._post(payload, [[_Copy(share, 0, 0, nbytes, share.marks[0])]], tensors)
        return TensorsArrival(completed, tensors, landed[-1])

    def discard(self, frames: Sequence[zmq.Frame]) -> None:
        """A share this side will not read (a stream it gave back): its counter is released, or
        the producer's memory would stay pinned."""
        for frame in frames:
            with contextlib.suppress(RemoteProtocolError):
                _release(m.decode_share(frame.buffer))

    def _share_in(self, frames: Sequence[zmq.Frame]) -> m.IpcShare:
        if len(frames) != 1:
            raise RemoteProtocolError(f"a cuda_ipc transfer carries one frame, {len(frames)} came")
        return m.decode_share(frames[0].buffer)

    def _payload(self, payload_bytes: int, share: m.IpcShare | None) -> torch.Tensor:
        if self._session is None:
            raise RemoteProtocolError("a cuda_ipc transfer arrived before the pair was joined")
        if payload_bytes > _MAX_PAYLOAD_BYTES:
            raise RemoteProtocolError(f"transfer announces {payload_bytes} bytes, over {_MAX_PAYLOAD_BYTES}")
        if share is not None and share.storage_bytes - share.start < payload_bytes:
            raise RemoteProtocolError(
                f"the shared storage holds {share.storage_bytes - share.start} bytes, {payload_bytes} announced"
            )
        return torch.empty(payload_bytes, dtype=torch.uint8, device=self.device)

    def _post(
        self, payload: torch.Tensor, parts: Sequence[Sequence[_Copy]], result: _T,
        check: Callable[[], None] | None = None,
    ) -> tuple[asyncio.Future[_T], list[torch.cuda.Event]]:  # fmt: skip
        """Queue the copies on the session's receive stream, each part after the producer
        marked its ranges written: a future done with `result` once all landed (and `check`,
        run then on that stream, passed), and an event per part (in order)."""
        session = self._session
        assert session is not None  # checked by _payload
        stream = session.receive
        landed: list[torch.cuda.Event] = []
        # One counted opening per share, however many ranges are read from it: each opening
        # maps the producer's counter file (the chunks of a pull are ranges of one share).
        opened: dict[int, torch.Tensor] = {}
        try:
            with on_device(self.device), OnStream(stream):
                payload.record_stream(stream)
                for index, part in enumerate(parts):
                    # Marks are written in order on one stream: the part's last is enough (0:
                    # the producer's bytes were written before it sent them).
                    mark = max(copy.mark for copy in part)
                    if mark:
                        self._words.wait_at_least(stream, session.marks_address, mark)
                    for copy in part:
                        source = opened.get(id(copy.share))
                        if source is None:
                            source = opened[id(copy.share)] = self._opened(session, copy.share)
                        start = copy.share.start + copy.source
                        payload[copy.target : copy.target + copy.nbytes].copy_(
                            source[start : start + copy.nbytes], non_blocking=True
                        )
                    # As for NCCL receives (see `paired`): the waiting thread sleeps until the
                    # last part but one, then spins on the last, which it learns of sooner.
                    event = torch.cuda.Event(blocking=index != len(parts) - 1 or len(parts) == 1)
                    event.record(stream)
                    landed.append(event)
        except RuntimeError as exc:
            # The shares not opened yet are released here, once each; the opened ones are,
            # once each, when their storages are dropped.
            shares = {id(copy.share): copy.share for part in parts for copy in part}
            for key, share in shares.items():
                if key not in opened:
                    _release(share)
            raise RemoteProtocolError(f"could not open the producer's cuda_ipc share: {exc}") from None
        # Dropped after these copies, on the waiter's thread, with the mappings evicted since
        # (a registered slab stays open: the thread has nothing to drop for it).
        counted = {id(copy.share) for part in parts for copy in part if copy.share.counter}
        sources: list[torch.Tensor | torch.UntypedStorage] = [
            *(source for key, source in opened.items() if key in counted),
            *session.evicted,
        ]
        session.evicted.clear()
        idle = session.idle
        device = self.device

        def wait() -> None:
            if len(landed) > 1:
                landed[-2].synchronize()
            landed[-1].synchronize()
            if sources:
                _drop(device, idle, sources)
            if check is not None:
                with on_device(device), OnStream(stream):
                    check()

        return session.waiter.wait(wait, result), landed

    def _opened(self, session: _Session, share: m.IpcShare) -> torch.Tensor:
        """`share`'s storage as a byte tensor on this device, its allocation's mapping cached.
        A share without a counter is a slab of the producer's registered memory: opened once,
        and kept open, for every item in it."""
        if not share.counter:
            key = (share.handle, share.storage_offset, share.storage_bytes)
            slab = session.slabs.get(key)
            if slab is None:
                storage = _new_shared(session.device_index, share, counted=False)
                slab = session.slabs[key] = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
                if len(session.slabs) > _OPEN_ALLOCATIONS:
                    session.evicted.append(session.slabs.popitem(last=False)[1])
            else:
                session.slabs.move_to_end(key)
            return slab
        allocations = session.allocations
        if share.handle in allocations:
            allocations.move_to_end(share.handle)
        else:
            # The mapping is what costs (~10 ms for 1 GiB); an anchor storage without a
            # counter keeps it open for the next shares of the same allocation.
            allocations[share.handle] = _new_shared(session.device_index, share, counted=False)
            if len(allocations) > _OPEN_ALLOCATIONS:
                session.evicted.append(allocations.popitem(last=False)[1])
        storage = _new_shared(session.device_index, share, counted=True)
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)

    def abandon(self) -> None:
        """The link gave the producer up: every wait of the session passes (the producer may
        be dead and never mark what it announced), and the next welcome's join starts a new
        session. What those copies read is no one's any more: their calls failed already."""
        self._end_session()

    def _end_session(self) -> None:
        """Release the session's waits (a number past every mark, written from a stream of its
        own, never behind them), then close its mappings on its waiter thread, once the copies
        queued before are done (they all end now: a dead producer's memory stays readable
        through an open mapping)."""
        session, self._session = self._session, None
        if session is None:
            return
        if session.marks is not None:
            with on_device(self.device):
                self._words.write(session.release, session.marks_address, _ABANDONED)
        held = [*session.allocations.values(), *session.slabs.values(), *session.evicted, session.marks]
        session.allocations.clear()
        session.slabs.clear()
        session.evicted.clear()
        idle, release, device = session.idle, session.release, self.device

        def close_mappings() -> None:
            release.synchronize()  # the word is written before its mapping closes
            _drop(device, idle, held)

        session.waiter.wait(close_mappings).add_done_callback(outcome_seen)
        session.waiter.close()

    async def aclose(self) -> None:
        self._end_session()


def _new_shared(device_index: int, share: m.IpcShare, *, counted: bool) -> torch.UntypedStorage:
    """Open a share on `device_index` (this process's own GPU: the mapping is made there, with
    peer access, so no context is created on the producer's GPU). Uncounted, dropping it
    decrements nothing (torch's decrement of a counter file that does not exist is a no-op)."""
    return torch.UntypedStorage._new_shared_cuda(
        device_index,
        share.handle,
        share.storage_bytes,
        share.storage_offset,
        share.counter if counted else b"",
        share.counter_offset if counted else 0,
        b"",
        False,  # the marks say when the bytes are there, not torch's own event
    )


def _drop(device: torch.device, idle: torch.cuda.Stream, *held: list[Any]) -> None:
    """On a kvrt thread, after the copies that read them: clear `held` (shares' storages and
    views of them). Dropping a share's storage decrements the producer's counter after torch
    synchronizes the current stream, so an idle one is made current. The device is set once
    per thread (then a check): `torch.cuda.stream` would switch it there and back each time
    (cudaSetDevice)."""
    torch.cuda.set_device(device)
    with OnStream(idle):
        for references in held:
            references.clear()


def _release(share: m.IpcShare) -> None:
    """Decrement a share's counter without opening it (the consumer will not read it); a
    share of registered memory has none."""
    if not share.counter:
        return
    with contextlib.suppress(RuntimeError):
        torch.UntypedStorage._release_ipc_counter_cuda(share.counter, share.counter_offset)


__all__ = ["CudaIpcReceiver", "CudaIpcSender", "host_identity", "ipc_unavailable"]
