"""NIXL transport: the consumer READs an item's bytes out of the producer's registered memory
with NIXL (UCX underneath: `cma` between processes of one host, RDMA where the host has it,
CUDA IPC or GPUDirect for GPU memory, TCP with `UCX_TLS=tcp`). Install with `kvrt[nixl]`.

Who reads what. As over `cuda_ipc`, the consumer reads, for the same reasons: the producer
keeps every item until the consumer answers `Received` (the transport contract), so a READ
needs no round trip of its own, and the consumer's memory is only ever written by the
consumer's own agent, into buffers it allocated for that delivery.

Agreement at join, through the control plane (no side channel): each producer has one NIXL
agent (made in `start`, off the loop: UCX's set-up takes ~0.4 s). Its `offer` to a consumer
is the agent's metadata (how to reach it, and a small probe region of known bytes), base64
in the welcome's rendezvous. The consumer's `join` makes its own agent (once), loads that
metadata and READs the probe: anything that keeps NIXL from working between the two (no
common UCX transport, an agent of another NIXL version, memory it cannot reach) shows as
`TransportUnavailableError` at join, and the consumer falls back to the next transport it
offered. The consumer's metadata never travels: a READ needs only the target's.

Registered memory, once: the producer's items live in its registered arena (slabs
registered with the agent when made, see `kvrt.transports._arena`); an item elsewhere (the
arena full, or cuda_ipc's arena first) is registered for as long as it lives. The frame
after a Deliver header (`NixlRead`) names the item's address and, the first time a consumer
is sent an item in a region, that region's metadata (a few hundred bytes), which the consumer
loads before it reads. The consumer READs into its own registered arena (a slab per 64 MiB,
its regions back once the caller drops the tensors); a payload past its limit is registered
for that one READ. Where a call lands its item in the caller's memory (one producer, no
group: `Receiver.receive_in_place`), the same READ takes K and V straight there: a
drop_select's `into=` buffers (their storages registered at first use, the last
`REGISTERED_BUFFERS` kept), or a pull's pools (registered once per `PoolTable`, for as long as
it lives), one descriptor per run of slots; only the rest (tokens, roi) lands in the arena.
Such a READ waits for the work the caller queued on its stream before the call, and the call
returns (also failed or cancelled) only once the READ no longer writes there.

How a transfer goes: one READ per delivery, one descriptor per payload segment (a pull's
chunks: one descriptor list, not one transfer per chunk; into the pools, one per run of slots
and layer), one descriptor per hit of a DeliverMany; between host memories, a READ of more
than `READ_PART_BYTES` as parts of that size (`cma` copies inside the call that posts, under
the agent's lock). A small READ is posted from the loop (UCX's `cma` finishes it inside the
call, ~10 us), also while a large one is under way; a large one is posted by the session's
waiter thread, so the loop never copies, and waits at most for one part's copy when it calls
the agent. NIXL tells completion only when asked (it has no file descriptor or callback to
wait on), so that thread asks, sleeping between asks from 20 us up to 1 ms: the one place
kvrt polls, off the loop, for transfers in flight only.

Failures: a READ that fails (the producer's process died: `cma` and UCX's peer error
handling report it) fails its call with `PeerLostError`. When the link gives the producer
up (`abandon`) every wait of the session ends at its next ask, its READs are released
(NIXL cancels those in flight), and the producer's agent is dropped; the next welcome's
join loads it anew. A consumer reads nothing for a delivery outside its lease (the
consumer's arrivals check it before `receive`), and never reads a region the producer did
not name in that delivery's frame.

This module holds the two halves, `NixlSender` and `NixlReceiver`, over the transport's other
parts: `_nixl_agent` (the adapter over NIXL's API), `_nixl_rendezvous` (the agreement at join
and the frame after each header), `_nixl_reads` (how a READ is posted and waited for) and
`_nixl_registrations` (the caller's memory registered for the READs that land there).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Final, TypeVar

import numpy as np
import torch
import zmq

from kvrt._errors import (
    InvalidInputError,
    KVRTTimeoutError,
    PeerLostError,
    RemoteProtocolError,
    TransportUnavailableError,
)
from kvrt._item_bytes import ItemBytes
from kvrt._messages import Deliver, DeliverMany, TensorMeta
from kvrt._pools import PoolTable, landing_ranges
from kvrt._tensors import (
    DTYPES,
    back_to_back,
    batch_views,
    check_metas,
    check_segments,
    dtype_name,
    meta_end,
    transfer_segments,
    unpack_tensor,
)
from kvrt._threads import WaitThread, outcome_seen
from kvrt.transports._arena import RegisteredArena, Slab
from kvrt.transports._base import (
    Arrival,
    BufferLanding,
    HostCopies,
    InPlace,
    ItemTensors,
    PoolLanding,
    Post,
    Receiver,
    Sender,
    Transfer,
    batch_hits,
    checked_batch,
    checks_landing,
    five,
    item_metas,
    landed_check,
)
from kvrt.transports._nixl_agent import Agent, AgentError, Registration, TransferState, nixl_unavailable
from kvrt.transports._nixl_reads import ReadSession, post_reads, released, translated, until_ended
from kvrt.transports._nixl_registrations import CallerRegistrations
from kvrt.transports._nixl_rendezvous import (
    PROBE_BYTES,
    RENDEZVOUS_VERSION,
    NixlRead,
    Rendezvous,
    decoded_read,
    encode_read,
    metadata_pieces,
    parse_rendezvous,
    probe_pattern,
)

log = logging.getLogger("kvrt.transports")
_T = TypeVar("_T")


_MAX_PAYLOAD_BYTES: Final = 1 << 40
POOL_DESCRIPTOR_BYTES: Final = 16 << 10
"""The least a pull's descriptors into the pools must move on average for the READ to land
there: UCX pays a few microseconds a descriptor (`cma`: 8,192 of 2 KiB took 13 ms more than
one READ of the same 16 MiB), so rows of a token each (token-major pools) are READ whole and
scattered, and pages of 16 tokens or more (block pools) are READ in place."""
RECEIVE_ARENA_BYTES: Final = 4 << 30
"""The most memory a consumer keeps registered for receives (slabs of `_RECEIVE_SLAB_BYTES`)."""
_RECEIVE_SLAB_BYTES: Final = 64 << 20


def _refuse_if_unavailable() -> None:
    reason = nixl_unavailable()
    if reason is not None:
        raise InvalidInputError(f"the nixl transport cannot run here: {reason}")


class NixlSender(Sender):
    """The producer's half: one agent, its items' memory registered, a frame per delivery."""

    def __init__(self, device: torch.device, registered_bytes: int = 0) -> None:
        _refuse_if_unavailable()
        self.name = "nixl"
        self.device = device
        self._agent: Agent | None = None
        self._arena = RegisteredArena(device, registered_bytes, on_slab=self._register_slab)
        self._probe: torch.Tensor | None = None
        self._pattern: torch.Tensor | None = None
        """The probe's bytes, kept apart (unregistered): each offer writes the probe anew."""
        self._probe_stream: torch.cuda.Stream | None = None
        self._probe_registration: Registration | None = None
        self._pairs: dict[bytes, set[int]] = {}
        """Per consumer joined by an offer (its pair), the registrations whose metadata it was sent."""
        self._extra: weakref.WeakKeyDictionary[ItemBytes, Registration] = weakref.WeakKeyDictionary()
        """Items outside the arena, registered while they live (released when they go)."""
        self._waiter = WaitThread("kvrt-nixl-written")
        """Waits (GPU items) for an item's bytes to be written before its frame leaves."""
        self._host = HostCopies()

    async def start(self) -> None:
        """Make the agent and register the probe, on a thread (UCX's set-up takes ~0.4 s)."""
        name = f"kvrt-producer-{uuid.uuid4().hex}"
        try:
            agent = await asyncio.to_thread(Agent, name, progress_thread=True)
        except AgentError as exc:
            raise TransportUnavailableError(f"nixl: this producer's agent could not start: {exc}") from None
        pattern = probe_pattern().to(self.device)
        probe = pattern.clone()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # 4 KiB, once: read by every join
        self._agent, self._probe, self._pattern = agent, probe, pattern
        self._probe_registration = agent.register(probe.data_ptr(), PROBE_BYTES, self.device)

    def _started(self) -> Agent:
        if self._agent is None:
            raise PeerLostError("the nixl transport is closed (or was never started)")
        return self._agent

    def _register_slab(self, slab: Slab) -> None:
        slab.registration = self._started().register(slab.tensor.data_ptr(), slab.tensor.numel(), self.device)

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        if self._agent is None:
            return None
        try:
            return self._arena.allocate(nbytes)
        except AgentError as exc:  # the slab could not be registered: the producer allocates
            log.warning("nixl could not register a slab of memory: %s", exc)
            return None

    def note_written(self, item: ItemBytes) -> None:
        if item.storage.device.type == "cuda":
            self._arena.written(item.storage, item.written)

    def offer(self, peer: bytes) -> dict[str, str]:
        agent = self._started()
        assert self._probe is not None and self._pattern is not None and self._probe_registration is not None
        # A peer driving NIXL by hand may have written over the probe: one write must not keep
        # every later consumer from joining (4 KiB; on a GPU on a stream of its own, waited for
        # alone, not the engine's work).
        if self.device.type == "cuda":
            if self._probe_stream is None:
                self._probe_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._probe_stream):
                self._probe.copy_(self._pattern, non_blocking=True)
            self._probe_stream.synchronize()
        else:
            self._probe.copy_(self._pattern)
        self._pairs[peer] = {self._probe_registration.registration_id}
        metadata = agent.metadata(self._probe_registration, connection=True)
        return {
            "nixl": RENDEZVOUS_VERSION,
            "probe": str(self._probe.data_ptr()),
            "device": str(self.device),
            **metadata_pieces(metadata),
        }

    async def send(self, peer: bytes, transfer: Transfer, post: Post) -> None:
        """The frames describe where the consumer READs each item (a batch's hits: each from
        its own storage, all in one READ); a stream's tensors go as host frames."""
        if transfer.tensors:
            post(await self._host.frames(transfer.tensors, transfer.ready))
            return
        await transfer.written()
        items = transfer.items
        if transfer.batch is None and items[0].nbytes == 0:
            post([])
            return
        for item in items:
            await self._written(item)
        post([self._frame(peer, item) for item in items])

    async def _written(self, item: ItemBytes) -> None:
        """A GPU item's bytes are read by another process as soon as its frame arrives: the
        frame leaves once the GPU wrote them (waited for on a kvrt thread, not the loop)."""
        written = item.written
        if written is not None and not written.query():
            await self._waiter.wait(written.synchronize)

    def _frame(self, peer: bytes, item: ItemBytes) -> memoryview:
        described = self._pairs.get(peer)
        if described is None:
            raise PeerLostError("the consumer left before its item could be sent")
        registration = self._registration(item)
        metadata = b""
        if registration.registration_id not in described:
            metadata = self._started().metadata(registration, connection=False)
            described.add(registration.registration_id)
        return memoryview(encode_read(NixlRead(item.storage.data_ptr(), metadata)))

    def _registration(self, item: ItemBytes) -> Registration:
        placed = self._arena.place(item.storage)
        if placed is not None:
            in_slab: Registration = placed[0].registration
            return in_slab
        registered = self._extra.get(item)
        if registered is None:
            storage = item.storage.untyped_storage()
            registered = self._started().register(storage.data_ptr(), storage.nbytes(), item.storage.device)
            self._extra[item] = registered
            weakref.finalize(item, _deregister_quietly, weakref.ref(self), registered)
        return registered

    def forget(self, peer: bytes, unconfirmed: Sequence[ItemBytes] = ()) -> None:
        """Nothing of the consumer's is held here but what it was told: its next session's
        offer starts that afresh. The items it never confirmed are back in the buffer, their
        memory still registered."""
        self._pairs.pop(peer, None)

    async def aclose(self) -> None:
        """Deregister every region and drop the agent (consumers reading then get failed READs)."""
        agent, self._agent = self._agent, None
        self._pairs.clear()
        self._waiter.close()
        self._host.close()
        if agent is None:
            return
        registrations = [slab.registration for slab in self._arena.slabs if slab.registration is not None]
        registrations += list(self._extra.values())
        if self._probe_registration is not None:
            registrations.append(self._probe_registration)
        self._extra.clear()
        for slab in self._arena.slabs:
            slab.registration = None
        held = [agent]
        del agent
        await asyncio.to_thread(_deregistered_and_dropped, held, registrations)


