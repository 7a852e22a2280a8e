"""What every part of a consumer shares: the fields set up from the constructor's arguments,
their checks, its counters, the scatter thread and stream, and `_check_open`. `Consumer` is a
`ConsumerState`; its parts (`Lookups`, `Pulls`, `StreamOpening`) are given it.
"""

from __future__ import annotations

import concurrent.futures
import os
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist
import zmq

from kvrt import _metrics
from kvrt._arguments import endpoint, seconds
from kvrt._auth import CurveKeys
from kvrt._consensus import GroupConsensus
from kvrt._consumer._link import _Link
from kvrt._consumer._session import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_REPLY_TIMEOUT_S, DEFAULT_TRANSFER_TIMEOUT_S
from kvrt._devices import usable_device
from kvrt._errors import (
    ClosedError,
    InvalidInputError,
    PeerLostError,
)
from kvrt._messages import MAX_READERS
from kvrt._metrics import ConsumerCounters
from kvrt._protocol import DEFAULT_HEARTBEAT_S, _heartbeat
from kvrt._threads import gpu_worker
from kvrt.transports.select import transport_preference


def _seconds(value: object, name: str) -> float:
    checked = seconds(value, name)
    assert checked is not None
    return checked


class ConsumerState:
    """The fields of a consumer and the helpers every part of it calls."""

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
        self._reply_timeout_s = reply_timeout_s
        self._transfer_timeout_s = transfer_timeout_s
        self.device = usable_device(device)
        self._endpoints = endpoints
        self._transport_names = transport_preference(transport, self.device)
        self._curve = curve
        self._name = name or f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._heartbeat_s = heartbeat_s
        self._connect_timeout_s = connect_timeout_s
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._links: list[_Link] = []
        self._group = group
        self._consensus: GroupConsensus | None = None
        if readers is not None and (
            group is not None or not isinstance(readers, int) or not 1 <= readers <= MAX_READERS
        ):
            raise InvalidInputError(
                f"readers must be None or an int from 1 to {MAX_READERS}, and only without group= (a group counts "
                f"them), got {readers!r}"
            )
        self._readers: list[int] = [readers or 1] * len(endpoints)
        """Per producer, how many consumers take pieces of its items (`heads=`): the ranks of
        the group that connect to it, counted at start; without a group `readers` (1)."""
        self._readers_unknown: PeerLostError | None = None
        """Why the group could not count them at start (a head range then cannot be asked)."""
        self._pull_stream: torch.cuda.Stream | None = None
        """Where pulls scatter what lands (GPU): the caller's stream waits only for the writes."""
        self._scatters: concurrent.futures.ThreadPoolExecutor | None = None
        """Queues a pull's scatters, in order, off the loop (see `pull`)."""
        self.counters = ConsumerCounters()
        self.metrics = _metrics.ConsumerMetrics()
        """Lookups by outcome, lookup waits and transfers (see `kvrt._metrics`)."""
        self._closed = False

    def scatter_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread that queues pulls' and streams' scatters, in order, off the loop."""
        if self._scatters is None:
            self._scatters = gpu_worker(self.device, "kvrt-scatter")
        return self._scatters

    def scatter_stream(self) -> torch.cuda.Stream:
        """Where scatters into the caller's pools run (GPU)."""
        if self._pull_stream is None:
            self._pull_stream = torch.cuda.Stream(self.device)
        return self._pull_stream

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the consumer is closed")
        if self._context is None:
            raise ClosedError("the consumer is not started: use `async with` or `await start()`")
