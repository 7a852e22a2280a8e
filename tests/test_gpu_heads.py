"""Prefill and decode at different TP sizes on one GPU: every process on cuda:0, the pieces
over cuda_ipc (decode ranks agreeing through a gloo group), each rank's bytes the reference
slice of the full KV. The scenarios of tests/test_heterogeneous_tp.py, on the GPU path: the
producer cuts a piece with a device copy after the item's writes, in registered memory.

Skipped without CUDA; one GPU will do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from tests._gpus import one_gpu
from tests._tp_ranks import Run, Scenario, run_world
from tests.test_heterogeneous_tp import SCENARIOS, WORLD

pytestmark = [one_gpu, pytest.mark.timeout(300, method="thread")]

GPU_SCENARIOS = [
    dataclasses.replace(s, name=s.name.replace(", over gloo", ""), transport="cuda_ipc", device="cuda:0")
    for s in SCENARIOS
]


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    yield from run_world(GPU_SCENARIOS, WORLD)


@pytest.mark.parametrize("scenario", [s for s in GPU_SCENARIOS if s.late_rank is None], ids=lambda s: s.name)
def test_every_decode_rank_gets_exactly_its_heads_over_cuda_ipc(run: Run, scenario: Scenario) -> None:
    for rank in range(scenario.decode):
        outcome = run.reports[(scenario.name, rank, "first")]
        assert outcome[:2] == ("item", True), f"rank {rank}: {outcome}"
    for producer in run.producers[scenario.name]:
        stats = producer.stats()
        assert stats.items == 0 and stats.in_flight == 0 and stats.buffer_bytes == 0  # every piece confirmed


def test_a_missing_piece_over_cuda_ipc_fails_every_ranks_call_and_loses_nothing(run: Run) -> None:
    late = next(s for s in GPU_SCENARIOS if s.late_rank is not None)
    assert all(run.reports[(late.name, rank, "first")] == ("miss",) for rank in range(late.decode))
    assert run.before_late_insert == [1, 1, 1, 0]
    assert all(run.reports[(late.name, rank, "after")][:2] == ("item", True) for rank in range(late.decode))
