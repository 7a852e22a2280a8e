"""Prefill and decode at different TP sizes, with real processes: each decode rank (a gloo
rank, spawned) takes its heads of a request from the prefill ranks (producers, here) that hold
them, over TCP or gloo, and every rank's bytes are the reference slice of the full KV.

One world of 8 decode ranks runs every scenario (a scenario of D ranks uses ranks 0..D-1), so
the processes start once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._tp_ranks import Run, Scenario, run_world, shard, tokens

WORLD = 8

SCENARIOS = [
    Scenario("TP=2 -> TP=4, 8 KV heads", kv_heads=8, prefill=2, decode=4, seed=1),
    Scenario("TP=4 -> TP=2, 8 KV heads, over gloo", kv_heads=8, prefill=4, decode=2, seed=2, transport="gloo"),
    Scenario("TP=1 -> TP=8, 8 KV heads", kv_heads=8, prefill=1, decode=8, seed=3),
    Scenario("TP=1 -> TP=8, 2 KV heads (replicated)", kv_heads=2, prefill=1, decode=8, seed=4),
    Scenario("MLA, TP=2 -> TP=4", kv_heads=0, prefill=2, decode=4, seed=5),
    Scenario("TP=4 -> TP=2, one prefill rank late", kv_heads=8, prefill=4, decode=2, seed=6, late_rank=3),
]


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    yield from run_world(SCENARIOS, WORLD)


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
