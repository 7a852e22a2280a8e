"""The bookkeeping of registered memory (`kvrt.transports._arena.Ranges`): the ranges of one
slab that items take and give back. The slabs themselves and their sharing are GPU tests
(`test_gpu_registered.py`)."""

from __future__ import annotations

import random

import pytest

from kvrt.transports._arena import REGION_ALIGN_BYTES, Ranges

A = REGION_ALIGN_BYTES


def test_ranges_are_taken_first_fit_and_aligned() -> None:
    ranges = Ranges(8 * A)
    assert ranges.take(1) == 0
    assert ranges.take(A + 1) == A  # two alignment units
    assert ranges.take(0) == 3 * A  # an empty item still takes a unit: its address is its own
    assert ranges.used == 4 * A
    assert ranges.free_ranges == [(4 * A, 8 * A)]


def test_a_range_that_does_not_fit_is_refused_and_nothing_changes() -> None:
    ranges = Ranges(4 * A)
    assert ranges.take(3 * A) == 0
    assert ranges.take(2 * A) is None
    assert ranges.free_ranges == [(3 * A, 4 * A)] and ranges.used == 3 * A


def test_ranges_given_back_merge_with_both_neighbours() -> None:
    ranges = Ranges(6 * A)
    starts = [ranges.take(2 * A) for _ in range(3)]
    assert starts == [0, 2 * A, 4 * A] and ranges.free_ranges == []
    ranges.give(0, 2 * A)
    ranges.give(4 * A, 2 * A)
    assert ranges.free_ranges == [(0, 2 * A), (4 * A, 6 * A)]
    ranges.give(2 * A, 2 * A)
    assert ranges.free_ranges == [(0, 6 * A)] and ranges.used == 0
    assert ranges.take(6 * A) == 0  # the whole slab again: nothing lost to fragments


def test_a_range_given_back_twice_is_a_bug_that_is_caught() -> None:
    ranges = Ranges(4 * A)
    start = ranges.take(A)
    assert start is not None
    ranges.give(start, A)
    with pytest.raises(AssertionError, match="free already"):
        ranges.give(start, A)


def test_random_takes_and_gives_never_overlap_and_end_whole() -> None:
    rng = random.Random(7)
    size = 1 << 20
    ranges = Ranges(size)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and (rng.random() < 0.5 or len(live) > 200):
            start = rng.choice(list(live))
            ranges.give(start, live.pop(start))
        else:
            nbytes = rng.randint(1, 20 * A)
            start = ranges.take(nbytes)
            if start is None:
                continue
            end = start + -(-nbytes // A) * A
            assert start >= 0 and end <= size and start % A == 0
            for other, other_bytes in live.items():
                assert end <= other or other + -(-other_bytes // A) * A <= start, "overlapping ranges"
            live[start] = nbytes
        assert ranges.used == sum(max(A, -(-n // A) * A) for n in live.values())
    for start, nbytes in live.items():
        ranges.give(start, nbytes)
    assert ranges.free_ranges == [(0, size)] and ranges.used == 0
