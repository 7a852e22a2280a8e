"""Paired transports: a 2-rank torch.distributed process group per producer/consumer pair.

`nccl` moves GPU tensors (NVLink or IB/RoCE, whatever NCCL finds); `gloo` is the same
machinery on CPU tensors, so that pairing, ordering and failure handling are tested in CI
on hosts without a GPU.

Pairing on demand, through the control plane: when a consumer's hello picks this
transport, the producer `offer`s a rendezvous (the address of a `TCPStore` the producer
hosts and a fresh pair id) that travels in the welcome; both sides then build the process
group (producer rank 0, consumer rank 1) and exchange one small tensor to bring the
communicator up. That blocking set-up runs in a thread kvrt owns, never on the loop. A
peer that leaves (bye, silence) has its group aborted, which also ends a transfer stuck
on a dead peer; a consumer that comes back gets a new pair.

Ordering: point-to-point operations of a pair must match in order. The producer issues
each item's send and sends its Deliver header under one lock, and the consumer posts
receives in the order headers arrive, which ZeroMQ keeps.

GPU streams (nccl): the item was packed on the inserting caller's stream, and an event
recorded there (`prepare`); sends run on a dedicated stream that waits on that event, so
a transfer never reads KV before it is written, and the caller's stream never waits for a
transfer. Receives run on another dedicated stream; their completion is an event that a
kvrt-owned thread waits for, waking the loop, so neither the loop nor any compute stream
blocks on a transfer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import functools
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import zmq
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from kvrt._errors import InvalidInputError, KVRTError, KVRTTimeoutError, PeerLostError, RemoteProtocolError
from kvrt._item_bytes import ItemBytes, gathers_prepared
from kvrt._messages import BATCH_ALIGNMENT, Deliver, DeliverMany, Hit, TensorMeta
from kvrt._tensors import (
    back_to_back,
    batch_views,
    check_batch_segments,
    check_metas,
    check_segments,
    pack_back_to_back,
    span_of,
    tensor_meta,
    transfer_segments,
    unpack_tensor,
)
from kvrt._threads import WaitThread, in_daemon_thread, outcome_seen
from kvrt.transports._base import (
    Arrival,
    ItemTensors,
    OnStream,
    Post,
    Receiver,
    Refusing,
    Sender,
    TensorsArrival,
    Transfer,
    batch_hits,
    five,
    item_metas,
    landed_check,
    on_device,
)

_PRODUCER_RANK = 0
_CONSUMER_RANK = 1
_TAG = 0
_STORE_TIMEOUT = datetime.timedelta(seconds=60)
_T = TypeVar("_T")
_MAX_PAYLOAD_BYTES = 1 << 40
"""A Deliver announcing more than this (1 TiB) is refused before anything is allocated."""


def _process_group(backend: str, store: Store, rank: int, timeout: datetime.timedelta) -> Any:
    """A 2-rank process group on `store`, outside any global torch.distributed world."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    # NCCL's kernels run on the group's internal streams: high priority lets them take SMs
    # ahead of a concurrent gather, scatter or compute kernel that would otherwise hold
    # every SM and keep the transfer waiting.
    options.is_high_priority_stream = True
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def _abort(group: Any) -> None:
    """Abort a pair's group: ends operations stuck on a dead peer and frees its resources.
    (`abort` is the method's name across the torch versions kvrt supports; `shutdown`
    is the fallback some builds have.)"""
    for method in ("abort", "shutdown"):
        stop = getattr(group, method, None)
        if stop is not None:
            try:
                stop()
            except RuntimeError:
                pass  # already broken: nothing more to free
            return


@dataclass
class _Pair:
    """One producer/consumer pair: its group once established, and the sends in flight
    (each with how to learn that it finished: NCCL works answer `is_completed`; gloo's send
    works do only once waited for, which a kvrt thread does)."""

    pair_id: str
    established: concurrent.futures.Future[Any]
    sends: deque[tuple[Any, asyncio.Future[None] | None, torch.Tensor | None]] = field(default_factory=deque)
    """(work, the thread waiting for it or None, a staging buffer it reads or None)."""


