"""What every part of a producer shares: the fields set up from the constructor's
arguments, their defaults and checks, and the few helpers each part calls (`_now`,
`_check_open`, waiting for room). `Producer` and its parts derive from `ProducerState`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgspec
import torch
import zmq

from kvrt import _messages as m
from kvrt._arguments import byte_count, endpoint, seconds, usable_device
from kvrt._auth import CurveKeys
from kvrt._buffer import BufferedItem, TensorsSum, all_gathers_queued
from kvrt._checksum import (
    HIDDEN_POSITION,
    checksum_wanted,
    metas_seed,
    storage_checksum,
    tensors_device_checksum,
    tensors_seed,
)
from kvrt._errors import (
    ClosedError,
    InvalidInputError,
    KVRTTimeoutError,
)
from kvrt._heads import fill_piece, head_range, piece_of
from kvrt._pools import PoolTable
from kvrt._protocol import DEFAULT_HEARTBEAT_S, ProducerCore, _heartbeat
from kvrt._protocol.waiting import PieceAsked
from kvrt._tensors import tensor_meta
from kvrt._threads import gpu_worker
from kvrt._zmqio import RouterOutboxes, SocketIO
from kvrt.transports import HostCopies, Sender
from kvrt.transports.cuda_ipc import host_identity
from kvrt.transports.select import SAME_HOST_ONLY, producer_transports

DEFAULT_CHUNK_BYTES = 1 << 30
"""K and V bytes per chunk of a published request (see `register_pools`)."""


PRODUCER_IO_THREADS: Final = 2


class _RateLimit:
    """At most one log line per `per_s` for a kind of event a peer can cause at will (a flood
    of refused messages must not become a flood of log lines); the others are counted."""

    def __init__(self, per_s: float) -> None:
        self._per_s = per_s
        self._next = 0.0
        self._suppressed = 0

    def allows(self, now: float) -> bool:
        if now >= self._next:
            self._next = now + self._per_s
            return True
        self._suppressed += 1
        return False

    def suppressed_note(self) -> str:
        note = f" ({self._suppressed} more not logged)" if self._suppressed else ""
        self._suppressed = 0
        return note


class ProducerState:
    """The fields of a producer and the helpers every part of it calls."""

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        device: torch.device | str = "cpu",
        buffer_bytes: int = 1 << 30,
        *,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        name: str | None = None,
        transport: str | None = None,
        item_ttl_s: float | None = None,
        curve: CurveKeys | None = None,
        heads: slice | None = None,
        checksum: bool | None = None,
    ) -> None:
        buffer_bytes = byte_count(buffer_bytes, "buffer_bytes")
        self.checksum = checksum_wanted(checksum)
        """Whether each inserted item carries a checksum of its bytes (`KVRT_CHECKSUM` if None)."""
        heartbeat_s = _heartbeat(heartbeat_s)
        item_ttl_s = seconds(item_ttl_s, "item_ttl_s", none=True)
        bind = endpoint(bind, "bind", binding=True)
        if curve is not None and not isinstance(curve, CurveKeys):
            raise InvalidInputError(f"curve must be None or kvrt.CurveKeys, got {type(curve).__name__}")
        self.device = usable_device(device)
        self.buffer_bytes = buffer_bytes
        self._bind = bind
        self._curve = curve
        self._authenticator: Any = None
        self._transport_names = producer_transports(transport, self.device)
        self._transports: dict[str, Sender] = {}
        self.heads = head_range(heads, "heads")
        """The model's KV heads this producer's items hold (a prefill TP rank's share), if told."""
        self._core = ProducerCore(
            producer_id=name or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            heartbeat_s=heartbeat_s,
            transports=self._transport_names,
            buffer_limit_bytes=buffer_bytes,
            item_ttl_s=item_ttl_s,
            host=host_identity(),
            same_host_only=SAME_HOST_ONLY,
            cut=self._cut_piece,
            heads=self.heads,
            checksum=self.checksum,
        )
        self._send_lock = asyncio.Lock()
        self._refusal_log = _RateLimit(per_s=1.0)
        self._peer_log = _RateLimit(per_s=0.1)
        """Consumers joining and leaving: a storm of connections must not become one of log lines."""
        self._departed_since_trim = 0
        self._pools: PoolTable | None = None
        self._chunk_bytes = DEFAULT_CHUNK_BYTES
        self._taper = False
        """Whether the first and the last chunk of a publish are small (see `register_pools`)."""
        self._gathers: concurrent.futures.ThreadPoolExecutor | None = None
        """Queues a publish's gathers off the loop (see `publish`); on the host, runs them."""
        self._checksums: concurrent.futures.ThreadPoolExecutor | None = None
        """Computes GPU items' checksums off the loop, on a stream of its own (see `device_checksum`)."""
        self._checksum_stream: torch.cuda.Stream | None = None
        self._host_copies = HostCopies()
        """A stream's head (its tokens) as host frames (see `ServeLoop._send_one`)."""
        self._peer_left = asyncio.Event()
        """Set whenever a consumer left and its pair was released (tests and metrics await it)."""
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._io: SocketIO | None = None
        self._outboxes: RouterOutboxes | None = None
        self._endpoint: str | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._room = asyncio.Event()
        self._closed = False
        self._failure: BaseException | None = None

    # -- API ------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The address actually bound (with the real port when `bind` asked for port 0)."""
        if self._endpoint is None:
            raise ClosedError("the producer is not started: use `async with` or `await start()`")
        return self._endpoint

    # -- internals ------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _check_open(self) -> None:
        if self._closed or self._socket is None:
            reason = "closed" if self._closed else "not started: use `async with` or `await start()`"
            raise ClosedError(f"the producer is {reason}") from self._failure

    def _update_room(self) -> None:
        if self._core.buffer.nbytes <= self.buffer_bytes:
            self._room.set()
        else:
            self._room.clear()

    async def _wait_for_room(self, timeout: float | None) -> None:
        try:
            async with asyncio.timeout(timeout):
                while self._core.buffer.nbytes > self.buffer_bytes and not self._closed:
                    await self._room.wait()
        except TimeoutError:
            raise KVRTTimeoutError(
                f"the buffer stayed over {self.buffer_bytes} bytes for {timeout} s: "
                "no consumer is taking items; check that decode instances are connected",
                phase="insert",
            ) from None
        self._check_open()

    def _cut_piece(self, item: BufferedItem, asked: PieceAsked, item_id: int) -> BufferedItem:
        """A piece of `item` for the core (see `kvrt._protocol.Cut`): its memory now, its bytes
        copied by its `fill`, on the send path, once the item's own bytes are written."""
        piece = piece_of(item, asked.heads, asked.hidden, item_id=item_id, allocate=self._allocate)
        piece.fill = self._fill_piece
        return piece

    def _fill_piece(self, piece: BufferedItem) -> None:
        """Copy a piece's bytes out of its item (on a GPU, on the current stream, after the
        item's writes), then note when they are written, as an insert does."""
        item = piece.parent
        assert item is not None
        if item.written is not None:
            torch.cuda.current_stream(item.storage.device).wait_event(item.written)
        fill_piece(piece, item)
        self._prepare(piece)

    def _prepare(self, item: BufferedItem) -> None:
        """An item's bytes were written (inserted, published, cut as a piece, a finished stream
        stacked): its checksum, if this producer checksums, from the bytes where they were
        written. A GPU item's were written on the current stream: the event every GPU send of
        it waits on (recorded once, for all transports), and after which the memory a transport
        allocated for it may be reused."""
        if self.checksum and item.storage.device.type == "cpu":  # a GPU item's: `device_checksum`
            item.checksum = storage_checksum(item.storage, item.metas)
        if item.storage.device.type == "cuda":
            item.ready_event = torch.cuda.Event()
            item.ready_event.record(torch.cuda.current_stream(item.storage.device))
            for transport in self._transports.values():
                transport.note_written(item)

    def _allocate(self, nbytes: int) -> torch.Tensor | None:
        """An item's packed buffer in memory a transport registered (None: none does)."""
        for transport in self._transports.values():
            storage = transport.allocate(nbytes)
            if storage is not None:
                return storage
        return None

    async def device_checksum(self, item: BufferedItem) -> None:
        """A GPU item's checksum (`kvrt.kernels.checksum`), once its bytes are written: in a
        kvrt thread, on a stream of its own that waits for the writes; the loop waits for
        neither the kernel (a first launch compiles) nor its result."""
        from kvrt.kernels.checksum import queue_checksum

        await all_gathers_queued(item)
        written, storage, seed = item.written, item.storage, metas_seed(item.metas)

        def compute() -> int:
            stream = self._checksum_stream_on(storage.device)
            with torch.cuda.stream(stream):
                if written is not None:
                    stream.wait_event(written)
                return queue_checksum(storage, seed).result()

        item.device_checksum = await asyncio.get_running_loop().run_in_executor(self._checksum_thread(), compute)

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
            stream = self._checksum_stream_on(tensors[0].device)
            sums = queue_checksums_after(tensors, seed, stream, ready)  # the store may free them meanwhile
            return lambda: tensors_device_checksum(sums(), seed)

        return self._checksum_thread().submit(queue)

    async def stream_end_checksums(self, end: m.StreamEnd, whole: BufferedItem) -> m.StreamEnd:
        """A GPU stream's end with the checksum of each layer as it was sent (queued as its
        prefill published them, or now over the whole item's layers) and of its hidden states."""
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
            self._checksum_thread(), lambda: [read() for read in readers]
        )
        hidden = values.pop() if len(values) > layers else None
        return msgspec.structs.replace(end, layer_checksums=values, device_checksum=hidden)

    def _checksum_stream_on(self, device: torch.device) -> torch.cuda.Stream:
        if self._checksum_stream is None:
            self._checksum_stream = torch.cuda.Stream(device)
        return self._checksum_stream

    async def warm_device_checksums(self) -> None:
        """On a GPU, with checksums on: compile the checksum kernel (about a second) before
        serving, so that no delivery's header waits for that."""
        if self.checksum and self.device.type == "cuda":
            from kvrt.kernels.checksum import warm_up

            await asyncio.get_running_loop().run_in_executor(self._checksum_thread(), warm_up, self.device)

    def _checksum_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._checksums is None:
            self._checksums = gpu_worker(self.device, "kvrt-checksum")
        return self._checksums

    def _gather_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread that queues a GPU producer's gathers, or runs a host's: either way off
        the loop, which answers every other call meanwhile."""
        if self._gathers is None:
            if self.device.type == "cuda":
                self._gathers = gpu_worker(self.device, "kvrt-gather")
            else:
                self._gathers = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrt-gather")
        return self._gathers
