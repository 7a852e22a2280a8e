"""Prefill and decode at different TP sizes, with real processes: each decode rank (a gloo
rank, spawned) takes its heads of a request from the prefill ranks (producers, here) that hold
them, over TCP or gloo, and every rank's bytes are the reference slice of the full KV.

One world of 8 decode ranks runs every scenario (a scenario of D ranks uses ranks 0..D-1), so
the processes start once.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import queue
import socket
from collections.abc import Iterator
from typing import Any

import pytest

import kvrt
import kvrt.blocking
from tests._tp_ranks import Scenario, shard, tokens

WORLD = 8

SCENARIOS = [
    Scenario("TP=2 -> TP=4, 8 KV heads", kv_heads=8, prefill=2, decode=4, seed=1),
    Scenario("TP=4 -> TP=2, 8 KV heads, over gloo", kv_heads=8, prefill=4, decode=2, seed=2, transport="gloo"),
    Scenario("TP=1 -> TP=8, 8 KV heads", kv_heads=8, prefill=1, decode=8, seed=3),
    Scenario("TP=1 -> TP=8, 2 KV heads (replicated)", kv_heads=2, prefill=1, decode=8, seed=4),
    Scenario("MLA, TP=2 -> TP=4", kv_heads=0, prefill=2, decode=4, seed=5),
    Scenario("TP=4 -> TP=2, one prefill rank late", kv_heads=8, prefill=4, decode=2, seed=6, late_rank=3),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclasses.dataclass
class Run:
    producers: dict[str, list[kvrt.blocking.Producer]]
    reports: dict[tuple[str, int, str], tuple[Any, ...]]
    before_late_insert: list[int]
    """The late scenario's producers' stats once every rank had missed."""


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    producers: dict[str, list[kvrt.blocking.Producer]] = {}
    scenarios = []
    for scenario in SCENARIOS:
        ranks = []
        for prefill_rank in range(scenario.prefill):
            held = scenario.prefill_heads(prefill_rank)
            producer = kvrt.blocking.Producer(
                transport=None if scenario.transport == "tcp" else scenario.transport,
                heads=None if held is None else slice(*held),
            )
            if prefill_rank != scenario.late_rank:
                producer.insert(tokens(), None, *shard(scenario, prefill_rank))
            ranks.append(producer)
        producers[scenario.name] = ranks
        scenarios.append(dataclasses.replace(scenario, endpoints=tuple(p.endpoint for p in ranks)))
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    inserted = spawn.Event()
    port = free_port()
    from tests._tp_ranks import run_rank

    processes = [
        spawn.Process(target=run_rank, args=(rank, WORLD, port, scenarios, results, inserted)) for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    reports: dict[tuple[str, int, str], tuple[Any, ...]] = {}
    before: list[int] = []
    expected = sum(s.decode * (1 if s.late_rank is None else 2) for s in SCENARIOS)
    late = next(s for s in SCENARIOS if s.late_rank is not None)
    try:
        while len(reports) < expected:
            try:
                report = results.get(timeout=120)
            except queue.Empty:
                pytest.fail(f"the decode ranks reported {len(reports)} of {expected} results in time")
            if report[0] == "failed":
                pytest.fail(f"decode rank {report[1]} failed: {report[2]}: {report[3]}")
            name, rank, phase, outcome = report
            reports[(name, rank, phase)] = outcome
            if name == late.name and sum(1 for key in reports if key[0] == name) == late.decode:
                # Every rank missed: what the others hold is still there, whole.
                before = [p.stats().items for p in producers[name]]
                producers[name][late.late_rank].insert(tokens(), None, *shard(late, late.late_rank))  # type: ignore[index]
                inserted.set()
        for process in processes:
            process.join(60)
        yield Run(producers, reports, before)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for ranks in producers.values():
            for producer in ranks:
                producer.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.late_rank is None], ids=lambda s: s.name)
def test_every_decode_rank_gets_exactly_its_heads_and_every_producer_is_emptied(run: Run, scenario: Scenario) -> None:
    for rank in range(scenario.decode):
        outcome = run.reports[(scenario.name, rank, "first")]
        assert outcome[:2] == ("item", True), f"rank {rank}: {outcome}"
    for producer in run.producers[scenario.name]:
        stats = producer.stats()
        assert stats.items == 0 and stats.buffer_bytes == 0 and stats.in_flight == 0  # every piece confirmed


@pytest.mark.timeout(300)
def test_each_rank_is_sent_its_heads_not_the_whole_item(run: Run) -> None:
    """TP=1 -> TP=8: the producer sends each rank an eighth of the KV (with the tokens and the
    hidden states), not the whole item."""
    scenario = SCENARIOS[2]
    key, value, hidden = shard(scenario, 0)
    kv = key.nbytes + value.nbytes
    assert {run.reports[(scenario.name, rank, "first")][2] for rank in range(8)} == {kv // 8}
    (producer,) = run.producers[scenario.name]
    delivered = producer.stats().totals.delivered_bytes
    alongside = tokens().nbytes + hidden.nbytes + 1024  # tokens, hidden states, alignment
    assert kv <= delivered <= kv + 8 * alongside < 8 * (kv + hidden.nbytes)


@pytest.mark.timeout(300)
def test_a_missing_piece_fails_every_ranks_call_and_loses_nothing(run: Run) -> None:
    late = next(s for s in SCENARIOS if s.late_rank is not None)
    for rank in range(late.decode):
        assert run.reports[(late.name, rank, "first")] == ("miss",)  # the group agreed: a miss everywhere
    assert run.before_late_insert == [1, 1, 1, 0]  # the others' pieces went back
    for rank in range(late.decode):
        assert run.reports[(late.name, rank, "after")][:2] == ("item", True)
    for producer in run.producers[late.name]:
        assert producer.stats().items == 0
