"""The examples in docs/ run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_embedded_example_runs_and_prints_what_the_guide_says() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / "embedded.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "got KV for 64 tokens, 48 matched" in result.stdout
    assert "second lookup: miss" in result.stdout
    assert "refused: drop_select: input_tokens must be a 1-D integer tensor" in result.stdout


def test_the_synchronous_engine_example_runs_and_prints_what_the_guide_says() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / "synchronous_engine.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:4] == [f"decode {n}: 32 tokens, K starts {100 * n}" for n in range(4)]
    assert "closed while waiting: ClosedError" in lines
    assert "metrics: kvrt_consumer_lookups_total hit = 4.0" in lines
    assert "drop-in: key (5, 6) of 2.0, value of 3.0" in lines
    assert "drop-in miss: [None, None, None, None, None]" in lines


def test_the_guide_names_every_kvrt_variable_the_settings_read_and_every_metric() -> None:
    import re

    from kvrt import _settings

    guide = (ROOT / "docs" / "guide.md").read_text()
    variables = set(re.findall(r"KVRT_[A-Z_]+", (ROOT / "kvrt" / "_settings.py").read_text()))
    assert variables and all(f"`{name}`" in guide for name in variables), variables
    read = {*_settings._PRODUCER, *_settings._CONSUMER}
    assert read <= variables
    metrics = set(re.findall(r'"(kvrt_[a-z_]+)"', (ROOT / "kvrt" / "_metrics.py").read_text()))
    counters = {"kvrt_producer_items", "kvrt_producer_bytes", "kvrt_producer_refusals", "kvrt_consumer_lookups",
                "kvrt_consumer_items", "kvrt_consumer_bytes", "kvrt_consumer_errors",
                "kvrt_integrity_failures"}  # fmt: skip
    documented = {name + "_total" if name in counters else name for name in metrics}
    assert all(f"`{name}`" in guide for name in documented), documented
