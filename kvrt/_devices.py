"""What kvrt asks of torch about devices: whether this process can use one (refused at
construction, naming the fix), and the one translation of torch's, NCCL's and CUDA's errors
into kvrt's family (`kvrt._errors`, which imports no torch)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from kvrt._errors import CapacityError, InvalidInputError, KVRTError, PeerLostError


def usable_device(device: torch.device | str | int) -> torch.device:
    """`device` as a torch.device that this process can use: "cpu", or a CUDA device that
    exists here. A CUDA device that cannot work (a torch built without CUDA, no GPU visible,
    an index past the visible ones, CUDA initialized before a fork) is refused now."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidInputError(f"device {device!r} is not a torch device: {exc}") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":
        raise InvalidInputError(f"device {device!r}: kvrt moves tensors on 'cpu' or 'cuda:N' devices")
    reason = _cuda_unusable(parsed)
    if reason is not None:
        raise InvalidInputError(f"device {device!r} cannot be used in this process: {reason}")
    return parsed


def _cuda_unusable(device: torch.device) -> str | None:
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this torch ({torch.__version__}) was built without CUDA; install a CUDA build of torch or use 'cpu'"
    if torch.cuda._is_in_bad_fork():
        return "CUDA was initialized before this process was forked; start it with multiprocessing's 'spawn'"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        return f"no CUDA device is visible to it{where}; check the driver and CUDA_VISIBLE_DEVICES, or use 'cpu'"
    if device.index is not None and device.index >= count:
        return f"it sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    return None


def translate_torch_error(exc: BaseException, *, what: str) -> KVRTError:
    """The one translation of torch, NCCL and CUDA errors into kvrt's family, by type."""
    if isinstance(exc, KVRTError):
        return exc
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return CapacityError(f"{what}: the GPU is out of memory ({exc})")
    if isinstance(exc, dist.DistBackendError | dist.DistNetworkError):
        return PeerLostError(f"{what}: the transfer with the peer failed ({exc})")
    return KVRTError(f"{what}: {type(exc).__name__}: {exc}")
