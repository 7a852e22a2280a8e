"""The consensus bookkeeping, with the collective played in memory by an elementwise MIN."""

from __future__ import annotations

import random

import pytest
import torch

import kvrt
from kvrt._consensus import MAX_MATCHED_TOKENS, ROWS, ConsensusWindow, Decision, Outcome, Status, error_for, status_of
from kvrt._item import KVItem, truncate


def all_reduce_min(windows: list[ConsensusWindow]) -> list[dict[int, Decision]]:
    """One round: every rank's values, reduced elementwise by MIN, applied on every rank."""
    contributions = [window.values_to_reduce() for window in windows]
    reduced = [min(values) for values in zip(*contributions, strict=True)]
    return [window.apply(reduced) for window in windows]


def group(size: int) -> list[ConsensusWindow]:
    return [ConsensusWindow(rank=rank, world_size=size) for rank in range(size)]


def one_lookup(outcomes: list[Outcome]) -> list[dict[int, Decision]]:
    """One lookup, rank r seeing outcomes[r], and one round: what each rank decided."""
    windows = group(len(outcomes))
    for window, outcome in zip(windows, outcomes, strict=True):
        window.record(window.register(), outcome)
    return all_reduce_min(windows)


def test_the_group_takes_the_shortest_match_in_tokens() -> None:
    decisions = one_lookup([Outcome(Status.OK, matched) for matched in [40, 17, 33]])
    assert decisions == [{0: Decision(Status.OK, 17, rank=-1)}] * 3


def test_a_miss_on_one_rank_is_a_miss_on_all_and_names_the_rank() -> None:
    outcomes = [Outcome(Status.MISS) if rank == 2 else Outcome(Status.OK, 10) for rank in range(4)]
    assert one_lookup(outcomes) == [{0: Decision(Status.MISS, 0, 2)}] * 4


def test_the_worst_status_wins_over_a_miss() -> None:
    outcomes = [Outcome(Status.MISS), Outcome(Status.PEER_LOST), Outcome(Status.OK, 5)]
    assert one_lookup(outcomes) == [{0: Decision(Status.PEER_LOST, 0, 1)}] * 3


def test_a_round_decides_only_lookups_every_rank_has_finished() -> None:
    windows = group(2)
    for window in windows:
        window.register()
        window.register()
        window.record(0, Outcome(Status.OK, 3))
    windows[0].record(1, Outcome(Status.OK, 4))
    decisions = all_reduce_min(windows)
    assert [sorted(d) for d in decisions] == [[0], [0]]
    assert [window.start for window in windows] == [1, 1]
    windows[1].record(1, Outcome(Status.OK, 9))
    assert [d[1].matched_tokens for d in all_reduce_min(windows)] == [4, 4]


def test_lookups_in_flight_together_share_one_round_once_the_window_has_grown() -> None:
    windows = group(4)
    for window in windows:
        for sequence in range(17):
            window.register()
            window.record(sequence, Outcome(Status.OK, 1 + sequence))
    first = all_reduce_min(windows)
    assert all(sorted(d) == [0] for d in first)  # the first round is one lookup wide...
    assert [window.rows for window in windows] == [17] * 4  # ...and learns that 17 are waiting
    assert all(sorted(d) == list(range(1, 17)) for d in all_reduce_min(windows))


def test_waves_of_concurrent_lookups_take_one_round_each_once_the_window_knows_them() -> None:
    windows = group(4)
    rounds_per_wave = []
    for wave in range(6):
        for window in windows:
            for _ in range(16):
                window.record(window.register(), Outcome(Status.OK, 3))
        rounds = 0
        while windows[0].start < 16 * (wave + 1):
            all_reduce_min(windows)
            rounds += 1
        rounds_per_wave.append(rounds)
    assert rounds_per_wave[2:] == [1, 1, 1, 1]


def test_one_lookup_at_a_time_costs_a_one_value_collective() -> None:
    windows = group(4)
    for _ in range(3):
        for window in windows:
            window.record(window.register(), Outcome(Status.OK, 5))
        assert all(len(window.values_to_reduce()) == 1 for window in windows)
        all_reduce_min(windows)


