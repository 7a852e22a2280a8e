"""A decode TP group of 4 real processes (gloo): every rank returns the same outcome."""

from __future__ import annotations

import multiprocessing
import queue
import socket
from collections import defaultdict
from typing import Any

import pytest

from tests._consensus_ranks import RANDOM_ROUNDS, run_rank

WORLD = 4


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def seen() -> dict[str, dict[int, Any]]:
    """scenario → rank → what that rank reported, from one run of the 4-process group."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    port = free_port()
    ranks = [spawn.Process(target=run_rank, args=(rank, WORLD, port, results)) for rank in range(WORLD)]
    for process in ranks:
        process.start()
    reports: dict[str, dict[int, Any]] = defaultdict(dict)
    try:
        expected = WORLD * 4
        for _ in range(expected):
            rank, scenario, report = results.get(timeout=180)
            assert scenario != "crashed", f"rank {rank} crashed: {report}"
            reports[scenario][rank] = report
    except queue.Empty:
        pytest.fail(f"the group stopped reporting; got {dict(reports)}")
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
    return reports


@pytest.mark.timeout(240)
def test_ranks_with_different_prefixes_agree_on_the_shortest_and_cut_their_items(
    seen: dict[str, dict[int, Any]],
) -> None:
    assert set(seen["different_prefix"].values()) == {("item", 8, 8, 8, 8)}


@pytest.mark.timeout(240)
def test_a_rank_missing_the_item_makes_it_a_miss_everywhere_and_nothing_is_lost(
    seen: dict[str, dict[int, Any]],
) -> None:
    for rank, (outcome, items_left) in seen["one_missing"].items():
        assert outcome == ("miss",)
        assert items_left == (0 if rank == 2 else 1)  # the others' items went back to their producers


@pytest.mark.timeout(240)
def test_random_rounds_with_lookups_in_flight_agree_on_every_rank(seen: dict[str, dict[int, Any]]) -> None:
    reports = seen["random_rounds"]
    for matched, expected in reports.values():
        assert len(matched) == RANDOM_ROUNDS
        assert matched == expected


@pytest.mark.timeout(240)
def test_a_failing_producer_on_one_rank_is_that_error_on_every_rank(seen: dict[str, dict[int, Any]]) -> None:
    reports = seen["producer_failing"]
    for rank, (kind, error_type, message) in reports.items():
        assert (kind, error_type) == ("error", "PeerLostError")
        if rank == 1:
            assert "closed" in message
        else:
            assert "rank 1" in message
