"""Checks of the values a caller passes to kvrt's constructors and calls, against what the
protocol can carry: a value that passes here never makes a message fail to encode later, and
one that does not is refused at the call that got it, naming the argument. A device that
this process cannot use is refused at construction too, naming the fix."""

from __future__ import annotations

import math
import os
import re
from typing import Final

import torch

from kvrt._errors import InvalidInputError
from kvrt._messages import MAX_SECONDS

MAX_BUFFER_BYTES: Final = 2**62
"""The largest buffer a producer may be given (every byte count travels as a 62-bit int)."""

_TCP: Final = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^:/\[\]]*):(?P<port>[^:/]*)$")


def seconds(value: object, name: str, *, none: bool = False, zero: bool = False) -> float | None:
    """`value` as seconds: a finite real number > 0 (>= 0 with `zero`), or None with `none`.
    Booleans, infinities, NaN and more than `MAX_SECONDS` are refused."""
    if value is None and none:
        return None
    number = None if isinstance(value, bool) or not isinstance(value, int | float) else float(value)
    if number is None or not (math.isfinite(number) and (number >= 0 if zero else number > 0)) or number > MAX_SECONDS:
        bound = ">= 0" if zero else "> 0"
        what = "None or a finite number" if none else "a finite number"
        forever = " (None: for ever)" if none else ""
        limit = f"at most {MAX_SECONDS:g}{forever}"
        raise InvalidInputError(f"{name} must be {what} of seconds {bound}, {limit}; got {value!r}")
    return number


def byte_count(value: object, name: str, *, high: int = MAX_BUFFER_BYTES) -> int:
    """`value` as a positive number of bytes, at most `high`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= high:
        raise InvalidInputError(f"{name} must be an int of bytes in 1..{high}, got {value!r}")
    return value


def endpoint(value: object, name: str, *, binding: bool) -> str:
    """A ZeroMQ address. A tcp:// one needs a port in 1..65535 (0 too, to bind: any free
    port); other transports (ipc://, inproc://) are left to ZeroMQ."""
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"{name} must be a ZeroMQ address such as 'tcp://127.0.0.1:5555', got {value!r}")
    if "://" not in value:
        raise InvalidInputError(f"{name} {value!r} has no scheme: write tcp://HOST:PORT")
    if not value.startswith("tcp://"):
        return value
    found = _TCP.match(value)
    if found is None:
        raise InvalidInputError(f"{name} {value!r} is not tcp://HOST:PORT")
    port_text = found.group("port")
    low = 0 if binding else 1
    if port_text == "*" and binding:
        return value
    if not port_text.isdigit() or not low <= int(port_text) <= 65535:
        raise InvalidInputError(f"{name} {value!r}: the port must be a number in {low}..65535, got {port_text!r}")
    return value


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