class _Paired:
    """What both halves of a paired transport hold (pairs, set-up threads, streams), and how
    either closes. One half per producer or consumer; `backend` is "nccl" (GPU) or "gloo" (CPU)."""

    def __init__(self, backend: str, device: torch.device, *, store_host: str = "127.0.0.1") -> None:
        if backend not in ("nccl", "gloo"):
            raise InvalidInputError(f"paired transport backend must be nccl or gloo, got {backend!r}")
        if backend == "nccl" and device.type != "cuda":
            raise InvalidInputError(f"the nccl transport needs a CUDA device, got {device}")
        if backend == "gloo" and device.type != "cpu":
            raise InvalidInputError(f"the gloo transport moves CPU tensors, got {device}")
        self.name = backend
        self.backend = backend
        self.device = device
        self._store_host = store_host
        self._store: TCPStore | None = None
        self._pairs: dict[bytes, _Pair] = {}
        self._pair: _Pair | None = None
        self._waiter = WaitThread("kvrt-transfer")
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        if backend == "nccl":
            with torch.cuda.device(device):
                self._streams = (torch.cuda.Stream(), torch.cuda.Stream())

    async def aclose(self) -> None:
        for pair in self._pairs.values():
            self._release(pair)
        self._pairs.clear()
        if self._pair is not None:
            self._release(self._pair)
            self._pair = None
        self._waiter.close()

    def _establish(self, host: str, port: int, pair_id: str, rank: int) -> Any:
        """In a set-up thread: build the pair's group on a store connection of its own (a
        connection's operations wait in turn: a rendezvous that waits for a peer must not hold
        the others'), and bring its communicator up with one small exchange (NCCL creates it
        lazily, at the first operation of both ranks)."""
        store = TCPStore(host, port, is_master=False, timeout=_STORE_TIMEOUT)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        group = _process_group(self.backend, PrefixStore(f"kvrt/{pair_id}", store), rank, _STORE_TIMEOUT)
        probe = torch.ones(1, device=self.device)
        work = group.send([probe], 1 - rank, _TAG) if rank == _PRODUCER_RANK else group.recv([probe], 1 - rank, _TAG)
        work.wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return group

    def _set_up(self, host: str, port: int, pair_id: str, rank: int) -> concurrent.futures.Future[Any]:
        """`_establish` on a daemon thread of its own: a peer that never joins (it fell back to
        another transport, or died) keeps that thread waiting until the store's timeout, and
        neither the other pairs nor the process's exit wait for it."""
        return in_daemon_thread(functools.partial(self._establish, host, port, pair_id, rank), "kvrt-pair")

    def _release(self, pair: _Pair) -> None:
        """Abort the pair's group on a daemon thread (an abort can wait on the dead peer's
        kernels; the loop must not), as soon as it is established."""
        pair.established.add_done_callback(_abort_off_the_loop)


