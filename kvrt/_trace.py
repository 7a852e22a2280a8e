"""Trace events: a supported way to observe what the runtime does, and when, without patching it.

    stamps: list[kvrt.TraceEvent] = []
    with kvrt.tracing(stamps.append):
        ...  # run producers, consumers, TP groups

A callback gets every event emitted while it is installed, synchronously, on the thread that
emits it (the event loop's, for every event below), so it must be quick: note the event and
return. An exception from a callback is logged (logger `kvrt.trace`) and does not reach the
runtime. With no callback installed an event costs one function call and a truth test.

Events (`TraceEvent.name`, then its `fields`):

* `consensus.round_issued` (`rows`: the lookups the round carries): a TP group's
  collective was issued, from the loop;
* `consensus.round_ended` (`rows`): the loop heard that collective's end (before the
  lookups it decided are woken).

The names and fields are part of the public API: events and fields may be added, none is
renamed or removed within a version.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

_log = logging.getLogger("kvrt.trace")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One thing the runtime did: `name` (see the module's list), `at_s` (the host's
    `time.perf_counter()` when it was emitted) and the event's `fields`."""

    name: str
    at_s: float
    fields: Mapping[str, object]


TraceCallback = Callable[[TraceEvent], object]

_callbacks: list[TraceCallback] = []


def add_trace_callback(callback: TraceCallback) -> Callable[[], None]:
    """Call `callback` with every event from now on; returns the function that removes it
    (calling that twice is harmless). Several callbacks may be installed; each gets every event."""
    _callbacks.append(callback)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _callbacks.remove(callback)

    return remove


@contextlib.contextmanager
def tracing(callback: TraceCallback) -> Iterator[None]:
    """`add_trace_callback` for the duration of a `with` block."""
    remove = add_trace_callback(callback)
    try:
        yield
    finally:
        remove()


def emit(name: str, **fields: object) -> None:
    """Hand an event to every installed callback (none installed: nothing happens)."""
    if not _callbacks:
        return
    event = TraceEvent(name, time.perf_counter(), fields)
    for callback in tuple(_callbacks):
        try:
            callback(event)
        except Exception:
            _log.exception("trace callback %r failed on %s", callback, name)
