"""The benchmarks' CPU breakdown by phase (`kvrt._bench._phases`), and the one-GPU ipc
report that prints it (its GPU run is rare: its report is checked here on made-up figures)."""

from __future__ import annotations

import argparse

import pytest

from kvrt._bench import ipc_one_gpu
from kvrt._bench._phases import OTHER_THREADS, PHASES, SideClock, per_request_us, phase_of


def test_functions_fall_in_the_phase_of_where_they_live() -> None:
    assert phase_of("/x/kvrt/_zmqio.py:50(send_frames)") == "ZeroMQ calls"
    assert phase_of("/x/asyncio/base_events.py:1845(_run_once)") == "event loop"
    assert phase_of("/x/kvrt/_protocol/producer.py:171(receive)") == "protocol and messages"
    assert phase_of("/x/transports/tcp.py:54(send)") == "transport"
    assert phase_of("/x/kvrt/_consumer/_link.py:87(_run)") == "kvrt driver"
    assert phase_of("<method 'poll' of 'select.epoll' objects>") is None  # blocked, not CPU


def test_the_loop_threads_cpu_splits_as_the_profiled_run_and_the_rest_is_other_threads() -> None:
    timed = SideClock(process_s=0.5, loop_s=0.3)
    profiled = SideClock(shares={"event loop": 0.25, "kvrt driver": 0.75})
    spent = per_request_us(timed, profiled, requests=1000)
    assert spent["event loop"] == pytest.approx(75) and spent["kvrt driver"] == pytest.approx(225)
    assert spent[OTHER_THREADS] == pytest.approx(200)


def test_bench_ipc_reports_each_sides_phases_beside_its_rows(capsys: pytest.CaptureFixture[str]) -> None:
    shares = dict.fromkeys(PHASES, 1 / len(PHASES))
    results = {}
    for case in ipc_one_gpu.QUICK_CASES:
        timed = ipc_one_gpu.Timed([0.001] * 10, 10, 0.01, 0.002, 0.002, SideClock(process_s=0.002, loop_s=0.001),
                                  SideClock(process_s=0.002, loop_s=0.001))  # fmt: skip
        profiled = ipc_one_gpu.Timed([0.001] * 10, 10, 0.01, 0.002, 0.002, SideClock(shares=shares),
                                     SideClock(shares=shares))  # fmt: skip
        results[case.label] = {"mapped once": timed, "mapped per item": timed, "kvrt": timed, "kvrt profiled": profiled}
    ipc_one_gpu._report(ipc_one_gpu.QUICK_CASES, results, argparse.Namespace(quick=True, json=None))
    printed = capsys.readouterr().out
    assert "producer 200 µs: other threads 100" in printed and "consumer 200 µs" in printed