def test_a_failed_rank_decides_the_lookup_whatever_the_others_matched() -> None:
    outcomes = [
        Outcome(Status.OK, 0),
        Outcome(Status.TIMEOUT),
        Outcome(Status.OK, MAX_MATCHED_TOKENS),
        Outcome(Status.MISS),
    ]
    assert one_lookup(outcomes) == [{0: Decision(Status.TIMEOUT, 0, 1)}] * 4


def test_the_longest_match_a_value_can_carry_survives_the_round_and_a_longer_one_is_refused() -> None:
    windows = group(2)
    for window in windows:
        window.record(window.register(), Outcome(Status.OK, MAX_MATCHED_TOKENS))
    assert all(decisions[0] == Decision(Status.OK, MAX_MATCHED_TOKENS, -1) for decisions in all_reduce_min(windows))
    with pytest.raises(ValueError, match="matched_tokens"):
        Outcome(Status.OK, MAX_MATCHED_TOKENS + 1)


def test_random_finishing_orders_give_every_rank_the_same_decisions() -> None:
    rng = random.Random(7)
    size, lookups = 4, 300
    windows = group(size)
    for window in windows:
        for _ in range(lookups):
            window.register()
    truth = [[rng.choice([Outcome(Status.OK, rng.randrange(1, 99)), Outcome(Status.MISS)]) for _ in range(size)]
             for _ in range(lookups)]  # fmt: skip
    pending = [list(range(lookups)) for _ in range(size)]
    for order in pending:
        rng.shuffle(order)
    decided: list[dict[int, Decision]] = [{} for _ in range(size)]
    rounds = 0
    while any(window.start < lookups for window in windows):
        for rank, window in enumerate(windows):
            for _ in range(rng.randrange(0, 6)):
                if pending[rank]:
                    sequence = pending[rank].pop()
                    window.record(sequence, truth[sequence][rank])
        if all(window.start_is_ready for window in windows):
            rounds += 1
            for rank, decisions in enumerate(all_reduce_min(windows)):
                decided[rank].update(decisions)
    assert all(decisions == decided[0] for decisions in decided)
    for sequence in range(lookups):
        statuses = [outcome.status for outcome in truth[sequence]]
        expected_status = max(statuses)
        assert decided[0][sequence].status is expected_status
        if expected_status is Status.OK:
            assert decided[0][sequence].matched_tokens == min(o.matched_tokens for o in truth[sequence])
    assert rounds < lookups  # rounds were shared


def test_the_window_is_bounded_in_rows() -> None:
    windows = group(2)
    for window in windows:
        for _ in range(10 * ROWS):
            window.record(window.register(), Outcome(Status.MISS))
    all_reduce_min(windows)
    assert all(window.rows == ROWS and len(window.values_to_reduce()) == ROWS for window in windows)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (kvrt.PeerLostError("gone"), Status.PEER_LOST),
        (kvrt.KVRTTimeoutError("late", phase="connect"), Status.TIMEOUT),
        (kvrt.ClosedError("closed"), Status.CLOSED),
        (kvrt.RemoteProtocolError("bad"), Status.FAILED),
    ],
)
def test_errors_map_to_status_codes(error: kvrt.KVRTError, status: Status) -> None:
    assert status_of(error) is status


def test_the_rank_that_failed_raises_its_own_error_and_the_others_name_it() -> None:
    own = kvrt.PeerLostError("producer at tcp://x did not answer")
    decision = Decision(Status.PEER_LOST, 0, 3)
    assert error_for(decision, Outcome(Status.PEER_LOST), own) is own
    other = error_for(decision, Outcome(Status.OK, 4), None)
    assert isinstance(other, kvrt.PeerLostError) and "rank 3" in str(other)


def test_an_item_is_cut_to_the_agreed_masked_tokens_along_every_token_axis() -> None:
    roi = torch.tensor([True, False, True, True, False, True])
    item = KVItem(torch.arange(6), roi, torch.zeros(2, 6, 1, 1), torch.zeros(2, 6, 1, 1), torch.zeros(6, 3), 4)
    cut = truncate(item, 2)
    assert cut.input_tokens.tolist() == [0, 1, 2] and cut.roi is not None and cut.roi.tolist() == [True, False, True]
    assert cut.key.shape[1] == cut.value.shape[1] == 3 and cut.hidden is not None and cut.hidden.shape[0] == 3
    assert cut.matched == 2
