"""What the parts of a producer share, each handed what it uses: the constructor's arguments
checked (`ProducerConfig`), whether the producer serves and whether its buffer has room
(`Gate`), its worker threads (`Workers`), the items' bytes beside the core's records
(`ItemKeeper`), the engine's registered pools (`RegisteredPools`). `Producer` makes them and
hands them to its parts; no part reaches into another.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec
import torch

from kvrt import _messages as m
from kvrt._auth import CurveKeys
from kvrt._checksum import (
    HIDDEN_POSITION,
    metas_seed,
    storage_checksum,
    tensors_device_checksum,
    tensors_seed,
)
from kvrt._errors import (
    ClosedError,
    KVRTTimeoutError,
)
from kvrt._heads import fill_piece, first_head, piece_of
from kvrt._item import NewItem
from kvrt._item_bytes import ItemBytes, TensorsSum, all_gathers_queued
from kvrt._pools import PoolTable
from kvrt._protocol.lookup_buffer import BufferedItem, LookupBuffer
from kvrt._protocol.waiting import PieceAsked
from kvrt._tensors import tensor_meta
from kvrt._threads import gpu_worker, host_worker
from kvrt.transports import Sender

DEFAULT_CHUNK_BYTES = 1 << 30
"""K and V bytes per chunk of a published request (see `register_pools`)."""


PRODUCER_IO_THREADS: Final = 2


def loop_time() -> float:
    """The running loop's clock: the `now` every call into the protocol core is given."""
    return asyncio.get_running_loop().time()


@dataclass(frozen=True, slots=True)
class ProducerConfig:
    """A producer's constructor arguments, checked (see `Producer`)."""

    bind: str
    device: torch.device
    buffer_bytes: int
    heartbeat_s: float
    producer_id: str
    transport_names: tuple[str, ...]
    item_ttl_s: float | None
    curve: CurveKeys | None
    heads: m.HeadRange | None
    checksum: bool
    """Whether each inserted item carries a checksum of its bytes (`KVRT_CHECKSUM` if None)."""


class Gate:
    """Whether the producer serves (started, closed, failed) and whether its buffer has room:
    what every call checks first, and what an insert waits on (an event, never a poll)."""

    def __init__(self, buffer: LookupBuffer, buffer_bytes: int) -> None:
        self._buffer = buffer
        self.buffer_bytes = buffer_bytes
        self._room = asyncio.Event()
        self.started = False
        self.closed = False
        self.failure: BaseException | None = None
        """Why the serve loop ended, if it failed (every later call says so)."""

    def check_open(self) -> None:
        if self.closed or not self.started:
            reason = "closed" if self.closed else "not started: use `async with` or `await start()`"
            raise ClosedError(f"the producer is {reason}") from self.failure

    def close(self, failure: BaseException | None = None) -> None:
        """No call is served any more; waiting inserts wake up and fail."""
        self.closed = True
        if failure is not None:
            self.failure = failure
        self._room.set()

    def update_room(self) -> None:
        if self._buffer.nbytes <= self.buffer_bytes:
            self._room.set()
        else:
            self._room.clear()

    async def wait_for_room(self, timeout: float | None) -> None:
        try:
            async with asyncio.timeout(timeout):
                while self._buffer.nbytes > self.buffer_bytes and not self.closed:
                    await self._room.wait()
        except TimeoutError:
            raise KVRTTimeoutError(
                f"the buffer stayed over {self.buffer_bytes} bytes for {timeout} s: "
                "no consumer is taking items; check that decode instances are connected",
                phase="insert",
            ) from None
        self.check_open()