def _deregistered_and_dropped(held: list[Agent], registrations: Sequence[Registration]) -> None:
    """On a thread: deregister `registrations` from the one agent in `held`, then drop it there
    (the agent's end, UCX's teardown, took 0.7 s with GPU memory registered: not for the loop)."""
    agent = held.pop()
    for registration in registrations:
        try:
            agent.deregister(registration)
        except AgentError as exc:
            log.warning("nixl: %s", exc)
    del agent


def _deregister_quietly(sender: weakref.ref[NixlSender], registration: Registration) -> None:
    """An item outside the arena went: its registration goes too (if the agent still lives)."""
    owner = sender()
    agent = None if owner is None else owner._agent
    if agent is not None:
        try:
            agent.deregister(registration)
        except AgentError as exc:
            log.warning("nixl: %s", exc)


def _read_probe(agent: Agent, remote: str, rendezvous: Rendezvous, device: torch.device) -> None:
    """READ the producer's probe into this side's memory and check its bytes: raises
    `TransportUnavailableError` when it cannot be read from here, or reads back wrong."""
    probe = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=device)
    registration = None
    try:
        registration = agent.register(probe.data_ptr(), PROBE_BYTES, device)
        transfer = agent.read(
            remote,
            [(probe.data_ptr(), rendezvous.probe_address, PROBE_BYTES)],
            local=device,
            peer=rendezvous.probe_device,
        )
        state = until_ended(transfer, lambda: False, deadline=time.monotonic() + 60.0)
        released(transfer)
        matches = state is TransferState.DONE and torch.equal(probe.cpu(), probe_pattern())
    except AgentError as exc:
        raise TransportUnavailableError(f"nixl: the producer's probe cannot be read from here: {exc}") from None
    finally:
        if registration is not None:
            agent.deregister(registration)
    if not matches:
        raise TransportUnavailableError("nixl: the producer's probe read back wrong bytes (or its READ failed)")