class PairedSender(_Paired, Sender):
    """The producer's half: one pair (a two-rank process group) per consumer, sends on it."""

    def _host_store(self) -> TCPStore:
        if self._store is None:
            self._store = TCPStore(self._store_host, 0, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT)
        return self._store

    def reclaim(self) -> None:
        for pair in self._pairs.values():
            _drop_finished(pair)

    def offer(self, peer: bytes) -> dict[str, str]:
        store = self._host_store()
        pair_id = uuid.uuid4().hex
        established = self._set_up(self._store_host, store.port, pair_id, _PRODUCER_RANK)
        old = self._pairs.pop(peer, None)
        if old is not None:
            self._release(old)
        self._pairs[peer] = _Pair(pair_id, established)
        return {"store": f"{self._store_host}:{store.port}", "pair": pair_id, "backend": self.backend}

    async def send(self, peer: bytes, transfer: Transfer, post: Post) -> None:
        """The header first, then the sends (the consumer posts its receives as it comes):
        under the producer's send lock a delivery's header and sends go before the next's."""
        if transfer.tensors:
            post([])
            await self._send_tensors(peer, transfer.tensors, transfer.ready)
        elif transfer.batch is not None:
            await transfer.written()
            post([])
            await self._send_batch(peer, transfer.batch, transfer.items)
        else:
            (item,) = transfer.items
            post([])
            # Each chunk of a published item's gather is queued right before its send.
            await gathers_prepared(item)
            await self._send_item(peer, item, transfer.segments)

    async def _send_item(self, peer: bytes, item: ItemBytes, segments: Sequence[tuple[int, int]]) -> None:
        pair, group = await self._pair_of(peer)
        if item.nbytes == 0:
            return
        _drop_finished(pair)
        segments = transfer_segments(segments, item.storage.numel())
        if self._streams is not None:
            send_stream = self._streams[0]
            # No record_stream here: this stream only waits, NCCL's reads the storage, and the
            # work (kept in pair.sends until it completed) holds the storage till then.
            with on_device(self.device), OnStream(send_stream):
                if item.ready_event is not None and not item.segment_ready:
                    send_stream.wait_event(item.ready_event)
                for index, (offset, nbytes) in enumerate(segments):
                    if item.segment_ready:  # a published chunk leaves as soon as it is gathered
                        if item.gathers is not None:  # its gather queued just now, if not yet
                            item.gathers.queue_through(item.segment_gathers[index])
                        send_stream.wait_event(item.segment_ready[index])
                    work = group.send([item.storage[offset : offset + nbytes]], _CONSUMER_RANK, _TAG)
                    pair.sends.append((work, None, None))
        else:
            for offset, nbytes in segments:
                work = group.send([item.storage[offset : offset + nbytes]], _CONSUMER_RANK, _TAG)
                pair.sends.append((work, self._waited_send(work), None))

    async def _send_batch(self, peer: bytes, message: DeliverMany, items: Sequence[ItemBytes]) -> None:
        """One NCCL operation per segment of the batch: small hits are copied into one staging
        buffer per segment, each at its offset, so their fixed costs are paid once per
        segment, not per item; a large hit is sent from its own buffer."""
        pair, group = await self._pair_of(peer)
        if message.payload_bytes == 0:
            return
        _drop_finished(pair)
        hits = iter(zip(batch_hits(message), items, strict=True))
        hit = next(hits, None)
        with contextlib.ExitStack() as on_stream:
            send_stream = None
            if self._streams is not None:
                send_stream = self._streams[0]
                on_stream.enter_context(on_device(self.device))
                on_stream.enter_context(OnStream(send_stream))
            for start, nbytes in transfer_segments(message.segments, message.payload_bytes):
                inside: list[tuple[Hit, ItemBytes]] = []
                while hit is not None and hit[0].offset < start + nbytes:
                    inside.append(hit)
                    hit = next(hits, None)
                if send_stream is not None:
                    for _, item in inside:
                        for ready in _written(item):
                            send_stream.wait_event(ready)
                if len(inside) == 1 and (inside[0][0].offset, inside[0][0].payload_bytes) == (start, nbytes):
                    buffer, staging = inside[0][1].storage, None  # a large hit, straight from its own buffer
                else:  # small hits, packed into one transfer
                    buffer = staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                    _pack_hits(staging, start, inside)
                work = group.send([buffer], _CONSUMER_RANK, _TAG)
                waited = None if send_stream is not None else self._waited_send(work)
                pair.sends.append((work, waited, staging))

    async def _send_tensors(self, peer: bytes, tensors: Sequence[torch.Tensor], ready: torch.cuda.Event | None) -> None:
        """One operation for a stream message's tensors: straight from their block when they
        lie back to back in it (a layer `put_layer` copied), else packed on the send stream
        (a finished item's layer, whose key and value lie apart)."""
        pair, group = await self._pair_of(peer)
        placed, nbytes = back_to_back([tensor_meta(tensor) for tensor in tensors])
        if nbytes == 0:
            return
        _drop_finished(pair)
        with contextlib.ExitStack() as on_stream:
            if self._streams is not None:
                send_stream = self._streams[0]
                on_stream.enter_context(on_device(self.device))
                on_stream.enter_context(OnStream(send_stream))
                if ready is not None:
                    send_stream.wait_event(ready)  # the prefill's stream wrote them; it never waits here
            buffer = span_of(tensors, placed, nbytes)
            if buffer is None:
                buffer = pack_back_to_back(tensors, placed, nbytes, self.device)
            work = group.send([buffer], _CONSUMER_RANK, _TAG)
            waited = None if self._streams is not None else self._waited_send(work)
            pair.sends.append((work, waited, buffer))  # the buffer's storage lives till the send ran

    def _waited_send(self, work: Any) -> asyncio.Future[None]:
        """gloo: a send's work answers `is_completed` only once waited for; a kvrt thread does.
        Its failure is the pair's (the peer is lost, the group aborted), reported there."""
        waited = self._waiter.wait(work.wait)
        waited.add_done_callback(outcome_seen)
        return waited

    async def _pair_of(self, peer: bytes) -> tuple[_Pair, Any]:
        """`peer`'s pair and its group, once established."""
        pair = self._pairs.get(peer)
        if pair is None:
            raise PeerLostError("the consumer left before its item could be sent")
        established = pair.established
        return pair, established.result() if established.done() else await asyncio.wrap_future(established)

    def forget(self, peer: bytes, unconfirmed: Sequence[ItemBytes] = ()) -> None:
        pair = self._pairs.pop(peer, None)
        if pair is not None:
            self._release(pair)