class Workers:
    """The producer's worker threads, each started when first needed: the one that queues a
    publish's gathers (on the host, runs them) and the one that computes GPU items' checksums,
    on a stream of its own."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._gathers: concurrent.futures.ThreadPoolExecutor | None = None
        self._checksums: concurrent.futures.ThreadPoolExecutor | None = None
        self._checksum_stream: torch.cuda.Stream | None = None

    def gather_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread that queues a GPU producer's gathers, or runs a host's: either way off
        the loop, which answers every other call meanwhile."""
        if self._gathers is None:
            if self._device.type == "cuda":
                self._gathers = gpu_worker(self._device, "kvrt-gather")
            else:
                self._gathers = host_worker("kvrt-gather")
        return self._gathers

    def checksum_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._checksums is None:
            self._checksums = gpu_worker(self._device, "kvrt-checksum")
        return self._checksums

    def checksum_stream_on(self, device: torch.device) -> torch.cuda.Stream:
        if self._checksum_stream is None:
            self._checksum_stream = torch.cuda.Stream(device)
        return self._checksum_stream

    def close(self) -> None:
        for pool in (self._gathers, self._checksums):
            if pool is not None:
                pool.shutdown(wait=False)


@dataclass(slots=True)
class RegisteredPools:
    """The engine's KV pools that `publish` and streams of the pools read (`register_pools`
    writes them), and how a published request is cut into chunks."""

    pools: PoolTable | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    taper: bool = False
    """Whether the first and the last chunk of a publish are small (see `register_pools`)."""


