"""How long each side waits for a silent peer: the heartbeat, and the lease it sets."""

from __future__ import annotations

from typing import Final

from kvrt import _messages as m
from kvrt._arguments import seconds
from kvrt._errors import InvalidInputError

HEARTBEAT_MISSES: Final = 10
"""A peer is lost after this many heartbeat periods without a message from it (10 s with the
default heartbeat, as SGLang's disaggregation gives a peer): an engine that holds its loop for
seconds does not trip it. It is also the lease: how long the producer holds what it delivered
to a silent consumer before it may give it to another (see `ProducerCore`)."""

SILENT_HOLD_LEASES: Final = 6
"""A silent consumer whose connection is still up keeps what was delivered to it for this many
leases after its last message, not one. Its process may be stopped (SIGSTOP, a starved host)
right after it handed an item over inside its lease, its receipt still queued in the process:
a whole-process stop stops libzmq's threads too. Given to another consumer meanwhile, that item
would be handed over twice. A consumer whose connection closed (its process died) gives its
items back when its lease ends; one stopped for longer than this gives them back then."""

DEFAULT_HEARTBEAT_S = 1.0
"""Consumers ping at least this often; one silent for `HEARTBEAT_MISSES` periods is dropped."""

MAX_HEARTBEAT_S = 3600.0
"""The longest heartbeat period (libzmq counts its own heartbeats' timeout in ms, up to 6553 s
for the one it sends its peer)."""


def _heartbeat(value: object) -> float:
    heartbeat_s = seconds(value, "heartbeat_s")
    assert heartbeat_s is not None
    if heartbeat_s * HEARTBEAT_MISSES > MAX_HEARTBEAT_S or heartbeat_s < m.MIN_HEARTBEAT_S:
        raise InvalidInputError(
            f"heartbeat_s must be between {m.MIN_HEARTBEAT_S:g} and {MAX_HEARTBEAT_S / HEARTBEAT_MISSES:g} s "
            f"(a peer is lost after {HEARTBEAT_MISSES} of them), got {value!r}"
        )
    return heartbeat_s
