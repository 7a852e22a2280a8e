"""The `kvrt` command: the demo runs end to end; usage errors exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_kvrt(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrt", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.timeout(180)
def test_the_demo_moves_every_request_and_prints_the_table() -> None:
    result = run_kvrt("demo", "--requests", "24")
    assert result.returncode == 0, result.stderr
    assert "24/24 requests" in result.stderr
    for row in ("requests/s", "MB/s", "p50 latency", "p99 latency", "all equal"):
        assert row in result.stdout


def test_help_lists_the_commands() -> None:
    result = run_kvrt("--help")
    assert result.returncode == 0
    assert "demo" in result.stdout and "bench" in result.stdout


def test_an_unknown_command_exits_with_usage_error() -> None:
    result = run_kvrt("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
