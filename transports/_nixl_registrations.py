"""The consumer's NIXL registrations of the caller's memory, for READs that land there: a
pull's pools (once per `PoolTable`, for as long as it lives) and the storages of `into=`
buffers (the last `REGISTERED_BUFFERS` kept)."""

from __future__ import annotations

import logging
import weakref
from typing import Final

import torch

from kvrt._pools import PoolTable
from kvrt.transports._nixl_agent import Agent, AgentError, Registration

log = logging.getLogger("kvrt.transports")

REGISTERED_BUFFERS: Final = 8
"""How many storages of `into=` buffers a consumer keeps registered (and alive) at most."""


class CallerRegistrations:
    """What of the caller's memory this side's agent has registered."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.agent: Agent | None = None
        """Set once the receiver made its agent (at its first join)."""
        self._pools: weakref.WeakKeyDictionary[PoolTable, list[Registration]] = weakref.WeakKeyDictionary()
        self._collected: list[Registration] = []
        """Registrations of pool tables since collected, dropped at the next landing."""
        self.buffers: dict[tuple[int, int], tuple[Registration, torch.Tensor]] = {}
        """The storages of recent `into=` buffers, registered, by (address, bytes), oldest first."""

    def pools(self, table: PoolTable) -> list[Registration] | None:
        """The pools of `table` registered with this side's agent: once per table, for as long
        as it lives (each pool's registration is dropped at the first landing after the table
        was collected, or at `aclose`). None when the agent refused one (logged)."""
        held = self._pools.get(table)
        if held is not None:
            return held
        agent = self.agent
        assert agent is not None  # joined
        self._deregister_collected()
        held = []
        pools = {pool.data_ptr(): pool for replica in table.pools for copy in replica for pool in copy}
        try:
            for address, pool in pools.items():
                held.append(agent.register(address, pool.numel() * pool.element_size(), self.device))
        except AgentError as exc:
            log.info("nixl: the pools cannot be registered (%s): pulls scatter what lands in the arena", exc)
            for registration in held:
                agent.deregister(registration)
            return None
        self._pools[table] = held
        weakref.finalize(table, self._collected.extend, held)
        return held

    def buffer(self, buffer: torch.Tensor) -> Registration | None:
        """The storage of an `into=` buffer registered with this side's agent, once: the last
        `REGISTERED_BUFFERS` storages stay registered (and alive) for the calls that reuse
        them, as an engine's staging buffers are; an older one is dropped. None when the agent
        refused it (logged)."""
        storage = buffer.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        held = self.buffers.pop(key, None)
        if held is None:
            assert self.agent is not None  # joined
            try:
                registration = self.agent.register(key[0], key[1], self.device)
            except AgentError as exc:
                log.info("nixl: into= buffers cannot be registered (%s): items are copied there", exc)
                return None
            held = (registration, buffer)
            while len(self.buffers) >= REGISTERED_BUFFERS:
                oldest = next(iter(self.buffers))
                self._deregister_quietly(self.buffers.pop(oldest)[0])
        self.buffers[key] = held  # the most recent last
        return held[0]

    def _deregister_quietly(self, registration: Registration) -> None:
        assert self.agent is not None
        try:
            self.agent.deregister(registration)
        except AgentError as exc:
            log.info("nixl: %s", exc)

    def _deregister_collected(self) -> None:
        collected, self._collected[:] = list(self._collected), []
        for registration in collected:
            self._deregister_quietly(registration)

    def drain(self) -> list[Registration]:
        """Every registration held (closing): forgotten here, for the caller to drop."""
        held = [registration for registration_list in self._pools.values() for registration in registration_list]
        held += self._collected
        held += [registration for registration, _ in self.buffers.values()]
        self._pools.clear()
        self._collected.clear()
        self.buffers.clear()
        return held
