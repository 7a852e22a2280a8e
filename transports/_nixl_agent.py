"""The few calls of NIXL's Python API that the `nixl` transport makes, typed, and its errors
turned into one (`AgentError`) at this boundary. NIXL ships without type hints and its
bindings raise their own exception family; nothing else in kvrt imports it.

The wheel is `nixl_cu12` (CUDA 12 builds, Python up to 3.11 on PyPI) or `nixl_cu13`; the first
one importable is used. An agent is one NIXL instance with the UCX backend; UCX chooses how
bytes move (`cma` between processes of one host, RDMA verbs, CUDA IPC, or TCP when told
`UCX_TLS=tcp`).

Threads: an agent made with `thread_safe=True` takes a lock around each call (NIXL's
"strict" mode), so a kvrt thread may wait on a transfer that the loop's thread posted.
"""

from __future__ import annotations

import enum
import functools
import importlib
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

_WHEELS = ("nixl_cu13", "nixl_cu12")
PROGRESS_WAKE_US = 1000
"""How long the UCX progress thread sleeps in `poll` when no event woke it. The thread waits on
the UCX workers' event file descriptors and wakes on each event; NIXL's Python API sets this
to 0, which makes that `poll` return at once and the thread spin on a core."""
_constructing = threading.Lock()
_FEW_DESCRIPTORS = 8


@functools.cache
def _import_nixl() -> tuple[ModuleType | None, str]:
    """NIXL's API module (imported on first use: ~0.1 s, which `import kvrt` need not pay)."""
    reasons = []
    for wheel in _WHEELS:
        try:
            return importlib.import_module(f"{wheel}._api"), wheel
        except ImportError as exc:
            reasons.append(f"{wheel}: {exc}")
    return None, "; ".join(reasons)


def nixl_unavailable() -> str | None:
    """Why this process cannot use NIXL (None: the wheel imports)."""
    api, reasons = _import_nixl()
    if api is None:
        return f"NIXL is not installed (pip install 'kvrt[nixl]'): {reasons}"
    return None


