"""The producer's timers: one heap of what falls due (a silent peer's lease, a waiting
request's timeout, an item's time to live), read by `ProducerCore.expire`."""

from __future__ import annotations

import enum
import heapq
import itertools
import weakref
from collections.abc import Iterator


class TimerKind(enum.IntEnum):
    PEER = 0
    """Key: the peer's identity; due when its lease may have ended (checked then)."""
    WAITER = 1
    """Key: (peer, request id) of a waiting request with a timeout."""
    ITEM = 2
    """Key: the `BufferedItem` whose time to live may have run out, held weakly (see `Timers`)."""


class Timers:
    """Deadlines by time. A timer is never cancelled: what it names is checked when it falls due.

    An item's timer holds its record weakly: a record that nothing else holds was retired (taken,
    dropped, expired), and the item's bytes, kept as long as its record lives, go with it then,
    not minutes later with its time to live (a served prefill publishes every few milliseconds).
    Such a timer falls due silently."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, TimerKind, int, object]] = []
        self._order = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._heap)

    @property
    def first(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def add(self, when: float, kind: TimerKind, key: object) -> None:
        held = weakref.ref(key) if kind is TimerKind.ITEM else key
        heapq.heappush(self._heap, (when, kind, next(self._order), held))

    def due(self, now: float) -> Iterator[tuple[TimerKind, object]]:
        """Pop the timers due by `now`, earliest first (those added meanwhile too, if due)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, kind, _, held = heapq.heappop(heap)
            key = held() if isinstance(held, weakref.ref) else held
            if key is not None:
                yield kind, key

    def clear(self) -> None:
        self._heap.clear()