class PairedReceiver(_Paired, Receiver):
    """The consumer's half: its one pair with the producer, receives on it. The bytes come
    apart from the header (the sender posts the header first), posted as it comes: a message
    this side refuses leaves its bytes on their way, and the pair out of step (see `refuse`)."""

    def refuse(
        self, link: Refusing, future: asyncio.Future[Any] | None, item_ids: Sequence[int], error: KVRTError
    ) -> None:
        link.start_afresh(future, error)  # its bytes are on their way: the next receive would take them

    def refuse_unread(
        self, link: Refusing, future: asyncio.Future[Any] | None, item_ids: Sequence[int], error: KVRTError,
        frames: Sequence[zmq.Frame],
    ) -> None:  # fmt: skip
        link.start_afresh(future, error)

    def refuse_stream(self, link: Refusing, item_id: int, error: KVRTError) -> None:
        link.start_afresh(None, error)

    def skip(self, metas: Sequence[TensorMeta], frames: Sequence[zmq.Frame]) -> asyncio.Future[Any] | None:
        """Its tensors are on their way all the same: received, and dropped, or the next
        receive on the pair would take them."""
        return self.receive_tensors(metas, frames).complete if metas else None

    async def join(self, rendezvous: dict[str, str], timeout_s: float) -> None:
        try:
            host, port_text = rendezvous["store"].rsplit(":", 1)
            port, pair_id = int(port_text), rendezvous["pair"]
        except (KeyError, ValueError):
            raise RemoteProtocolError(f"welcome has no usable {self.backend} rendezvous: {rendezvous}") from None
        established = self._set_up(host, port, pair_id, _CONSUMER_RANK)
        if self._pair is not None:
            self._release(self._pair)
        self._pair = _Pair(pair_id, established)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(established)), timeout_s)
        except TimeoutError:
            raise KVRTTimeoutError(
                f"the {self.backend} pair with the producer did not come up within {timeout_s} s",
                phase="connect",
            ) from None

    def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> Arrival:
        segments = transfer_segments(deliver.segments, deliver.payload_bytes)
        check_segments(segments, deliver.payload_bytes)
        payload, group = self._payload(deliver.payload_bytes, frames)
        tensors = self._unpacked(item_metas(deliver), payload)  # refuses lying metas before anything is posted
        if not segments:
            done: asyncio.Future[ItemTensors] = asyncio.get_running_loop().create_future()
            done.set_result(tensors)
            return Arrival(done)
        check = landed_check(self, payload, [(deliver, 0)])
        completed, landed = self._post(group, payload, segments, tensors, check)
        return Arrival(completed, tensors if landed else None, tuple(landed))

    def receive_many(self, message: DeliverMany, frames: Sequence[zmq.Frame]) -> asyncio.Future[list[ItemTensors]]:
        hits = batch_hits(message)
        segments = transfer_segments(message.segments, message.payload_bytes)
        # Everything is checked before anything is posted.
        check_batch_segments(segments, [(hit.offset, hit.payload_bytes) for hit in hits], message.payload_bytes)
        entries = [(item_metas(hit), hit.offset) for hit in hits]
        checked = None
        for hit, (metas, _) in zip(hits, entries, strict=True):
            if hit.offset % BATCH_ALIGNMENT:
                raise RemoteProtocolError(f"item {hit.item_id} at offset {hit.offset} of its batch is misaligned")
            if (metas, hit.payload_bytes) != checked:  # hits laid out alike are checked once
                check_metas(metas, hit.payload_bytes)
                checked = (metas, hit.payload_bytes)
        payload, group = self._payload(message.payload_bytes, frames)
        tensors: list[ItemTensors] = []
        if not segments:
            done: asyncio.Future[list[ItemTensors]] = asyncio.get_running_loop().create_future()
            done.set_result(tensors)
        else:
            check = landed_check(self, payload, [(hit, hit.offset) for hit in hits])
            done = self._post(group, payload, segments, tensors, check)[0]
        # Made while the bytes travel: the future hands the list over only once they landed.
        tensors += [five(views) for views in batch_views(entries, payload)]
        return done

    def receive_tensors(self, metas: Sequence[TensorMeta], frames: Sequence[zmq.Frame]) -> TensorsArrival:
        placed, nbytes = back_to_back(metas)
        payload, group = self._payload(nbytes, frames)
        tensors = [tensor for tensor in unpack_tensor(placed, payload) if tensor is not None]
        if nbytes == 0:
            done: asyncio.Future[list[torch.Tensor]] = asyncio.get_running_loop().create_future()
            done.set_result(tensors)
            return TensorsArrival(done, tensors)
        completed, landed = self._post(group, payload, [(0, nbytes)], tensors)
        return TensorsArrival(completed, tensors, landed[-1] if landed else None)

    def _payload(self, payload_bytes: int, frames: Sequence[zmq.Frame]) -> tuple[torch.Tensor, Any]:
        """A receive buffer for an announced payload, and the pair's group; refuses what
        cannot be received on this pair before anything is allocated."""
        if frames:
            raise RemoteProtocolError(f"a {self.backend} deliver carries no payload frames, {len(frames)} came")
        if payload_bytes > _MAX_PAYLOAD_BYTES:
            raise RemoteProtocolError(f"deliver announces {payload_bytes} bytes, over {_MAX_PAYLOAD_BYTES}")
        pair = self._pair
        if pair is None or not pair.established.done():
            raise RemoteProtocolError(f"deliver arrived before the {self.backend} pair was established")
        return torch.empty(payload_bytes, dtype=torch.uint8, device=self.device), pair.established.result()

    def _post(
        self, group: Any, payload: torch.Tensor, segments: Sequence[tuple[int, int]], result: _T,
        check: Callable[[], None] | None = None,
    ) -> tuple[asyncio.Future[_T], list[torch.cuda.Event]]:  # fmt: skip
        """Post the receives of `payload`'s segments, in order: a future done with `result`
        when all have landed, and (GPU) an event per segment on the receive stream."""
        landed: list[torch.cuda.Event] = []
        works: list[Any] = []
        wait: Callable[[], object]
        if self._streams is not None:
            receive_stream = self._streams[1]
            with on_device(self.device), OnStream(receive_stream):
                payload.record_stream(receive_stream)  # this stream waits for the receives (below)
                for index, (offset, nbytes) in enumerate(segments):
                    work = group.recv([payload[offset : offset + nbytes]], _PRODUCER_RANK, _TAG)
                    work.wait()  # the receive stream waits for NCCL's; the host does not
                    works.append(work)
                    if index < len(segments) - 1:
                        event = torch.cuda.Event(blocking=index == len(segments) - 2)
                        event.record(receive_stream)
                        landed.append(event)
                # The waiting thread sleeps (a blocking event) until the last segment but one
                # has landed, then spins on the last: a sleeper wakes 150-260 us after its
                # event, a spinner 30-50 us, and for a chunked
                # item (a pull) that wake-up is what its caller waits for at the end (a pull
                # returned 0.2 ms sooner, in turns with the sleeping wait in one run). It spins
                # for one segment at most, and a one-segment item keeps sleeping throughout,
                # because a spinning wait contends with the loop's own CUDA calls (on an H200
                # host a device switch took 2.2 ms beside it, under a microsecond without it).
                finished = torch.cuda.Event(blocking=len(segments) == 1)
                finished.record(receive_stream)
                landed.append(finished)  # the last segment's landing is the end of them all
                before_last = landed[-2] if len(landed) > 1 else None

            def wait() -> None:
                if before_last is not None:
                    before_last.synchronize()
                finished.synchronize()
                works.clear()  # on the waiting thread: see WaitThread
                if check is not None:
                    with on_device(payload.device), OnStream(receive_stream):
                        check()

        else:  # gloo
            works += [group.recv([payload[start : start + size]], _PRODUCER_RANK, _TAG) for start, size in segments]

            def wait() -> None:
                for work in works:
                    work.wait()
                works.clear()
                if check is not None:
                    check()

        # Receives complete in the order they were posted, so one waiting thread suffices.
        return self._waiter.wait(wait, result), landed

    @staticmethod
    def _unpacked(metas: Sequence[Any], payload: torch.Tensor) -> ItemTensors:
        return five(unpack_tensor(metas, payload))


