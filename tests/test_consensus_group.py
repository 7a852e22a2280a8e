"""A decode TP group of 4 real processes (gloo): every rank returns the same outcome.

The same scenarios run over NCCL: on two GPUs, and in a group of one rank on one GPU (the
consensus's NCCL path, its stream and its waiting thread, on a host with one GPU)."""

from __future__ import annotations

import multiprocessing
import queue
import socket
from collections import defaultdict
from typing import Any

import pytest

from tests._consensus_ranks import RANDOM_ROUNDS, failing_rank, missing_rank, run_rank

WORLD = 4
SCENARIOS = ("different_prefix", "pull", "one_missing", "batch", "into", "random_rounds", "producer_failing")
"""What every rank of `tests._consensus_ranks.scenarios` reports, in order."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def run_group(world: int, backend: str) -> dict[str, dict[int, Any]]:
    """scenario → rank → what that rank reported, from one run of a `world`-process group."""
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    port = free_port()
    ranks = [spawn.Process(target=run_rank, args=(rank, world, port, results, backend)) for rank in range(world)]
    for process in ranks:
        process.start()
    reports: dict[str, dict[int, Any]] = defaultdict(dict)
    try:
        for _ in range(world * len(SCENARIOS)):
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
    every_rank = tuple(range(world))
    assert {scenario: tuple(sorted(reports[scenario])) for scenario in SCENARIOS} == dict.fromkeys(
        SCENARIOS, every_rank
    )
    return reports


@pytest.fixture(scope="module")
def seen() -> dict[str, dict[int, Any]]:
    return run_group(WORLD, "gloo")


def check_different_prefixes(seen: dict[str, dict[int, Any]]) -> None:
    assert set(seen["different_prefix"].values()) == {("item", 8, 8, 8, 8)}


def check_pull(seen: dict[str, dict[int, Any]]) -> None:
    for rank, (outcome, written, values, items_left) in seen["pull"].items():
        assert outcome == ("item", 8, 8, 8, 8)
        assert written == list(range(8))  # the agreed tokens' slots, and no other
        assert values == [float(rank)]  # K and V rows, from this rank's own item
        assert items_left == 0  # taken, as agreed


def check_one_missing(seen: dict[str, dict[int, Any]], world: int) -> None:
    for rank, (outcome, items_left) in seen["one_missing"].items():
        assert outcome == ("miss",)
        assert items_left == (0 if rank == missing_rank(world) else 1)  # the others' items went back


def check_batch(seen: dict[str, dict[int, Any]], world: int) -> None:
    for rank, (outcomes, items_left, rounds) in seen["batch"].items():
        # The shortest prefix of the second query, 4 tokens, cut; the second batch misses.
        assert outcomes == [("miss",), ("item", 4, 4, 4, 4), ("miss",), ("miss",), ("miss",), ("miss",)]
        before = seen["one_missing"][rank][1]  # what the scenario before left in the buffer
        assert items_left == before + (0 if rank == missing_rank(world) else 1)  # the first query's items went back
        # Agreed together: the first batch after single lookups takes two rounds (the first
        # tells every rank the batch's size), the next one round; one after the other, three.
        assert rounds == [2, 1]


def check_into(seen: dict[str, dict[int, Any]], world: int) -> None:
    for rank, (item, landed, values, missed, untouched, batched, batch_landed, items_left) in seen["into"].items():
        assert item == ("item", 8, 8, 8, 8) and landed  # the agreed 8 tokens, in the rank's buffers
        assert values == sorted({-1.0, float(rank)})  # its own item's rows, the rest untouched
        assert missed and untouched  # the group missed: nothing written, though this rank had an item
        assert batched == ("item", 6, 6, 6, 6) and batch_landed
        before = seen["batch"][rank][1]
        assert items_left == before + (0 if rank == missing_rank(world) else 1)  # the missed items went back


def check_random_rounds(seen: dict[str, dict[int, Any]]) -> None:
    for matched, expected in seen["random_rounds"].values():
        assert len(matched) == RANDOM_ROUNDS
        assert matched == expected


def check_producer_failing(seen: dict[str, dict[int, Any]], world: int) -> None:
    failing = failing_rank(world)
    for rank, (*lookups, items_left) in seen["producer_failing"].items():
        assert len(lookups) == 2  # a drop_select, then a drop_select_many
        for kind, error_type, message in lookups:
            assert (kind, error_type) == ("error", "PeerLostError")
            assert ("closed" if rank == failing else f"rank {failing}") in message
        assert items_left == (None if rank == failing else 0)  # each failed lookup gave its item back


def check_every_scenario(seen: dict[str, dict[int, Any]], world: int) -> None:
    """Every check above, for a group that ran once (the NCCL groups: one test each)."""
    check_different_prefixes(seen)
    check_pull(seen)
    check_one_missing(seen, world)
    check_batch(seen, world)
    check_into(seen, world)
    check_random_rounds(seen)
    check_producer_failing(seen, world)


@pytest.mark.timeout(240)
def test_ranks_with_different_prefixes_agree_on_the_shortest_and_cut_their_items(
    seen: dict[str, dict[int, Any]],
) -> None:
    check_different_prefixes(seen)


def test_a_pull_writes_only_the_agreed_tokens_on_every_rank(seen: dict[str, dict[int, Any]]) -> None:
    check_pull(seen)


@pytest.mark.timeout(240)
def test_a_rank_missing_the_item_makes_it_a_miss_everywhere_and_nothing_is_lost(
    seen: dict[str, dict[int, Any]],
) -> None:
    check_one_missing(seen, WORLD)


@pytest.mark.timeout(240)
def test_a_batch_of_lookups_is_agreed_together_in_one_round_on_every_rank(seen: dict[str, dict[int, Any]]) -> None:
    check_batch(seen, WORLD)


@pytest.mark.timeout(240)
def test_in_a_group_the_agreed_item_lands_in_each_ranks_buffers_and_a_group_miss_writes_none(
    seen: dict[str, dict[int, Any]],
) -> None:
    check_into(seen, WORLD)


@pytest.mark.timeout(240)
def test_random_rounds_with_lookups_in_flight_agree_on_every_rank(seen: dict[str, dict[int, Any]]) -> None:
    check_random_rounds(seen)


@pytest.mark.timeout(240)
def test_a_failing_producer_on_one_rank_is_that_error_on_every_rank(seen: dict[str, dict[int, Any]]) -> None:
    check_producer_failing(seen, WORLD)


@pytest.mark.gpu(count=2)
@pytest.mark.timeout(240)
def test_a_two_gpu_group_agrees_over_nccl_in_every_scenario() -> None:
    check_every_scenario(run_group(2, "nccl"), 2)


@pytest.mark.gpu(count=1)
@pytest.mark.timeout(240)
def test_a_one_gpu_group_runs_every_scenario_over_nccl() -> None:
    # One rank: every agreement is its own outcome, through the NCCL path (the consensus
    # tensor on the GPU, its stream, the thread that waits for it) and the same checks.
    check_every_scenario(run_group(1, "nccl"), 1)


@pytest.mark.timeout(120)
def test_a_rank_that_dies_fails_the_others_lookups_instead_of_hanging() -> None:
    from tests._consensus_ranks import run_rank_that_loses_its_peer

    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    port = free_port()
    ranks = [spawn.Process(target=run_rank_that_loses_its_peer, args=(rank, port, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        first, first_s, second, second_s = results.get(timeout=60)
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert first[:2] == ("error", "PeerLostError") and "TP group" in first[2]
    assert first_s < 30  # the group's timeout (3 s) or gloo's own detection, not for ever
    assert second[:2] == ("error", "PeerLostError")  # the group is broken: at once, no new collective
    assert second_s - first_s < 1


@pytest.mark.timeout(120)
def test_a_round_with_a_status_this_version_does_not_know_fails_the_lookup_instead_of_hanging() -> None:
    from tests._consensus_ranks import run_rank_that_reads_an_unknown_status

    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    process = spawn.Process(target=run_rank_that_reads_an_unknown_status, args=(free_port(), results))
    process.start()
    try:
        outcome = results.get(timeout=60)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    assert outcome[:2] == ("error", "PeerLostError") and "99 is not a valid Status" in outcome[2]


def lookups_and_rounds_of_16_callers(backend: str) -> tuple[Any, Any]:
    """50 lookups each of 16 concurrent callers in a one-rank group: (lookups, rounds)."""
    from tests._consensus_ranks import run_rank_with_callers

    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    process = spawn.Process(target=run_rank_with_callers, args=(free_port(), 16, 50, results, backend))
    process.start()
    try:
        lookups, rounds = results.get(timeout=90)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    return lookups, rounds


@pytest.mark.timeout(120)
def test_callers_that_start_their_next_lookup_at_once_share_one_round_per_wave() -> None:
    # Each round wakes the 16 callers, and each caller's next lookup joins the next round:
    # one round per 16 lookups, not two (a round that leaves before the last caller records).
    assert lookups_and_rounds_of_16_callers("gloo") == (800, 50)


@pytest.mark.gpu(count=1)
@pytest.mark.timeout(150)
def test_over_nccl_too_callers_share_one_round_per_wave() -> None:
    # NCCL's round ends on a kvrt thread that waits for the consensus stream, not on gloo's:
    # the next round still waits for the callers that round woke.
    assert lookups_and_rounds_of_16_callers("nccl") == (800, 50)
