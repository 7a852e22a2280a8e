"""The `kvrt` command: the demo runs end to end; usage errors exit 2."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._processes import run_producer


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


def test_version_prints_the_package_version() -> None:
    import tomllib
    from pathlib import Path

    import kvrt

    declared = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    result = run_kvrt("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvrt {declared['version']}" == f"kvrt {kvrt.__version__}"


def test_plot_without_matplotlib_is_refused_before_the_benchmark_runs(tmp_path: Path) -> None:
    # A matplotlib that cannot be imported, ahead of the installed one on the path.
    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvrt", "bench", "buffer", "--quick", "--json", str(tmp_path / "out.json"),
         "--plot", str(tmp_path / "plots")],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    assert result.returncode == 2
    assert "--plot needs matplotlib: pip install 'kvrt[plot]'" in result.stderr
    assert not (tmp_path / "out.json").exists() and result.stdout == ""


@pytest.mark.timeout(240)
def test_the_vllm_worker_benchmark_runs_on_the_host_and_reports_each_ratio_beside_its_copy(tmp_path: Path) -> None:
    """`kvrt bench vllm --device cpu --quick`: a prefill process publishes each step as the
    decode asks for it and the decode's worker side loads it (a load that fails stops the run).
    A smoke run that keeps the benchmark working; its figures are not a record."""
    report = tmp_path / "vllm.json"
    result = run_kvrt("bench", "vllm", "--device", "cpu", "--quick", "--json", str(report), timeout=220)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(report.read_text())["rows"]
    assert [row["what"] for row in rows] == [
        "one request, read as a stream",
        "one request, fetched",
        "a step of 32 requests, fetched",
    ]
    for row in rows:
        assert row["kvrt_ms"] > 0 and row["copy_ms"] > 0
        assert row["decode_kvrt_threads_us_per_request"] > 0 and row["prefill_kvrt_threads_us_per_request"] > 0
        assert row["share"] == pytest.approx(row["copy_ms"] / row["kvrt_ms"])
        assert row["bytes_a_step"] == row["per_step"] * rows[0]["bytes_a_step"] * row["tokens"] // rows[0]["tokens"]
        assert f"| {row['what']} |" in result.stdout


def test_an_unknown_command_exits_with_usage_error() -> None:
    result = run_kvrt("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """A producer in its own process holding 3 items: tokens 0..31, 1000..1031, 2000..2031."""
    spawn = multiprocessing.get_context("spawn")
    control, child = spawn.Pipe()
    process = spawn.Process(target=run_producer, args=(3, 1.0, child), daemon=True)
    process.start()
    try:
        assert control.poll(60), "producer process did not start"
        yield control.recv()
    finally:
        with contextlib.suppress(OSError):
            control.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()


def test_stat_once_prints_the_table(endpoint: str) -> None:
    result = run_kvrt("stat", endpoint, "--once")
    assert result.returncode == 0, result.stderr
    assert "items buffered" in result.stdout and "transports" in result.stdout


def test_stat_json_is_one_object_scripts_can_read(endpoint: str) -> None:
    result = run_kvrt("stat", endpoint, "--json")
    report = json.loads(result.stdout)
    assert report["stats"]["items"] >= 2 and report["health"]["transports"] == ["tcp"]


def test_probe_exits_zero_on_a_match_and_three_on_none(endpoint: str) -> None:
    hit = run_kvrt("probe", endpoint, "--tokens", "1000,1001,1002")
    assert hit.returncode == 0 and "matched 3 of 3 tokens" in hit.stdout
    miss = run_kvrt("probe", endpoint, "--tokens", "7,7,7", "--json")
    assert miss.returncode == 3 and json.loads(miss.stdout)["matched"] == 0


def test_list_then_evict_removes_one_item(endpoint: str) -> None:
    listing = json.loads(run_kvrt("list", endpoint, "--json").stdout)
    victim = listing["items"][-1]["item_id"]
    evicted = run_kvrt("evict", endpoint, str(victim))
    assert evicted.returncode == 0 and f"evicted item {victim}" in evicted.stdout
    again = run_kvrt("evict", endpoint, str(victim))
    assert again.returncode == 1 and "not buffered" in again.stderr


def test_an_unreachable_endpoint_exits_one_with_a_reason() -> None:
    result = run_kvrt("stat", "tcp://127.0.0.1:9", "--once", "--timeout", "0.5")
    assert result.returncode == 1 and "no producer answered" in result.stderr


@pytest.mark.timeout(240)
def test_bench_writes_json_and_a_png_plot(tmp_path: pytest.TempPathFactory) -> None:
    report, plots = tmp_path / "consensus.json", tmp_path / "plots"  # type: ignore[operator]
    result = run_kvrt("bench", "consensus", "--quick", "--json", str(report), "--plot", str(plots), timeout=200)
    assert result.returncode == 0, result.stderr
    assert "vs reference" in result.stdout
    measured = json.loads(report.read_text())
    assert measured["all_gather_object_s"] > 0 and measured["lookups"] == 100
    assert measured["bare_rounds_per_lookup_s"] > 0  # the floor of the in-flight row, same run
    assert measured["kvrt_per_call_per_lookup_s"] > 0 and measured["kvrt_per_call_rounds"] > 0
    assert (plots / "consensus.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_help_of_keys_names_the_directory_it_writes_to() -> None:
    (line,) = [line for line in run_kvrt("--help").stdout.splitlines() if line.strip().startswith("keys")]
    assert "DIRECTORY" in line
    usage = run_kvrt("keys", "--help").stdout
    assert "directory" in usage and "DIRECTORY/NAME.key" in usage and "where the two files are written" in usage


def test_keys_makes_a_pair_the_api_can_load(tmp_path: pytest.TempPathFactory) -> None:
    result = run_kvrt("keys", str(tmp_path), "producer")
    assert result.returncode == 0 and "keep it private" in result.stdout
    import kvrt

    keys = kvrt.CurveKeys.server(tmp_path / "producer.key_secret")  # type: ignore[operator]
    assert len(keys.public_key) == 40
