"""The consumer (decode side): `Consumer` composes its parts (`_selection`, `_pulls`,
`_streams`) over the shared fields of `_state`, with one `_Link` per producer, and adds
starting, closing and what it reports.
"""

from __future__ import annotations

from typing import Self

import zmq

from kvrt import _metrics
from kvrt._consensus import GroupConsensus, count_sharing
from kvrt._consumer._link import _Link
from kvrt._consumer._open_stream import _OpeningStreams
from kvrt._errors import (
    ClosedError,
    PeerLostError,
)
from kvrt._service import AsyncService
from kvrt.transports.select import make_receivers


class Consumer(_OpeningStreams, AsyncService):
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

    async def start(self) -> Self:
        """Connect and handshake with the producer; returns once it answered."""
        if self._context is not None or self._closed:
            raise ClosedError("a consumer starts once; create a new one")
        self._context = zmq.Context()
        _metrics.track_consumer(self)
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
                    transports=make_receivers(self._transport_names, self.device),
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
