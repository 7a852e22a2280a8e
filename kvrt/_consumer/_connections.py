"""What the parts of a consumer share, each handed what it uses: the constructor's arguments
checked (`ConsumerConfig`), its links to its producers and its TP group's agreement
(`Connections`), and the thread and stream that scatter into the caller's pools (`Scatters`).
`Consumer` makes them and hands them to its parts (`Lookups`, `Pulls`, `StreamOpening`).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from kvrt import _metrics
from kvrt._arguments import seconds
from kvrt._auth import CurveKeys
from kvrt._consensus import GroupConsensus, count_sharing
from kvrt._consumer._link import _Link
from kvrt._consumer._session import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_REPLY_TIMEOUT_S,
    DEFAULT_TRANSFER_TIMEOUT_S,
    LinkSession,
)
from kvrt._errors import (
    ClosedError,
    PeerLostError,
)
from kvrt._threads import gpu_worker
from kvrt.transports import Receiver

__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_REPLY_TIMEOUT_S", "DEFAULT_TRANSFER_TIMEOUT_S"]


def _seconds(value: object, name: str) -> float:
    checked = seconds(value, name)
    assert checked is not None
    return checked


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """A consumer's constructor arguments, checked (see `Consumer`)."""

    endpoints: tuple[str, ...]
    device: torch.device
    group: dist.ProcessGroup | None
    transport_names: tuple[str, ...]
    curve: CurveKeys | None
    heartbeat_s: float
    connect_timeout_s: float
    transfer_timeout_s: float | None
    reply_timeout_s: float
    name: str
    readers: int | None


class Connections:
    """A consumer's links, one per producer (in `connect` order), its TP group's agreement,
    and how many consumers read pieces of each producer's items."""

    def __init__(
        self, config: ConsumerConfig, metrics: _metrics.ConsumerMetrics, receivers: Callable[[], dict[str, Receiver]]
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._receivers = receivers
        """Makes one link's receivers (each link has its own)."""
        self.links: list[_Link] = []
        self.consensus: GroupConsensus | None = None
        self.readers: list[int] = [config.readers or 1] * len(config.endpoints)
        """Per producer, how many consumers take pieces of its items (`heads=`): the ranks of
        the group that connect to it, counted at start; without a group `readers` (1)."""
        self.readers_unknown: PeerLostError | None = None
        """Why the group could not count them at start (a head range then cannot be asked)."""
        self.context: zmq.Context[zmq.Socket[bytes]] | None = None
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("the consumer is closed")
        if self.context is None:
            raise ClosedError("the consumer is not started: use `async with` or `await start()`")

    async def start(self) -> None:
        """Connect to every producer, in order; a group counts the readers of each."""
        config = self._config
        context = self.context = zmq.Context()
        if config.group is not None:
            self.consensus = GroupConsensus(config.group)
            self.consensus.start()
        for address in config.endpoints:
            link = _Link(LinkSession(
                address,
                device=config.device,
                context=context,
                name=config.name,
                heartbeat_s=config.heartbeat_s,
                transports=self._receivers(),
                connect_timeout_s=config.connect_timeout_s,
                curve=config.curve,
                transfer_timeout_s=config.transfer_timeout_s,
                reply_timeout_s=config.reply_timeout_s,
                metrics=self._metrics,
            ))  # fmt: skip
            self.links.append(link)
            await link.start()
        if config.group is not None:
            # Each producer learns from every piece request how many ranks take pieces of its
            # items: the ranks of the group that connect to it. A group that cannot tell
            # (a rank died) fails the lookups that need it, and the group's agreement the rest.
            names = [link.core.producer_id or link.endpoint for link in self.links]
            try:
                self.readers = await count_sharing(config.group, names, config.connect_timeout_s)
            except PeerLostError as error:
                self.readers_unknown = error

    async def aclose(self) -> None:
        self.closed = True
        if self.consensus is not None:
            await self.consensus.aclose()
        for link in self.links:
            await link.aclose()

    def terminate(self) -> None:
        """The ZeroMQ context goes, once every link closed."""
        if self.context is not None:
            self.context.term()


class Scatters:
    """Where pulls and streams write what lands into the caller's pools: one thread that
    queues the scatters in order, off the loop, and (GPU) a stream the caller's waits only for
    the writes; each made when first needed."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: torch.cuda.Stream | None = None

    def scatter_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread that queues pulls' and streams' scatters, in order, off the loop."""
        if self._thread is None:
            self._thread = gpu_worker(self._device, "kvrt-scatter")
        return self._thread

    def scatter_stream(self) -> torch.cuda.Stream:
        """Where scatters into the caller's pools run (GPU)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        return self._stream

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False)  # queued scatters still run: they only enqueue GPU work
