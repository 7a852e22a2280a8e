"""Settings an operator gives through the environment: `KVRT_*` variables.

An engine that embeds kvrt passes them on to the constructors, its own arguments first:

    producer = kvrt.blocking.Producer(**kvrt.producer_settings(device="cuda:0"))
    consumer = kvrt.blocking.Consumer(**kvrt.consumer_settings())

`kvrt.compat.vllm.KVLookupBuffer` reads them for what it is not given. A variable that is
set but cannot be used is refused with `InvalidInputError` naming it; one that is unset or
empty leaves the constructor's default.

    variable                  side      argument              example
    KVRT_BIND                 producer  bind                  tcp://0.0.0.0:5555
    KVRT_CONNECT              consumer  connect               tcp://prefill-0:5555,tcp://prefill-1:5555
    KVRT_DEVICE               both      device                cuda:0
    KVRT_BUFFER_BYTES         producer  buffer_bytes          4294967296, or 4GiB, 512MiB
    KVRT_HEARTBEAT_S          both      heartbeat_s           1.0
    KVRT_CONNECT_TIMEOUT_S    consumer  connect_timeout_s     10
    KVRT_TRANSFER_TIMEOUT_S   consumer  transfer_timeout_s    60, or none
    KVRT_ITEM_TTL_S           producer  item_ttl_s            300, or none
    KVRT_TRANSPORT            both      transport             tcp, nccl, gloo, cuda_ipc
    KVRT_NAME                 both      name                  decode-3
    KVRT_CURVE_SECRET_FILE    both      curve (this side's secret certificate file)
    KVRT_CURVE_SERVER_FILE    consumer  curve (the producer's public certificate file)
    KVRT_CURVE_ALLOWED_DIR    producer  curve (the clients' public certificates)
    KVRT_CURVE_PUBLIC_KEY, KVRT_CURVE_SECRET_KEY, KVRT_CURVE_SERVER_KEY, KVRT_CURVE_ALLOWED_KEYS
                              both      curve, as Z85 keys instead of files (`CurveKeys.from_env`)

`KVRT_HEAP_TUNING=0` is read by the first producer or consumer of a process, not passed to a
constructor: it leaves glibc's malloc as it is, for an engine that tunes it itself (see
`kvrt._heap`: by default malloc keeps up to 64 MiB of freed memory warm for the next
received layer).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

from kvrt._auth import CurveKeys
from kvrt._errors import InvalidInputError

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNIT_BYTES: Final = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _text(value: str, name: str) -> str:
    return value


def _seconds(value: str, name: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidInputError(f"{name}={value!r} is not a number of seconds") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InvalidInputError(f"{name}={value!r} must be a positive number of seconds")
    return seconds


def _seconds_or_none(value: str, name: str) -> float | None:
    return None if value.strip().lower() == "none" else _seconds(value, name)


def _bytes(value: str, name: str) -> int:
    """A byte count: digits, optionally with K, M, G or T (binary: 1 KiB is 1024 bytes)."""
    match = _SIZE.match(value)
    if match is None:
        raise InvalidInputError(f"{name}={value!r} is not a byte count (write 4294967296, 4GiB or 512MiB)")
    digits, unit = match.groups()
    return int(digits) * _UNIT_BYTES[(unit or "")[:1].lower()]


def _endpoints(value: str, name: str) -> str | list[str]:
    endpoints = [part.strip() for part in value.split(",") if part.strip()]
    return endpoints[0] if len(endpoints) == 1 else endpoints


_Parse = Callable[[str, str], Any]

_PRODUCER: Final[dict[str, tuple[str, _Parse]]] = {
    "KVRT_BIND": ("bind", _text),
    "KVRT_DEVICE": ("device", _text),
    "KVRT_BUFFER_BYTES": ("buffer_bytes", _bytes),
    "KVRT_HEARTBEAT_S": ("heartbeat_s", _seconds),
    "KVRT_ITEM_TTL_S": ("item_ttl_s", _seconds_or_none),
    "KVRT_TRANSPORT": ("transport", _text),
    "KVRT_NAME": ("name", _text),
}
_CONSUMER: Final[dict[str, tuple[str, _Parse]]] = {
    "KVRT_CONNECT": ("connect", _endpoints),
    "KVRT_DEVICE": ("device", _text),
    "KVRT_HEARTBEAT_S": ("heartbeat_s", _seconds),
    "KVRT_CONNECT_TIMEOUT_S": ("connect_timeout_s", _seconds),
    "KVRT_TRANSFER_TIMEOUT_S": ("transfer_timeout_s", _seconds_or_none),
    "KVRT_TRANSPORT": ("transport", _text),
    "KVRT_NAME": ("name", _text),
}


def _variable(name: str) -> str:
    return os.environ.get(name, "").strip()


def _read(table: Mapping[str, tuple[str, _Parse]]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for variable, (argument, parse) in table.items():
        value = _variable(variable)
        if value:
            settings[argument] = parse(value, variable)
    return settings


def _curve(*, server: bool) -> CurveKeys | None:
    secret = _variable("KVRT_CURVE_SECRET_FILE")
    if not secret:
        return CurveKeys.from_env()
    if server:
        return CurveKeys.server(secret, allowed_clients_dir=_variable("KVRT_CURVE_ALLOWED_DIR") or None)
    producer_public = _variable("KVRT_CURVE_SERVER_FILE")
    if not producer_public:
        raise InvalidInputError(
            "KVRT_CURVE_SECRET_FILE is set without KVRT_CURVE_SERVER_FILE: a consumer needs the producer's public "
            "certificate too"
        )
    return CurveKeys.client(secret, server_public_file=producer_public)


def producer_settings(**given: Any) -> dict[str, Any]:
    """`kvrt.Producer` (or `kvrt.blocking.Producer`) arguments from this process's `KVRT_*`
    variables, with the `given` arguments over them."""
    settings = _read(_PRODUCER)
    curve = _curve(server=True)
    if curve is not None:
        settings["curve"] = curve
    return {**settings, **given}


def consumer_settings(**given: Any) -> dict[str, Any]:
    """`kvrt.Consumer` (or `kvrt.blocking.Consumer`) arguments from this process's `KVRT_*`
    variables, with the `given` arguments over them."""
    settings = _read(_CONSUMER)
    curve = _curve(server=False)
    if curve is not None:
        settings["curve"] = curve
    return {**settings, **given}
