"""Joining the transport a producer's welcome names (`Receiver.join`), in a task the link
owns, while the link goes on answering heartbeats; where the transport cannot work with this
producer and another was offered, the link says so and starts a new session without it."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import torch

from kvrt import _messages as m
from kvrt._errors import KVRTError, PeerLostError, RemoteProtocolError, TransportUnavailableError
from kvrt._protocol import ConsumerCore
from kvrt._threads import pass_outcome
from kvrt.transports import Receiver

log = logging.getLogger("kvrt.consumer")


class TransportJoin:
    """A link's transports, the one its producer chose, and the task that joins it."""

    def __init__(
        self, transports: dict[str, Receiver], core: ConsumerCore, endpoint: str, connect_timeout_s: float,
        new_session: Callable[[KVRTError], None],
    ) -> None:  # fmt: skip
        self.transports = transports
        self.receiver: Receiver | None = None
        """The transport the producer and this link agreed on (None before the first welcome)."""
        self.task: asyncio.Task[None] | None = None
        self._core = core
        self._endpoint = endpoint
        self.connect_timeout_s = connect_timeout_s
        self._new_session = new_session
        self._rejoin: asyncio.Future[None] | None = None
        """Set while a join that fell back waits for the next welcome's join."""

    def start(self, welcome: m.Welcome) -> None:
        """Join the transport the producer chose, in a task the link owns (the link keeps
        answering heartbeats meanwhile); requests wait for it in `joined`."""
        transport = self.transports.get(welcome.transport)
        log.info("the producer's items travel over %s", welcome.transport,
                 extra={"endpoint": self._endpoint, "transport": welcome.transport})  # fmt: skip
        rejoin, self._rejoin = self._rejoin, None
        if self.task is not None and rejoin is None:
            self.task.cancel()
        self.receiver = transport
        if transport is None:
            error = RemoteProtocolError(f"producer chose transport {welcome.transport!r}, which was not offered")
            task = asyncio.create_task(_raise(error))
        else:
            task = asyncio.create_task(self._join(transport, welcome.rendezvous))
        self.task = task
        if rejoin is not None:  # the join that fell back (and who waits on it) ends with this one
            task.add_done_callback(functools.partial(pass_outcome, rejoin))

    async def _join(self, transport: Receiver, rendezvous: dict[str, str]) -> None:
        """Join `transport`; where it cannot work with this producer (`cuda_ipc` between
        processes that cannot share memory) and another was offered, say so and start a new
        session without it, ending only once that one joined."""
        try:
            await transport.join(rendezvous, self.connect_timeout_s)
            if m.Capability.CHECKSUM in self._core.producer_capabilities and transport.device.type == "cuda":
                await asyncio.to_thread(_ready_to_check, transport.device)
        except TransportUnavailableError as exc:
            remaining = tuple(name for name in self._core.transports if name != transport.name)
            if not remaining:
                raise
            log.warning("%s; the items of the producer at %s travel over %s instead", exc, self._endpoint, remaining[0],
                        extra={"endpoint": self._endpoint, "transport": transport.name})  # fmt: skip
            self._core.transports = remaining
            self._rejoin = asyncio.get_running_loop().create_future()
            self._new_session(exc)
            await self._rejoin

    async def joined(self) -> None:
        """Once the transport of the latest welcome is joined (or why it could not be)."""
        task = self.task
        if task is None:
            return
        try:
            await asyncio.shield(task)
        except KVRTError as exc:
            raise PeerLostError(f"could not join the producer's {self._core.transport} transport: {exc}") from exc


async def _raise(error: BaseException) -> None:
    raise error


def _ready_to_check(device: torch.device) -> None:
    """Compile the checksum kernel on `device` (about a second, mostly holding the GIL): at the
    join, where no call waits, rather than at the first item's check, where every call in
    flight would wait past its reply timeout."""
    from kvrt.kernels.checksum import warm_up  # Triton: only for producers that checksum

    warm_up(device)