class NixlReceiver(Receiver):
    """The consumer's half: its agent, its registered receive arena, one READ per delivery."""

    def __init__(self, device: torch.device, registered_bytes: int = RECEIVE_ARENA_BYTES) -> None:
        _refuse_if_unavailable()
        self.name = "nixl"
        self.device = device
        self._agent: Agent | None = None
        self._arena = RegisteredArena(device, registered_bytes, _RECEIVE_SLAB_BYTES, on_slab=self._register_slab)
        self._session: ReadSession | None = None
        self._registrations = CallerRegistrations(device)
        self._ended: asyncio.Future[None] | None = None
        """Done once the last session's thread dropped the producer's agent (a join loads it anew)."""

    def _register_slab(self, slab: Slab) -> None:
        assert self._agent is not None  # receives come after a join
        slab.registration = self._agent.register(slab.tensor.data_ptr(), slab.tensor.numel(), self.device)

    async def join(self, rendezvous: dict[str, str], timeout_s: float) -> None:
        parsed = parse_rendezvous(rendezvous)
        self._end_session()
        ended, self._ended = self._ended, None
        if ended is not None:
            await asyncio.wait([ended], timeout=timeout_s)  # else it would drop the agent loaded next
        try:
            session = await asyncio.wait_for(asyncio.to_thread(self._join_in_thread, parsed), timeout_s)
        except TimeoutError:
            raise KVRTTimeoutError(
                f"joining the producer's nixl agent took over {timeout_s} s", phase="connect"
            ) from None
        self._session = session

    def _join_in_thread(self, rendezvous: Rendezvous) -> ReadSession:
        """Make this side's agent (once; ~0.4 s), load the producer's, and READ its probe."""
        try:
            if self._agent is None:
                # No progress thread: the waiter's asks move UCX on, and on a small host a
                # progress thread of its own took 0.05 ms of every 64 KiB READ.
                self._agent = Agent(f"kvrt-consumer-{uuid.uuid4().hex}", progress_thread=False)
                self._registrations.agent = self._agent
            agent = self._agent
            remote = agent.load(rendezvous.metadata)
        except AgentError as exc:
            raise TransportUnavailableError(f"nixl: the producer's agent cannot be joined from here: {exc}") from None
        _read_probe(agent, remote, rendezvous, self.device)
        return ReadSession(remote, rendezvous.probe_device, WaitThread("kvrt-nixl-read"))

    def receive(self, deliver: Deliver, frames: Sequence[zmq.Frame]) -> Arrival:
        session = self._joined()
        payload_bytes = deliver.payload_bytes
        segments = transfer_segments(deliver.segments, payload_bytes)
        check_segments(segments, payload_bytes)
        if not segments:
            if frames:
                raise RemoteProtocolError(f"an empty nixl delivery carries no frames, {len(frames)} came")
            done: asyncio.Future[ItemTensors] = asyncio.get_running_loop().create_future()
            done.set_result(five(unpack_tensor(item_metas(deliver), self._empty())))
            return Arrival(done)
        (read,) = self._reads(frames, 1)
        check_metas(item_metas(deliver), payload_bytes)  # lying metas refused before anything is read
        self._load(session, read)
        payload, registration = self._payload(payload_bytes)
        tensors = five(unpack_tensor(item_metas(deliver), payload))
        base = payload.data_ptr()
        ranges = [(base + offset, read.address + offset, nbytes) for offset, nbytes in segments]
        check = landed_check(self, payload, [(deliver, 0)])
        return Arrival(self._post(session, ranges, payload, registration, tensors, check=check))

    async def pools_in_place(
        self, ready: torch.cuda.Event | None, into: PoolTable, replicas: torch.Tensor, slots: torch.Tensor
    ) -> PoolLanding:
        """This transport READs an item into the pools itself: the indexes are read back to the
        host (on a thread, after the caller's stream wrote them)."""
        assert ready is not None  # indexes on a device

        def read_back() -> tuple[np.ndarray, np.ndarray]:
            ready.synchronize()
            return replicas.cpu().numpy(), slots.cpu().numpy()

        host_replicas, host_slots = await asyncio.to_thread(read_back)
        return PoolLanding(ready, table=into, replicas=host_replicas, slots=host_slots)

    def receive_in_place(self, deliver: Deliver, frames: Sequence[zmq.Frame], target: InPlace) -> Arrival:
        if checks_landing(self, deliver, host=self.device.type == "cpu"):
            # What a READ writes into the caller's memory the caller may see before any check:
            # a checksummed item is READ into this side's memory, checked, then written there.
            return self.receive(deliver, frames)
        if isinstance(target, PoolLanding):
            return self._receive_into_pools(deliver, frames, target)
        if isinstance(target, BufferLanding):
            return self._receive_into_buffers(deliver, frames, target)
        return self.receive(deliver, frames)

    def _receive_into_pools(self, deliver: Deliver, frames: Sequence[zmq.Frame], pools: PoolLanding) -> Arrival:
        """One READ that lands the item's K and V in the pools, a descriptor per run of slots
        (`landing_ranges`), and its tokens, roi and hidden states in this side's arena. The
        arrival's key and value are meta tensors: their shape and dtype, no bytes. An item
        the pools cannot take as it is (another dtype or geometry, head-major blocks), runs
        of slots too short for a descriptor each (`POOL_DESCRIPTOR_BYTES`), or pools the
        agent cannot register, is received as usual, for the pull to scatter."""
        metas = self._checked(deliver)
        rows = _pool_rows(deliver, pools)
        if rows is None or not deliver.payload_bytes or len(rows) * POOL_DESCRIPTOR_BYTES > int(rows[:, 2].sum()):
            return self.receive(deliver, frames)
        if self._registrations.pools(pools.table) is None:
            return self.receive(deliver, frames)
        _, _, key, value, _ = metas
        assert key is not None and value is not None  # Deliver's types say so
        return self._read_in_place(deliver, frames, pools, rows, {2: _shaped(key), 3: _shaped(value)})

    def _receive_into_buffers(self, deliver: Deliver, frames: Sequence[zmq.Frame], into: BufferLanding) -> Arrival:
        """One READ that lands the item's K and V (and hidden states, where `into.hidden` is
        given) in the caller's buffers, and the rest in this side's arena. The arrival's
        tensors are views of the buffers in the item's shapes, as `into=` promises. An item
        that does not fit them, or buffers the agent cannot register, is received as usual
        (the call then refuses a misfit)."""
        metas = self._checked(deliver)
        wanted = [(2, into.key), (3, into.value)] + ([(4, into.hidden)] if into.hidden is not None else [])
        rows, views = [], {}
        for index, buffer in wanted:
            meta = metas[index]
            if meta is None or DTYPES[meta.dtype] != buffer.dtype or buffer.numel() < math.prod(meta.shape):
                return self.receive(deliver, frames)
            view = buffer.view(-1)[: math.prod(meta.shape)].view(meta.shape)
            views[index] = view
            if view.numel():
                rows.append((view.data_ptr(), meta.offset, view.numel() * view.element_size()))
        if not deliver.payload_bytes:
            return self.receive(deliver, frames)
        for buffer in {id(buffer): buffer for _, buffer in wanted}.values():
            if self._registrations.buffer(buffer) is None:
                return self.receive(deliver, frames)
        return self._read_in_place(deliver, frames, into, np.array(rows, dtype=np.int64).reshape(-1, 3), views)

    def _checked(self, deliver: Deliver) -> tuple[TensorMeta | None, ...]:
        """A delivery's metas, refused (`RemoteProtocolError`) where they or its segments lie
        outside its payload, before anything is read."""
        payload_bytes = deliver.payload_bytes
        check_segments(transfer_segments(deliver.segments, payload_bytes), payload_bytes)
        metas = item_metas(deliver)
        check_metas(metas, payload_bytes)
        return metas

    def _read_in_place(
        self, deliver: Deliver, frames: Sequence[zmq.Frame], target: InPlace, rows: np.ndarray,
        in_place: dict[int, torch.Tensor],
    ) -> Arrival:  # fmt: skip
        """Post one READ: `rows` (the caller's address, offset in the item's payload, bytes)
        into the caller's memory, whose tensors `in_place` gives by their index of the five,
        and the item's other tensors into this side's arena, back to back."""
        session = self._joined()
        (read,) = self._reads(frames, 1)
        self._load(session, read)
        metas = item_metas(deliver)
        aside = [(index, meta) for index, meta in enumerate(metas) if meta is not None and index not in in_place]
        placed, aside_bytes = back_to_back([meta for _, meta in aside])
        payload, registration = self._payload(max(1, aside_bytes))
        views: list[torch.Tensor | None] = [in_place.get(index) for index in range(5)]
        for (index, _), view in zip(aside, unpack_tensor(placed, payload), strict=True):
            views[index] = view
        base = payload.data_ptr()
        copies = [
            (base + where.offset, read.address + meta.offset, meta_end(meta) - meta.offset)
            for (_, meta), where in zip(aside, placed, strict=True)
            if meta_end(meta) > meta.offset
        ]
        rows = rows.copy()
        rows[:, 1] += read.address
        if copies:
            rows = np.concatenate((np.array(copies, dtype=np.int64), rows))
        landing = self._post(session, rows, payload, registration, five(views), in_place=target)
        target.landed, target.reading = True, landing
        return Arrival(landing)

    def receive_many(self, message: DeliverMany, frames: Sequence[zmq.Frame]) -> asyncio.Future[list[ItemTensors]]:
        session = self._joined()
        hits = batch_hits(message)
        reads = self._reads(frames, len(hits))
        entries = checked_batch(message, hits)
        for read in reads:
            self._load(session, read)
        if message.payload_bytes == 0 or not hits:
            done: asyncio.Future[list[ItemTensors]] = asyncio.get_running_loop().create_future()
            done.set_result([five(views) for views in batch_views(entries, self._empty())])
            return done
        payload, registration = self._payload(message.payload_bytes)
        tensors = [five(views) for views in batch_views(entries, payload)]
        base = payload.data_ptr()
        ranges = [
            (base + hit.offset, read.address, hit.payload_bytes)
            for hit, read in zip(hits, reads, strict=True)
            if hit.payload_bytes
        ]
        check = landed_check(self, payload, [(hit, hit.offset) for hit in hits])
        return self._post(session, ranges, payload, registration, tensors, check=check)

    def discard(self, frames: Sequence[zmq.Frame]) -> None:
        """A delivery this side will not read: the regions its frames describe are loaded all
        the same (the producer will not describe them again), nothing is read."""
        session = self._session
        if session is None:
            return
        for frame in frames:
            try:
                self._load(session, decoded_read(frame))
            except RemoteProtocolError:
                continue

    def abandon(self) -> None:
        self._end_session()

    async def aclose(self) -> None:
        self._end_session()
        agent, self._agent = self._agent, None
        if agent is None:
            return
        registrations = [slab.registration for slab in self._arena.slabs if slab.registration is not None]
        for slab in self._arena.slabs:
            slab.registration = None
        registrations += self._registrations.drain()
        held = [agent]
        del agent
        await asyncio.to_thread(_deregistered_and_dropped, held, registrations)

    # -- helpers --------------------------------------------------------------------------

    def _joined(self) -> ReadSession:
        if self._session is None:
            raise RemoteProtocolError("a nixl delivery arrived before the producer's agent was joined")
        return self._session

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _reads(frames: Sequence[zmq.Frame], count: int) -> list[NixlRead]:
        if len(frames) != count:
            raise RemoteProtocolError(f"a nixl delivery of {count} items carries as many frames, {len(frames)} came")
        return [decoded_read(frame) for frame in frames]

    def _load(self, session: ReadSession, read: NixlRead) -> None:
        if not read.metadata or read.metadata in session.loaded:
            return
        assert self._agent is not None  # joined
        try:
            name = self._agent.load(read.metadata)
        except AgentError as exc:
            raise translated(exc, "the producer described a region this agent cannot load") from None
        if name != session.remote:
            raise RemoteProtocolError(f"nixl: a region of agent {name!r} in a delivery of {session.remote!r}")
        session.loaded.add(read.metadata)

    def _payload(self, payload_bytes: int) -> tuple[torch.Tensor, Registration | None]:
        """The receive buffer: a region of the arena, else one registered for this READ alone."""
        if payload_bytes > _MAX_PAYLOAD_BYTES:
            raise RemoteProtocolError(f"delivery announces {payload_bytes} bytes, over {_MAX_PAYLOAD_BYTES}")
        assert self._agent is not None  # joined
        try:
            payload = self._arena.allocate(payload_bytes)
            if payload is not None:
                return payload, None
            payload = torch.empty(payload_bytes, dtype=torch.uint8, device=self.device)
            return payload, self._agent.register(payload.data_ptr(), payload_bytes, self.device)
        except AgentError as exc:
            raise translated(exc, f"{payload_bytes} bytes to receive into could not be registered") from None

    def _post(
        self, session: ReadSession, ranges: list[tuple[int, int, int]] | np.ndarray, payload: torch.Tensor,
        registration: Registration | None, result: _T, *, in_place: InPlace | None = None,
        check: Callable[[], None] | None = None,
    ) -> asyncio.Future[_T]:  # fmt: skip
        assert self._agent is not None  # joined
        return post_reads(
            self._agent, self.device, session, ranges, payload, registration, result, in_place=in_place, check=check
        )

    def _end_session(self) -> None:
        """Stop waiting on the producer: READs still in flight end at their next ask, then its
        agent is dropped, on the session's thread (after them)."""
        session, self._session = self._session, None
        if session is None:
            return
        session.abandoned = True
        agent = self._agent

        def forget_remote() -> None:
            if agent is not None:
                try:
                    agent.forget(session.remote)
                except AgentError as exc:
                    log.info("nixl: %s", exc)

        self._ended = session.waiter.wait(forget_remote)
        self._ended.add_done_callback(outcome_seen)
        session.waiter.close()


