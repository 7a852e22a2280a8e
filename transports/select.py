"""Which transports a producer or consumer offers, in preference order, and building them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrt._errors import InvalidInputError
from kvrt.transports._base import Receiver, Sender
from kvrt.transports._nixl_agent import nixl_unavailable
from kvrt.transports.cuda_ipc import CudaIpcReceiver, CudaIpcSender, ipc_unavailable
from kvrt.transports.nixl import NixlReceiver, NixlSender
from kvrt.transports.paired import PairedReceiver, PairedSender
from kvrt.transports.tcp import TcpReceiver, TcpSender

TRANSPORT_NAMES = ("tcp", "nccl", "gloo", "cuda_ipc", "nixl")
SAME_HOST_ONLY = frozenset({"cuda_ipc"})
"""Transports a producer chooses only for a consumer on its own machine."""


def transport_preference(forced: str | None, device: torch.device) -> tuple[str, ...]:
    """`forced` alone if given (checked against `device`); else, on a CUDA device, CUDA IPC
    first (chosen only on one machine), then NCCL where torch has it; TCP always, as the
    fallback every peer speaks. NIXL is chosen only when forced (`transport="nixl"`): its
    agent's set-up (~0.4 s, a UCX context per process) would be paid by every producer and
    consumer, and on a GPU its registered memory would take the items that cuda_ipc's
    fallback shares per item; it is not measured yet beside the others on a GPU."""
    if forced is not None:
        if forced not in TRANSPORT_NAMES:
            raise InvalidInputError(f"transport must be one of {TRANSPORT_NAMES} or None, got {forced!r}")
        if forced == "nccl" and device.type != "cuda":
            raise InvalidInputError(f"transport='nccl' needs a CUDA device, got device={device}")
        if forced == "gloo" and device.type != "cpu":
            raise InvalidInputError(f"transport='gloo' moves CPU tensors, got device={device}")
        if forced == "cuda_ipc" and (reason := ipc_unavailable(device)) is not None:
            raise InvalidInputError(f"transport='cuda_ipc' cannot run here: {reason}")
        if forced == "nixl" and (reason := nixl_unavailable()) is not None:
            raise InvalidInputError(f"transport='nixl' cannot run here: {reason}")
        return (forced,)
    preferred: list[str] = []
    if device.type == "cuda":
        if ipc_unavailable(device) is None:
            preferred.append("cuda_ipc")
        if torch.distributed.is_nccl_available():
            preferred.append("nccl")
    return (*preferred, "tcp")


def producer_transports(forced: str | None, device: torch.device) -> tuple[str, ...]:
    """What a producer sends with, preferred first: `transport_preference`'s, and TCP behind a
    forced NIXL. NIXL is a faster path for the consumers that ask for it, not a gate: the
    clients that take no items and speak TCP (a router's probes, a decode's lookups, `kvrt`
    commands) are still answered, and consumers that did not ask for NIXL take items over TCP."""
    names = transport_preference(forced, device)
    return (*names, "tcp") if names == ("nixl",) else names


def make_senders(
    names: tuple[str, ...], device: torch.device, *, store_host: str, registered_bytes: int = 0,
    takes_frames: Callable[[bytes], bool] | None = None,
) -> dict[str, Sender]:  # fmt: skip
    """The producer's halves of the transports `names`, by name (`store_host`: where consumers
    reach the rendezvous of a paired transport; `registered_bytes`: the most memory cuda_ipc
    or nixl keeps registered for items; `takes_frames`: whether a consumer takes a TCP payload
    in several frames, see `TcpSender`)."""
    senders: dict[str, Sender] = {}
    for name in names:
        if name == "tcp":
            senders[name] = TcpSender(device, takes_frames)
        elif name == "cuda_ipc":
            senders[name] = CudaIpcSender(device, registered_bytes)
        elif name == "nixl":
            senders[name] = NixlSender(device, registered_bytes)
        else:
            senders[name] = PairedSender(name, device, store_host=store_host)
    return senders


def make_receivers(names: tuple[str, ...], device: torch.device) -> dict[str, Receiver]:
    """The consumer's halves of the transports `names`, by name."""
    receivers: dict[str, Receiver] = {}
    for name in names:
        if name == "tcp":
            receivers[name] = TcpReceiver(device)
        elif name == "cuda_ipc":
            receivers[name] = CudaIpcReceiver(device)
        elif name == "nixl":
            receivers[name] = NixlReceiver(device)
        else:
            receivers[name] = PairedReceiver(name, device)
    return receivers