def _pack_hits(staging: torch.Tensor, start: int, hits: Sequence[tuple[Hit, ItemBytes]]) -> None:
    """Copy each hit's bytes to its offset in `staging` (which starts at batch offset `start`):
    one `torch.cat` per run of hits that lie back to back, so a batch of small items costs a
    launch or two, not one copy per item (~25 us of host time each on an H200 host)."""
    runs: list[tuple[int, list[torch.Tensor]]] = []  # (first byte, storages back to back from there)
    end = -1
    for entry, item in hits:
        if entry.offset != end:
            runs.append((entry.offset, []))
        runs[-1][1].append(item.storage)
        end = entry.offset + entry.payload_bytes
    for first, storages in runs:
        end = first + sum(storage.numel() for storage in storages)
        target = staging[first - start : end - start]
        if len(storages) == 1:
            target.copy_(storages[0])
        else:
            torch.cat(storages, out=target)


def _written(item: ItemBytes) -> list[torch.cuda.Event]:
    """The events after which an item's storage holds its bytes: each gather of a published
    item, or the inserting stream's."""
    if item.segment_ready:
        return list(item.segment_ready)
    return [] if item.ready_event is None else [item.ready_event]


def _drop_finished(pair: _Pair) -> None:
    """Forget sends that completed (they hold their item's storage; a send must stay
    referenced until it ran)."""
    while pair.sends:
        work, waited, _ = pair.sends[0]
        if not (work.is_completed() if waited is None else waited.done()):
            return
        pair.sends.popleft()


def _abort_off_the_loop(established: concurrent.futures.Future[Any]) -> None:
    in_daemon_thread(functools.partial(_abort_if_established, established), "kvrt-pair-abort")


def _abort_if_established(established: concurrent.futures.Future[Any]) -> None:
    if not established.cancelled() and established.exception() is None:
        _abort(established.result())