def _pool_rows(deliver: Deliver, pools: PoolLanding) -> np.ndarray | None:
    """The pool descriptors of a pull's item (`landing_ranges`, offsets in its payload), or
    None when the item does not lie in the pools as it is."""
    table, g = pools.table, pools.table.geometry
    key, value = deliver.key, deliver.value
    shape = [table.layers, key.shape[1] if len(key.shape) == 4 else -1, g.heads, g.head_dim]
    if list(key.shape) != shape or key.dtype != dtype_name(table.dtype):
        return None
    if g.kv == 2 and (list(value.shape) != shape or value.dtype != key.dtype):
        return None
    if g.kv == 1 and 0 not in value.shape:
        return None
    replicas, slots = pools.replicas, pools.slots
    if replicas is None or slots is None:
        return None
    count = min(shape[1], len(slots))
    return landing_ranges(
        table, replicas[:count], slots[:count], item_tokens=shape[1], key_offset=key.offset, value_offset=value.offset
    )


def _shaped(meta: TensorMeta) -> torch.Tensor:
    """A tensor of `meta`'s shape and dtype that holds no bytes (on the meta device)."""
    return torch.empty(meta.shape, dtype=DTYPES[meta.dtype], device="meta")


__all__ = ["NixlRead", "NixlReceiver", "NixlSender", "nixl_unavailable"]