class AgentError(RuntimeError):
    """A NIXL call failed; `not_found` when NIXL knows no registration or agent for it."""

    def __init__(self, message: str, *, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


def _failed(what: str, exc: Exception) -> AgentError:
    return AgentError(f"{what}: {type(exc).__name__}: {exc}", not_found=type(exc).__name__ == "nixlNotFoundError")


class TransferState(enum.Enum):
    DONE = "DONE"
    PENDING = "PROC"
    FAILED = "ERR"


_ids = itertools.count(1)


@dataclass(frozen=True, slots=True, eq=False)
class Registration:
    """One region registered with the agent: `registration_id` is unique in this process."""

    registration_id: int
    address: int
    nbytes: int
    descs: Any


def _memory(device: torch.device) -> tuple[str, int]:
    """NIXL's memory type and device id of memory on `device`."""
    if device.type == "cuda":
        return "VRAM", torch.cuda.current_device() if device.index is None else device.index
    return "DRAM", 0


class Transfer:
    """A READ made but maybe not posted; `release` once it ended (or to cancel it)."""

    __slots__ = ("_agent", "_handle", "nbytes")

    def __init__(self, agent: Any, handle: Any, nbytes: int) -> None:
        self._agent = agent
        self._handle = handle
        self.nbytes = nbytes

    def post(self) -> TransferState:
        try:
            return TransferState(self._agent.transfer(self._handle))
        except Exception as exc:  # NIXL's own family, translated here
            raise _failed("posting a NIXL READ", exc) from None

    def state(self) -> TransferState:
        try:
            return TransferState(self._agent.check_xfer_state(self._handle))
        except Exception as exc:
            raise _failed("checking a NIXL READ", exc) from None

    def release(self) -> bool:
        """Free the request; NIXL cancels one still in flight, and may refuse: then False, and
        the READ may still be writing (ask `state` until it ended, then release it again)."""
        try:
            self._handle.release()
        except Exception:  # a cancel NIXL refused
            return False
        return True

    def abandon(self) -> None:
        """Leave a request NIXL would not release to the agent, which frees it when it goes."""
        self._agent._leaked_xfer_handles.append(self._handle._handle)
        self._handle._released = True


class Agent:
    """One NIXL agent with the UCX backend. Making one takes ~0.4 s (UCX's set-up): do it
    on a thread, not the loop."""

    def __init__(self, name: str, *, progress_thread: bool, thread_safe: bool = True) -> None:
        api, reasons = _import_nixl()
        if api is None:
            raise AgentError(f"NIXL is not installed: {reasons}")
        sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if thread_safe else None
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"], sync_mode=sync)
        bindings = api.nixlBind
        make_agent = bindings.nixlAgent

        def with_progress_wake(agent_name: str, agent_config: Any) -> Any:
            agent_config.pthrDelay = PROGRESS_WAKE_US
            return make_agent(agent_name, agent_config)

        # The Python API offers no say over that delay: its call of the bindings' constructor
        # is wrapped for the time this agent is made (the lock keeps two agents' apart).
        with _constructing:
            bindings.nixlAgent = with_progress_wake
            try:
                self._agent = api.nixl_agent(name, config)
            except Exception as exc:
                raise _failed("creating a NIXL agent", exc) from None
            finally:
                bindings.nixlAgent = make_agent
        if "UCX" not in self._agent.backends:
            raise AgentError(f"NIXL has no UCX backend here (its plugins: {self._agent.plugin_list})")
        self.name = name

    def register(self, address: int, nbytes: int, device: torch.device) -> Registration:
        memory, device_id = _memory(device)
        try:
            descs = self._agent.register_memory([(address, nbytes, device_id, "")], memory)
        except Exception as exc:
            raise _failed(f"registering {nbytes} bytes with NIXL", exc) from None
        return Registration(next(_ids), address, nbytes, descs)

    def deregister(self, registration: Registration) -> None:
        try:
            self._agent.deregister_memory(registration.descs)
        except Exception as exc:
            raise _failed("deregistering memory from NIXL", exc) from None

    def metadata(self, registration: Registration, *, connection: bool) -> bytes:
        """What a peer loads (`load`) to read `registration`; with `connection`, also how to
        reach this agent."""
        try:
            return bytes(self._agent.get_partial_agent_metadata(registration.descs, connection))
        except Exception as exc:
            raise _failed("reading this NIXL agent's metadata", exc) from None

    def load(self, metadata: bytes) -> str:
        """Load a peer's metadata (whole or partial); the peer agent's name."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise _failed("loading a peer's NIXL metadata", exc) from None
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def forget(self, remote: str) -> None:
        """Drop a peer agent (and NIXL's connection to it)."""
        try:
            self._agent.remove_remote_agent(remote)
        except Exception as exc:
            raise _failed("removing a NIXL peer", exc) from None

    def read(
        self,
        remote: str,
        ranges: Sequence[tuple[int, int, int]] | np.ndarray,
        *,
        local: torch.device,
        peer: torch.device,
    ) -> Transfer:
        """A READ of `ranges` (local address, remote address, bytes; or an int64 array of such
        rows), one descriptor each, from the memory `remote` registered on its `peer` device
        into this agent's on `local`."""
        local_memory, local_id = _memory(local)
        remote_memory, remote_id = _memory(peer)
        local_rows: Any
        remote_rows: Any
        if not isinstance(ranges, np.ndarray) and len(ranges) <= _FEW_DESCRIPTORS:
            # Lists of tuples: cheaper than numpy for a few.
            local_rows = [(address, nbytes, local_id) for address, _, nbytes in ranges]
            remote_rows = [(address, nbytes, remote_id) for _, address, nbytes in ranges]
            nbytes = sum(nbytes for _, _, nbytes in ranges)
        else:
            rows = np.asarray(ranges).astype(np.uint64, copy=False).reshape(-1, 3)
            local_rows = np.stack([rows[:, 0], rows[:, 2], np.full(len(rows), local_id, dtype=np.uint64)], axis=1)
            remote_rows = np.stack([rows[:, 1], rows[:, 2], np.full(len(rows), remote_id, dtype=np.uint64)], axis=1)
            nbytes = int(rows[:, 2].sum())
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local_rows, local_memory),
                self._agent.get_xfer_descs(remote_rows, remote_memory),
                remote,
            )
        except Exception as exc:
            raise _failed("making a NIXL READ", exc) from None
        return Transfer(self._agent, handle, nbytes)


__all__ = ["Agent", "AgentError", "Registration", "Transfer", "TransferState", "nixl_unavailable"]
