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

KNOWN_MISSES = {
    "kill-consumer": "now and then an item is taken twice: a consumer killed right after its lookup returned, "
    "before its receipt left (tests/test_attack_findings.py, ...right_before_its_consumer_dies...)",
    "stall-producer": "now and then an item is taken twice: a receipt sent while the producer was stopped is "
    "not read before it forgets the consumer (tests/test_attack_findings.py, ...while_its_producer_is_stopped...)",
    "connects": "each wave of 1000 new connections delays the legitimate consumer's calls by 20-60 ms on a "
    "2-core host: its p99 rises 6-9x; the producer's RSS stays 100-200 MiB higher after a storm "
    "(tests/test_attack_findings.py, ...connection_storm...)",
    "parked": "a burst of 16 lookups of 8 MiB holds the producer's loop for 40-70 ms: p99 4-8x in a 3 s window",
}
"""Goals the suite misses today, and why: these scenarios may fail (each miss is a finding)."""


def _scenario(name: str) -> Any:
    if name in KNOWN_MISSES:
        return pytest.param(name, marks=pytest.mark.xfail(strict=False, reason=KNOWN_MISSES[name]))
    return name


def _run_suite(name: str, report: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    command = [sys.executable, "-m", "kvrt", "attack", "--quick", "--only", name, "--json", str(report)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=SCENARIO_S, check=False)
    assert report.exists(), result.stdout + result.stderr
    (scenario,) = json.loads(report.read_text())
    return result, scenario


@pytest.mark.slow
@pytest.mark.timeout(SCENARIO_S + 30)
@pytest.mark.parametrize("name", [_scenario(scenario.name) for scenario in SCENARIOS])
def test_a_quick_attack_loses_nothing_takes_nothing_twice_and_meets_its_goals(name: str, tmp_path: Path) -> None:
    result, scenario = _run_suite(name, tmp_path / "report.json")
    assert scenario["inserted"] > 0 and scenario["delivered"] == scenario["inserted"] - scenario["gone_with_producer"]
    assert (scenario["lost"], scenario["duplicated"], scenario["damaged"]) == (0, 0, 0), result.stdout
    assert scenario["hung"] == [] and scenario["overlong_calls"] == 0 and scenario["drained"], result.stdout
    if scenario["latency_applies"]:
        assert scenario["p99_ratio"] <= P99_RATIO_GOAL and scenario["legit_rate"] >= LEGIT_RATE_GOAL, result.stdout
    assert scenario["rss_after"] - scenario["rss_before"] <= RSS_GROWTH_GOAL_BYTES, result.stdout
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
