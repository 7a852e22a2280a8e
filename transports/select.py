"""Which transports a producer or consumer offers, in preference order, and building them."""

from __future__ import annotations

import torch

from kvrt._errors import InvalidInputError
from kvrt.transports._base import Transport
from kvrt.transports.cuda_ipc import CudaIpcTransport, ipc_unavailable
from kvrt.transports.paired import PairedTransport
from kvrt.transports.tcp import TcpTransport

TRANSPORT_NAMES = ("tcp", "nccl", "gloo", "cuda_ipc")
SAME_HOST_ONLY = frozenset({"cuda_ipc"})
"""Transports a producer chooses only for a consumer on its own machine."""


def transport_preference(forced: str | None, device: torch.device) -> tuple[str, ...]:
    """`forced` alone if given (checked against `device`); else, on a CUDA device, CUDA IPC
    first (chosen only on one machine), then NCCL where torch has it; TCP always, as the
    fallback every peer speaks."""
    if forced is not None:
        if forced not in TRANSPORT_NAMES:
            raise InvalidInputError(f"transport must be one of {TRANSPORT_NAMES} or None, got {forced!r}")
        if forced == "nccl" and device.type != "cuda":
            raise InvalidInputError(f"transport='nccl' needs a CUDA device, got device={device}")
        if forced == "gloo" and device.type != "cpu":
            raise InvalidInputError(f"transport='gloo' moves CPU tensors, got device={device}")
        if forced == "cuda_ipc" and (reason := ipc_unavailable(device)) is not None:
            raise InvalidInputError(f"transport='cuda_ipc' cannot run here: {reason}")
        return (forced,)
    preferred: list[str] = []
    if device.type == "cuda":
        if ipc_unavailable(device) is None:
            preferred.append("cuda_ipc")
        if torch.distributed.is_nccl_available():
            preferred.append("nccl")
    return (*preferred, "tcp")


def make_transports(names: tuple[str, ...], device: torch.device, *, store_host: str) -> dict[str, Transport]:
    transports: dict[str, Transport] = {}
    for name in names:
        if name == "tcp":
            transports[name] = TcpTransport(device)
        elif name == "cuda_ipc":
            transports[name] = CudaIpcTransport(device)
        else:
            transports[name] = PairedTransport(name, device, store_host=store_host)
    return transports
