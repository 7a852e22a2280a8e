"""Trace events: callbacks see what the runtime emits while they are installed, and nothing else."""

from __future__ import annotations

import logging
import time

import pytest

import kvrt
from kvrt._trace import emit


def test_a_callback_sees_the_events_emitted_inside_its_block_with_their_fields_and_time() -> None:
    seen: list[kvrt.TraceEvent] = []
    emit("consensus.round_issued", rows=1)  # before: not seen
    before = time.perf_counter()
    with kvrt.tracing(seen.append):
        emit("consensus.round_issued", rows=16)
        emit("consensus.round_ended", rows=16)
    emit("consensus.round_ended", rows=1)  # after: not seen
    assert [(event.name, dict(event.fields)) for event in seen] == [
        ("consensus.round_issued", {"rows": 16}),
        ("consensus.round_ended", {"rows": 16}),
    ]
    assert before <= seen[0].at_s <= seen[1].at_s <= time.perf_counter()


def test_every_installed_callback_gets_every_event_and_removing_one_twice_is_harmless() -> None:
    first: list[str] = []
    second: list[str] = []
    remove_first = kvrt.add_trace_callback(lambda event: first.append(event.name))
    try:
        with kvrt.tracing(lambda event: second.append(event.name)):
            emit("a")
        remove_first()
        remove_first()
        emit("b")
    finally:
        remove_first()
    assert first == ["a"]
    assert second == ["a"]


def test_a_failing_callback_is_logged_and_neither_reaches_the_runtime_nor_stops_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(event: kvrt.TraceEvent) -> None:
        raise ValueError("broken tracer")

    seen: list[str] = []
    with caplog.at_level(logging.ERROR, logger="kvrt.trace"), kvrt.tracing(broken), kvrt.tracing(
        lambda event: seen.append(event.name)
    ):
        emit("consensus.round_issued", rows=2)
    assert seen == ["consensus.round_issued"]
    assert any("consensus.round_issued" in record.getMessage() for record in caplog.records)
