"""The consumer (decode side): `Consumer` holds the shared fields (`_state`), one `_Link` per
producer, and its parts: its lookups (`_lookups`), its pulls (`_pulls`) and its stream opening
(`_open_stream`), to which its public calls go; and it starts, closes and reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Self

import torch
import zmq

from kvrt import _metrics
from kvrt._caller_stream import lands_on_caller_stream, on_caller_stream
from kvrt._consensus import GroupConsensus, count_sharing
from kvrt._consumer._link import _Link
from kvrt._consumer._lookups import Lookups
from kvrt._consumer._open_stream import StreamOpening
from kvrt._consumer._pulls import Pulls
from kvrt._consumer._state import ConsumerState
from kvrt._errors import (
    ClosedError,
    PeerLostError,
)
from kvrt._heap import keep_freed_memory
from kvrt._item import KVBuffers, KVItem
from kvrt._loop_watch import LoopWatch, unwatch, watch_running_loop
from kvrt._pools import PoolTable
from kvrt._service import AsyncService
from kvrt._streams import ConsumerStream
from kvrt.transports import Receiver
from kvrt.transports.select import make_receivers


class Consumer(ConsumerState, AsyncService):
    """Takes buffered KV from a producer (decode side).

        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            item = await consumer.drop_select(input_tokens, roi, timeout=0.0)

    Items arrive on `device`. Many `drop_select` calls may be in flight at once. Closing
    ends every pending call with `ClosedError`.

    `transfer_timeout_s`: how long an item's (or a stream layer's) bytes may take to land once
    its header came, on a GPU transport, before the link gives the producer up as if it had
    gone silent (the calls fail, with `KVRTTimeoutError` for the late one, and a new session
    starts): a producer whose GPU hangs while its loop still answers heartbeats. A stream's
    layer counts from its header, sent when the prefill queues the layer: keep it above the
    longest prefill a reader waits through. None waits for ever.

    `group`: the torch.distributed process group of a decode TP group, one consumer per
    rank. Every rank then returns the same outcome for each lookup (the shortest match,
    the worst status), agreed by one all_reduce; lookups must be made in the same order on
    every rank. An item that the group does not take goes back to its producer. With
    `heads=` (a decode TP that shards KV heads unlike prefill, see `drop_select`), the ranks
    that connect to a producer are the readers of each of its items: connect each rank to the
    producers that hold its heads, and only to those.

    `readers`: without a group, how many consumers take pieces of each of the producers'
    items (every decode rank reading that producer: an engine that plans its ranks' pieces
    itself, as the vLLM connector does); 1 by default. A group counts them at start instead.
    """

    _watch: LoopWatch | None = None
    """The loop it runs on, watched while it runs (`kvrt._loop_watch`)."""

    @lands_on_caller_stream
    async def drop_select(
        self,
        input_tokens: torch.Tensor | None,
        roi: torch.Tensor | None = None,
        timeout: float | None = 0.0,
        *,
        stream: torch.cuda.Stream | None = None,
        into: KVBuffers | None = None,
        heads: slice | None = None,
    ) -> KVItem | None:
        """Take the buffered item that best matches `input_tokens` (masked by `roi`).

        Called by the decode engine once per request, from its event loop; many calls may be
        in flight at once. The best match is the longest common prefix of the masked
        sequences, then the oldest item; `input_tokens` None takes the oldest item. `timeout`
        is how long to wait for a match to be inserted: 0 answers at once, None waits until
        one is, or until either side closes. Returns None on a miss.

        Raises `InvalidInputError` for tokens or a roi that are not 1-D (integer, bool)
        tensors of one length, `PeerLostError` when no producer can be reached (or its
        connection closed), `LeaseExpiredError` for an item that came after the link's lease
        ended (given back, not handed over), `KVRTTimeoutError` (phase "reply") when no answer
        came within `timeout + reply_timeout_s`, (phase "transfer") when an item's bytes do not
        come within `transfer_timeout_s`, `RemoteProtocolError` for an answer that breaks the
        protocol, `ClosedError` when the consumer closes meanwhile; in a TP group, the group's
        decision (the same error on every rank). Memory: the item's tensors are the caller's,
        on this consumer's device; the item has left the producer's buffer (its receipt
        follows). On a GPU, work queued on `stream` (None: the calling thread's current stream)
        after this returns reads the item as it landed. `into`: buffers of the caller's that
        the item lands in (`kvrt.KVBuffers`); an item that does not fit them goes back to the
        producer and the call raises `InvalidInputError`.

        `heads=slice(h0, h1)`: only the item's KV heads [h0, h1) (prefill TP unlike decode TP):
        the producer moves only their bytes, and the item waits there for the pieces the other
        readers take (each consumer takes one piece of an item; in a group the readers of a
        producer are the ranks connected to it, else one). Heads are numbered as the producers
        were told (`kvrt.Producer(heads=...)`), else from 0 in the one producer's items; a range
        that lies with several producers is asked of each, and the call returns the joined item
        only when every piece came (a miss or a failure of one gives the others back). An item
        of latents (MLA, an empty value) comes whole for any range. `hidden` comes with the
        piece of the first producer.
        """
        return await self._lookups.drop_select(input_tokens, roi, timeout, into=into, heads=heads)

    @lands_on_caller_stream
    async def drop_select_many(
        self,
        queries: Sequence[torch.Tensor | None],
        rois: Sequence[torch.Tensor | None] | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
        into: Sequence[KVBuffers | None] | None = None,
        heads: slice | None = None,
    ) -> list[KVItem | None]:
        """Several `drop_select`s answered at once (timeout 0): an item or None per query, in
        order; `stream` as for `drop_select`.

        For a serving engine that takes the KV of a whole scheduler step: with one producer
        and no TP group, up to 256 queries travel in one request and the items found come back
        in one transfer (one header, and over NCCL one operation and one completion), so the
        per-request costs are paid once per batch, not once per item. Over a paired
        transport the items of a batch are views of one received buffer, which lives until
        the last of them is freed. Items are taken in query order, each at most once. In a TP
        group (one producer) the batch is taken the same way and its lookups are agreed
        together: one round once the group's window knows batches of that size (the first
        batch after single lookups takes two), where one `drop_select` after the other takes a
        round each. With several producers the queries run as that many `drop_select`s, one
        after the other. `into`: one `kvrt.KVBuffers` (or None) per query, as for
        `drop_select`; one item that does not fit sends every item of the call back. `heads`:
        as for `drop_select`, for every query.
        """
        return await self._lookups.drop_select_many(queries, rois, into=into, heads=heads)

    @lands_on_caller_stream
    async def pull(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor | None = None,
        *,
        into: PoolTable,
        slots: torch.Tensor,
        replica: torch.Tensor | int = 0,
        timeout: float | None = 0.0,
        stream: torch.cuda.Stream | None = None,
        heads: slice | None = None,
    ) -> KVItem | None:
        """Take a published prefill (matched as `drop_select` matches) and write its KV into
        the caller's pools `into`: the item's token i lands at `slots[i]` of replica `replica`
        (or `replica[i]`), for as many tokens as both have. Returns the item (None on a miss,
        and then nothing is written); `timeout` is as in `drop_select`.

        `into` must be on this consumer's device; `slots` and `replica` are 1-D int32 or int64
        tensors on its device or on the host. Raises `InvalidInputError` for pools on another
        device or slots and replicas outside them (before any item is taken), and the errors of
        `drop_select`.

        Memory: the pools are the caller's; kvrt writes only the given slots. On a GPU, with one
        producer and no group, the scatter is pipelined with the transfer: each chunk of layers
        is scattered (on a stream of the consumer's own) as soon as it has landed. Work the
        caller queues on `stream` (None: the calling thread's current stream) after this
        returns sees the whole request in the pools, also after a pull that failed or was
        cancelled midway (the slots then hold a partial request, and no defined bytes where a
        producer died before writing them). `heads`: only those KV heads of the request, as for
        `drop_select` (the pools hold this rank's heads).

        Over `nixl` (one producer, no group) K and V are READ straight into the slots where the
        runs of consecutive slots are long enough (pages of block pools): the returned item's
        `key` and `value` are then meta tensors (shape and dtype, no bytes)."""
        return await self._pulls.pull(
            input_tokens, roi, into=into, slots=slots, replica=replica, timeout=timeout, heads=heads
        )

    @on_caller_stream
    async def open_stream(
        self,
        input_tokens: torch.Tensor | None,
        roi: torch.Tensor | None = None,
        timeout: float | None = 0.0,
        *,
        into: PoolTable | None = None,
        slots: torch.Tensor | None = None,
        replica: torch.Tensor | int = 0,
        stream: torch.cuda.Stream | None = None,
        heads: slice | None = None,
        skip: int = 0,
    ) -> ConsumerStream | None:
        """Take a request's KV layer by layer (see `kvrt._streams`): a prefill still running, or a
        finished item. Matching, `timeout` and the result are as for drop_select; the stream's
        layers are awaited with `layer(i)` or `async for`. None on a miss.

        With `into` (and `slots`, `replica`, as for `pull`) each layer is written into those
        pools as it lands, at the slots, for as many tokens as both have; `layer(i)` returns
        once layer i is written (on a GPU: once the write is queued, with the caller's stream
        made to wait for it). Slots out of range are refused before anything is taken. The
        writes wait, on the GPU, for `stream` (None: the caller's current stream) as it was
        when this was called: the work that wrote the slots there.

        `skip`: the first tokens of the match, which the caller holds in its pools already (a
        prefix of its own cache), are not written: token i >= `skip` lands at `slots[i - skip]`.

        `heads`: only those KV heads of each layer, as for `drop_select`. A piece is cut from a
        finished item: a request for one takes a prefill that is still running once it ended.
        Into pools that hold some of the model's heads (`PoolTable(..., heads=)`), the piece
        lands at its heads' place among them."""
        return await self._opening.open_stream(
            input_tokens, roi, timeout, into=into, slots=slots, replica=replica, heads=heads, skip=skip
        )

    @cached_property
    def _lookups(self) -> Lookups:
        return Lookups(self)

    @cached_property
    def _pulls(self) -> Pulls:
        return Pulls(self, self._lookups)

    @cached_property
    def _opening(self) -> StreamOpening:
        return StreamOpening(self, self._lookups)

    async def start(self) -> Self:
        """Connect and handshake with the producer; returns once it answered."""
        if self._context is not None or self._closed:
            raise ClosedError("a consumer starts once; create a new one")
        keep_freed_memory()
        self._context = zmq.Context()
        _metrics.track_consumer(self)
        self._watch = watch_running_loop()
        try:
            if self._group is not None:
                self._consensus = GroupConsensus(self._group)
                self._consensus.start()
            for endpoint in self._endpoints:
                link = _Link(
                    endpoint,
                    device=self.device,
                    context=self._context,
                    name=self._name,
                    heartbeat_s=self._heartbeat_s,
                    transports=_checking(make_receivers(self._transport_names, self.device)),
                    connect_timeout_s=self._connect_timeout_s,
                    curve=self._curve,
                    transfer_timeout_s=self._transfer_timeout_s,
                    reply_timeout_s=self._reply_timeout_s,
                    metrics=self.metrics,
                )
                self._links.append(link)
                await link.start()
            if self._group is not None:
                # Each producer learns from every piece request how many ranks take pieces of its
                # items: the ranks of the group that connect to it. A group that cannot tell
                # (a rank died) fails the lookups that need it, and the group's agreement the rest.
                names = [link.core.producer_id or link.endpoint for link in self._links]
                try:
                    self._readers = await count_sharing(self._group, names, self._connect_timeout_s)
                except PeerLostError as error:
                    self._readers_unknown = error
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        """End every pending call with `ClosedError`, say Bye, and stop."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            unwatch(self._watch)
        if self._consensus is not None:
            await self._consensus.aclose()
        for link in self._links:
            await link.aclose()
        if self._scatters is not None:
            self._scatters.shutdown(wait=False)  # queued scatters still run: they only enqueue GPU work
        if self._context is not None:
            self._context.term()

    @property
    def name(self) -> str:
        """This consumer's name, as its producers and its metrics (`consumer` label) know it."""
        return self._name

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    @property
    def transports(self) -> dict[str, str | None]:
        """Per producer endpoint, the transport its items travel over ("nccl", "gloo", "tcp"),
        as the producer chose it from what both offer; None until it answered."""
        return {link.endpoint: link.core.transport for link in self._links}

    @property
    def pending_requests(self) -> int:
        return sum(link.core.pending_count for link in self._links)

    def link_for_tests(self, index: int = 0) -> _Link:
        """The link to the `index`-th producer of `connect` (the only one by default): a hook
        for tests that watch or steer one link's protocol core, socket or transport. Not part
        of the serving API, and what a link holds may change between versions."""
        return self._links[index]


def device_checksum(data: torch.Tensor, seed: int) -> int:
    """`kvrt.kernels.checksum`'s checksum of bytes that landed: the kernel on a GPU, its
    reference on the host (an item a GPU producer sent over TCP)."""
    from kvrt.kernels.checksum import checksum, checksum_reference  # Triton: only for GPU producers' items

    return checksum(data, seed) if data.device.type == "cuda" else checksum_reference(data, seed)


def _checking(receivers: dict[str, Receiver]) -> dict[str, Receiver]:
    """Receivers that check GPU producers' checksums (the kernel lives above the transports)."""
    for receiver in receivers.values():
        receiver.device_checksum = device_checksum
    return receivers
