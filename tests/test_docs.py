"""The examples in docs/ run as written."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

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
                "kvrt_integrity_failures", "kvrt_loop_late_turns", "kvrt_loop_cpu_seconds",
                "kvrt_loop_runqueue_seconds"}  # fmt: skip
    documented = {name + "_total" if name in counters else name for name in metrics}
    assert all(f"`{name}`" in guide for name in documented), documented


@pytest.mark.timeout(180)
def test_the_embedded_example_serves_its_producer_for_the_kvrt_command_until_stopped() -> None:
    # "Outside the engine": a producer to try `kvrt stat` and `probe` on, as the guide says.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    example = subprocess.Popen(
        [sys.executable, str(ROOT / "docs" / "examples" / "embedded.py"), "--serve", "--bind", endpoint],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert example.stdout is not None
        for line in example.stdout:  # bounded by the test's timeout
            if line.startswith("serving at"):
                break
        assert line.startswith(f"serving at {endpoint}, 3 items buffered"), line
        kvrt_command = [sys.executable, "-m", "kvrt"]
        found = subprocess.run([*kvrt_command, "probe", endpoint, "--tokens", "200,201,202"], timeout=60, check=False)
        assert found.returncode == 0  # a match
        stat = subprocess.run(
            [*kvrt_command, "stat", endpoint, "--once", "--json"], capture_output=True, text=True, timeout=60,
            check=True,
        )  # fmt: skip
        assert json.loads(stat.stdout)["stats"]["items"] == 3
        example.send_signal(signal.SIGINT)  # Ctrl-C
        rest, _ = example.communicate(timeout=60)
        assert example.returncode == 0 and rest.strip().endswith("stopped")
    finally:
        if example.poll() is None:
            example.kill()
            example.wait()