class ItemKeeper:
    """Each item's bytes beside the record the core keeps (they live exactly as long as the
    record is referenced: buffered, in flight, or a delivery still being sent), and what is
    done with them once written: checksums, the event GPU sends wait on, the transports told;
    pieces cut for the core."""

    def __init__(
        self, device: torch.device, *, checksum: bool, transports: Mapping[str, Sender], workers: Workers
    ) -> None:
        self.device = device
        self.checksum = checksum
        self._transports = transports
        """The producer's senders (filled when it starts)."""
        self._workers = workers
        self._bytes: weakref.WeakKeyDictionary[BufferedItem, ItemBytes] = weakref.WeakKeyDictionary()

    def __getitem__(self, record: BufferedItem) -> ItemBytes:
        """The bytes of the item `record` names."""
        return self._bytes[record]

    def keep(self, new: NewItem) -> BufferedItem:
        """Keep a new item's bytes beside its record, for as long as the record lives."""
        self._bytes[new.record] = new.bytes
        return new.record

    def cut(self, item: BufferedItem, asked: PieceAsked, item_id: int) -> BufferedItem:
        """A piece of `item` for the core (see `kvrt._protocol.Cut`): its memory now, its bytes
        copied by its `fill`, on the send path, once the item's own bytes are written."""
        source = self._bytes[item]
        piece = piece_of(item, source, asked.heads, asked.hidden, item_id=item_id, allocate=self.allocate)
        piece.bytes.fill = functools.partial(self._fill_piece, first=first_head(source, asked.heads))
        return self.keep(piece)

    def _fill_piece(self, piece: BufferedItem, piece_bytes: ItemBytes, *, first: int) -> None:
        """Copy a piece's bytes out of its item (on a GPU, on the current stream, after the
        item's writes), then note when they are written, as an insert does."""
        assert piece.parent is not None
        item = self._bytes[piece.parent]
        if item.written is not None:
            torch.cuda.current_stream(item.storage.device).wait_event(item.written)
        fill_piece(piece_bytes, item, first)
        self.prepare(piece, piece_bytes)

    def prepare(self, record: BufferedItem, item: ItemBytes) -> None:
        """An item's bytes were written (inserted, published, cut as a piece, a finished stream
        stacked): its checksum, if this producer checksums, from the bytes where they were
        written. A GPU item's were written on the current stream: the event every GPU send of
        it waits on (recorded once, for all transports), and after which the memory a transport
        allocated for it may be reused."""
        if self.checksum and item.storage.device.type == "cpu":  # a GPU item's: `device_checksum`
            record.checksum = storage_checksum(item.storage, record.metas)
        if item.storage.device.type == "cuda":
            item.ready_event = torch.cuda.Event()
            item.ready_event.record(torch.cuda.current_stream(item.storage.device))
            for transport in self._transports.values():
                transport.note_written(item)

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """An item's packed buffer in memory a transport registered (None: none does)."""
        for transport in self._transports.values():
            storage = transport.allocate(nbytes)
            if storage is not None:
                return storage
        return None

    async def device_checksum(self, record: BufferedItem) -> None:
        """A GPU item's checksum (`kvrt.kernels.checksum`), once its bytes are written: in a
        kvrt thread, on a stream of its own that waits for the writes; the loop waits for
        neither the kernel (a first launch compiles) nor its result."""
        from kvrt.kernels.checksum import queue_checksum

        item = self._bytes[record]
        await all_gathers_queued(item)
        written, storage, seed = item.written, item.storage, metas_seed(record.metas)

        def compute() -> int:
            stream = self._workers.checksum_stream_on(storage.device)
            with torch.cuda.stream(stream):
                if written is not None:
                    stream.wait_event(written)
                return queue_checksum(storage, seed).result()

        checksums = self._workers.checksum_thread()
        item.device_checksum = await asyncio.get_running_loop().run_in_executor(checksums, compute)

    def queue_tensors_checksum(
        self, tensors: Sequence[torch.Tensor], metas: Sequence[m.TensorMeta | None], position: int,
        ready: torch.cuda.Event | None,
    ) -> TensorsSum:  # fmt: skip
        """A GPU stream's layer (`position`: its index) or hidden states (`HIDDEN_POSITION`):
        their kernel checksums queued in the kvrt-checksum thread, on its stream, after `ready`
        (neither the loop nor the prefill waits). What the future gives reads the result
        (`tensors_device_checksum`), waiting for the GPU: call it off the loop."""
        from kvrt.kernels.checksum import queue_checksums_after

        seed = tensors_seed(metas, position)

        def queue() -> Callable[[], int]:
            stream = self._workers.checksum_stream_on(tensors[0].device)
            sums = queue_checksums_after(tensors, seed, stream, ready)  # the store may free them meanwhile
            return lambda: tensors_device_checksum(sums(), seed)

        return self._workers.checksum_thread().submit(queue)

    async def stream_end_checksums(self, end: m.StreamEnd, record: BufferedItem) -> m.StreamEnd:
        """A GPU stream's end with the checksum of each layer as it was sent (queued as its
        prefill published them, or now over the whole item's layers) and of its hidden states."""
        whole = self._bytes[record]
        layers = whole.key.shape[0]
        sums = whole.layer_sums
        if sums is None or len(sums) != layers:  # read whole as a stream: its storage is written
            await all_gathers_queued(whole)
            sums = [
                self.queue_tensors_checksum(
                    (whole.key[layer], whole.value[layer]), (tensor_meta(whole.key[layer]),
                    tensor_meta(whole.value[layer])), layer, whole.written,
                )
                for layer in range(layers)
            ]  # fmt: skip
        if end.hidden is not None and whole.hidden is not None:
            sums = [*sums, self.queue_tensors_checksum((whole.hidden,), (end.hidden,), HIDDEN_POSITION, whole.written)]
        readers = [await asyncio.wrap_future(queued) for queued in sums]
        values = await asyncio.get_running_loop().run_in_executor(
            self._workers.checksum_thread(), lambda: [read() for read in readers]
        )
        hidden = values.pop() if len(values) > layers else None
        return msgspec.structs.replace(end, layer_checksums=values, device_checksum=hidden)

    async def warm_device_checksums(self) -> None:
        """On a GPU, with checksums on: compile the checksum kernel (about a second) before
        serving, so that no delivery's header waits for that."""
        if self.checksum and self.device.type == "cuda":
            from kvrt.kernels.checksum import warm_up

            await asyncio.get_running_loop().run_in_executor(self._workers.checksum_thread(), warm_up, self.device)
