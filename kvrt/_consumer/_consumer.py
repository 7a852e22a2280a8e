"""The consumer (decode side): `Consumer` makes its parts and hands each what it uses (the
shared ones in `_connections`: its links, one `_Link` per producer, and its scatters): its lookups
(`_drop_selects`), its pulls (`_pulls`) and its stream opening (`_open_stream`), to which its public
calls go; and it starts, closes and reports.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import Any, Self

import torch
import torch.distributed as dist

from kvrt import _metrics
from kvrt._arguments import endpoint, seconds
from kvrt._auth import CurveKeys
from kvrt._caller_stream import run_on_caller_stream
from kvrt._consumer._connections import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_REPLY_TIMEOUT_S,
    DEFAULT_TRANSFER_TIMEOUT_S,
    Connections,
    ConsumerConfig,
    Scatters,
)
from kvrt._consumer._drop_selects import DropSelects
from kvrt._consumer._fetches import Fetch, Fetches
from kvrt._consumer._link import _Link
from kvrt._consumer._open_stream import StreamOpening
from kvrt._consumer._pulls import Pulls
from kvrt._devices import usable_device
from kvrt._errors import ClosedError, InvalidInputError
from kvrt._heap import keep_freed_memory
from kvrt._item import KVItem
from kvrt._loop_watch import LoopWatch, unwatch, watch_running_loop
from kvrt._messages import MAX_READERS
from kvrt._metrics import ConsumerCounters
from kvrt._protocol import DEFAULT_HEARTBEAT_S, _heartbeat
from kvrt._service import AsyncService
from kvrt._signatures import takes
from kvrt._streams import ConsumerStream
from kvrt.transports import Receiver
from kvrt.transports.select import make_receivers, transport_preference


def _seconds(value: object, name: str) -> float:
    checked = seconds(value, name)
    assert checked is not None
    return checked


class Consumer(AsyncService):
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

    def __init__(
        self,
        connect: str | Sequence[str],
        device: torch.device | str = "cpu",
        *,
        group: dist.ProcessGroup | None = None,
        transport: str | None = None,
        curve: CurveKeys | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        transfer_timeout_s: float | None = DEFAULT_TRANSFER_TIMEOUT_S,
        reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S,
        name: str | None = None,
        readers: int | None = None,
    ) -> None:
        endpoints = [connect] if isinstance(connect, str) else list(connect) if isinstance(connect, Sequence) else []
        if not endpoints:
            raise InvalidInputError(
                f"connect must be a ZeroMQ address such as 'tcp://host:port', or a list of them; got {connect!r}"
            )
        endpoints = [endpoint(address, "connect", binding=False) for address in endpoints]
        heartbeat_s = _heartbeat(heartbeat_s)
        connect_timeout_s = _seconds(connect_timeout_s, "connect_timeout_s")
        reply_timeout_s = _seconds(reply_timeout_s, "reply_timeout_s")
        transfer_timeout_s = seconds(transfer_timeout_s, "transfer_timeout_s", none=True)
        if curve is not None and not isinstance(curve, CurveKeys):
            raise InvalidInputError(f"curve must be None or kvrt.CurveKeys, got {type(curve).__name__}")
        usable = usable_device(device)
        transport_names = tuple(transport_preference(transport, usable))
        if readers is not None and (
            group is not None or not isinstance(readers, int) or not 1 <= readers <= MAX_READERS
        ):
            raise InvalidInputError(
                f"readers must be None or an int from 1 to {MAX_READERS}, and only without group= (a group counts "
                f"them), got {readers!r}"
            )
        config = ConsumerConfig(
            endpoints=tuple(endpoints), device=usable, group=group, transport_names=transport_names, curve=curve,
            heartbeat_s=heartbeat_s, connect_timeout_s=connect_timeout_s, transfer_timeout_s=transfer_timeout_s,
            reply_timeout_s=reply_timeout_s, name=name or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            readers=readers,
        )  # fmt: skip
        self._config = config
        self.device = config.device
        self.counters = ConsumerCounters()
        self.metrics = _metrics.ConsumerMetrics()
        """Lookups by outcome, lookup waits and transfers (see `kvrt._metrics`)."""
        self._transport_names = config.transport_names
        """What its links offer their producers, preferred first."""
        self._connections = Connections(
            config, self.metrics, lambda: _checking(make_receivers(self._transport_names, self.device))
        )
        self._scatters = Scatters(config.device)
        self._drop_selects = DropSelects(self._connections, config.device, self.counters, self.metrics)
        self._pulls = Pulls(self._connections, self._scatters, self._drop_selects, config.device)
        self._opening = StreamOpening(self._connections, self._scatters, self._drop_selects, config.device)
        self._fetches = Fetches(self._connections, self._scatters, self._drop_selects, config.device)

    @takes(DropSelects.drop_select)
    async def drop_select(self, *args: Any, **kwargs: Any) -> KVItem | None:
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
        return await run_on_caller_stream(
            self._drop_selects.drop_select(*args, **kwargs), self.device, kwargs.get("stream"), lands=True
        )

    @takes(DropSelects.drop_select_many)
    async def drop_select_many(self, *args: Any, **kwargs: Any) -> list[KVItem | None]:
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
        return await run_on_caller_stream(
            self._drop_selects.drop_select_many(*args, **kwargs), self.device, kwargs.get("stream"), lands=True
        )

    @takes(Pulls.pull)
    async def pull(self, *args: Any, **kwargs: Any) -> KVItem | None:
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
        return await run_on_caller_stream(
            self._pulls.pull(*args, **kwargs), self.device, kwargs.get("stream"), lands=True
        )

    @takes(StreamOpening.open_stream)
    async def open_stream(self, *args: Any, **kwargs: Any) -> ConsumerStream | None:
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
        return await run_on_caller_stream(self._opening.open_stream(*args, **kwargs), self.device, kwargs.get("stream"))

    @takes(Fetches.fetch)
    def fetch(self, *args: Any, **kwargs: Any) -> Fetch:
        """Start taking a scheduler step's requests into the caller's pools, and return at once:
        the first of two phases (the second: `await fetch.landed()`).

        Called by a serving engine once a step, on this consumer's event loop (not a coroutine:
        the request is on its way when it returns). The queries (token tensors, up to 256)
        travel to the one producer in one message and its items come back in one answer, each
        matched as `drop_select` matches (timeout 0); query i's item is written into the pools
        `into` as it lands: its tokens from `skip[i]` (those the pools hold already are not
        written) at `slots[i]` of replica `replica`, as far as the match and the slots go.
        `heads`: only those KV heads, as for `drop_select`, for every query.

        Bad queries, slots outside the pools or pools on another device raise
        `InvalidInputError` here, before anything is taken. A consumer of several producers or
        in a group raises it too (fetch one producer's requests a consumer). What happens
        later (a miss, a producer gone, a reply late) is told by `Fetch.landed`. Memory: the
        pools are the caller's, and kvrt writes only the slots given. On a GPU, work queued on
        `stream` (None: the calling thread's current stream) after `landed` returns reads the
        requests as they landed."""
        return self._fetches.fetch(*args, **kwargs)

    async def start(self) -> Self:
        """Connect and handshake with the producer; returns once it answered."""
        connections = self._connections
        if connections.context is not None or connections.closed:
            raise ClosedError("a consumer starts once; create a new one")
        keep_freed_memory()
        _metrics.track_consumer(self)
        self._watch = watch_running_loop()
        try:
            await connections.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        """End every pending call with `ClosedError`, say Bye, and stop."""
        if self._connections.closed:
            return
        if self._watch is not None:
            unwatch(self._watch)
        await self._fetches.aclose()
        await self._connections.aclose()
        self._scatters.close()
        self._connections.terminate()

    @property
    def name(self) -> str:
        """This consumer's name, as its producers and its metrics (`consumer` label) know it."""
        return self._config.name

    @property
    def endpoints(self) -> list[str]:
        return list(self._config.endpoints)

    @property
    def transports(self) -> dict[str, str | None]:
        """Per producer endpoint, the transport its items travel over ("nccl", "gloo", "tcp"),
        as the producer chose it from what both offer; None until it answered."""
        return {link.endpoint: link.core.transport for link in self._connections.links}

    @property
    def pending_requests(self) -> int:
        return sum(link.core.pending_count for link in self._connections.links)

    def link_for_tests(self, index: int = 0) -> _Link:
        """The link to the `index`-th producer of `connect` (the only one by default): a hook
        for tests that watch or steer one link's protocol core, socket or transport. Not part
        of the serving API, and what a link holds may change between versions."""
        return self._connections.links[index]


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
