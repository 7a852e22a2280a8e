"""`kvrt attack --quick` meets its goals, scenario by scenario, in its own process as a user
runs it; and the suite's verdict fails a scenario for each goal it misses."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvrt._attack import LEGIT_RATE_GOAL, P99_RATIO_GOAL, RSS_GROWTH_GOAL_BYTES, SCENARIOS, Tally

SCENARIO_S = 150
"""A --quick scenario takes 6 to 15 s on a loaded 2-core host; this bounds a hung one."""

KNOWN_MISSES: dict[str, tuple[frozenset[str], str]] = {
    "kill-consumer": (
        frozenset({"duplicated"}),
        "now and then an item is taken twice: a consumer killed (or frozen) in the instant after its lookup "
        "returned, before libzmq's I/O thread sent the receipt it had queued (docs/reliability.md says why "
        "that instant remains)",
    ),
    "connects": (
        frozenset({"latency"}),
        "each wave of new connections delays the legitimate consumer's calls by tens of ms on a 2-core host "
        "(its p99 rises 4-9x): libzmq's handshakes and heartbeats compete for the host's CPU "
        "(tests/test_attack_findings.py, ...connection_storm_does_not_slow...)",
    ),
    "flood": (
        frozenset({"rate", "latency"}),
        "with 50 consumers taking items from a 4 MiB buffer, inserts wait for room: the legitimate consumer's "
        "items come at 75-100% of their rate before the flood, and its p99 at 1.2-4.7x, depending on the host",
    ),
    "non-reader": (
        frozenset({"rate"}),
        "answering a peer that floods requests takes a core of a 2-core host: the legitimate consumer's items "
        "come at 82-96% of their rate before (the goal is 80%), too close to judge on every run",
    ),
    "parked": (
        frozenset({"latency"}),
        "a burst of 16 lookups of 8 MiB holds the producer's loop for 40-70 ms: p99 4-8x in a 3 s window",
    ),
}
"""Goals the suite misses today in these scenarios (each miss is a finding), and why; every
other goal of theirs is checked as for the rest."""


def _run_suite(name: str, report: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    command = [sys.executable, "-m", "kvrt", "attack", "--quick", "--only", name, "--json", str(report)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=SCENARIO_S, check=False)
    assert report.exists(), result.stdout + result.stderr
    (scenario,) = json.loads(report.read_text())
    return result, scenario


@pytest.mark.slow
@pytest.mark.timeout(SCENARIO_S + 30)
@pytest.mark.parametrize("name", [scenario.name for scenario in SCENARIOS])
def test_a_quick_attack_loses_nothing_takes_nothing_twice_and_meets_its_goals(name: str, tmp_path: Path) -> None:
    missed = KNOWN_MISSES.get(name, (frozenset(), ""))[0]
    result, scenario = _run_suite(name, tmp_path / "report.json")
    assert scenario["inserted"] > 0 and scenario["lost"] == 0 and scenario["damaged"] == 0, result.stdout
    if "duplicated" not in missed:
        expected = scenario["inserted"] - scenario["gone_with_producer"]
        assert scenario["duplicated"] == 0 and scenario["delivered"] == expected, result.stdout
    assert scenario["hung"] == [] and scenario["overlong_calls"] == 0 and scenario["drained"], result.stdout
    if scenario["latency_applies"] and "latency" not in missed:
        assert scenario["p99_ratio"] <= P99_RATIO_GOAL, result.stdout
    if scenario["latency_applies"] and "rate" not in missed:
        assert scenario["legit_rate"] >= LEGIT_RATE_GOAL, result.stdout
    if "rss" not in missed:
        assert scenario["rss_after"] - scenario["rss_before"] <= RSS_GROWTH_GOAL_BYTES, result.stdout
    if not missed:
        assert result.returncode == 0 and "every goal met" in result.stdout, result.stdout


def _met() -> Tally:
    return Tally(
        "x",
        inserted=10,
        delivered=10,
        p99_base_ms=1.0,
        p99_attack_ms=2.0,
        legit_rate=1.0,
        rss_before=100,
        rss_after=100,
    )


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"lost": 1}, "lost"),
        ({"duplicated": 1}, "taken twice"),
        ({"damaged": 1}, "damaged"),
        ({"hung": ["taker"]}, "did not stop"),
        ({"drained": False}, "still held"),
        ({"p99_attack_ms": 5.1}, "p99"),
        ({"p99_attack_ms": math.nan}, "p99"),
        ({"legit_rate": 0.5}, "of its items a second"),
        ({"overlong_calls": 1}, "outlived their timeout"),
        ({"rss_after": 100 + RSS_GROWTH_GOAL_BYTES + 1}, "RSS"),
    ],
)
def test_each_missed_goal_fails_the_scenario(change: dict[str, Any], named: str) -> None:
    assert _met().failures() == []
    missed = _met()
    for field, value in change.items():
        setattr(missed, field, value)
    assert any(named in failure for failure in missed.failures())


def test_the_legitimate_flows_goals_do_not_apply_where_the_producer_itself_is_attacked() -> None:
    stalled = _met()
    stalled.p99_attack_ms, stalled.legit_rate, stalled.latency_applies = 1000.0, 0.1, False
    assert stalled.failures() == []
