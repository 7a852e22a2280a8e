"""Which transports a producer or consumer offers, in preference order, and building them."""

from __future__ import annotations

import torch

from kvrt._errors import InvalidInputError
from kvrt.transports._base import Transport
from kvrt.transports.paired import PairedTransport
from kvrt.transports.tcp import TcpTransport

TRANSPORT_NAMES = ("tcp", "nccl", "gloo")


def transport_preference(forced: str | None, device: torch.device) -> tuple[str, ...]:
    """`forced` alone if given (checked against `device`); else NCCL first on a CUDA device
    where torch has it, and TCP always, as the fallback every peer speaks."""
    if forced is not None:
        if forced not in TRANSPORT_NAMES:
            raise InvalidInputError(f"transport must be one of {TRANSPORT_NAMES} or None, got {forced!r}")
        if forced == "nccl" and device.type != "cuda":
            raise InvalidInputError(f"transport='nccl' needs a CUDA device, got device={device}")
        if forced == "gloo" and device.type != "cpu":
            raise InvalidInputError(f"transport='gloo' moves CPU tensors, got device={device}")
        return (forced,)
    if device.type == "cuda" and torch.distributed.is_nccl_available():
        return ("nccl", "tcp")
    return ("tcp",)


def make_transports(names: tuple[str, ...], device: torch.device, *, store_host: str) -> dict[str, Transport]:
    transports: dict[str, Transport] = {}
    for name in names:
        if name == "tcp":
            transports[name] = TcpTransport(device)
        else:
            transports[name] = PairedTransport(name, device, store_host=store_host)
    return transports
