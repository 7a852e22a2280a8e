"""Checks of the values a caller passes to kvrt's constructors and calls, against what the
protocol can carry: a value that passes here never makes a message fail to encode later, and
one that does not is refused at the call that got it, naming the argument (a device that this
process cannot use: `kvrt._devices.usable_device`)."""

from __future__ import annotations

import math
import re
from typing import Final

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
