"""The producer's timers: one heap of what falls due (a silent peer's lease, a waiting
request's timeout, an item's time to live), read by `ProducerCore.expire`."""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterator


class TimerKind(enum.IntEnum):
    PEER = 0
    """Key: the peer's identity; due when its lease may have ended (checked then)."""
    WAITER = 1
    """Key: (peer, request id) of a waiting request with a timeout."""
    ITEM = 2
    """Key: the `BufferedItem` whose time to live may have run out."""


class Timers:
    """Deadlines by time. A timer is never cancelled: what it names is checked when it falls due."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, TimerKind, int, object]] = []
        self._order = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._heap)

    @property
    def first(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def add(self, when: float, kind: TimerKind, key: object) -> None:
        heapq.heappush(self._heap, (when, kind, next(self._order), key))

    def due(self, now: float) -> Iterator[tuple[TimerKind, object]]:
        """Pop the timers due by `now`, earliest first (those added meanwhile too, if due)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, kind, _, key = heapq.heappop(heap)
            yield kind, key

    def clear(self) -> None:
        self._heap.clear()
