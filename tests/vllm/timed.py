"""Connectors that time their scheduler-side hooks, for the served benchmark: how long vLLM's
scheduler thread spends in `get_num_new_matched_tokens` and `build_connector_meta`, each call,
appended as a record of 17 bytes (the hook, its start and its duration in nanoseconds of
CLOCK_MONOTONIC, which every process on the host reads alike) to the file its
`kv_connector_extra_config["hook_times"]` names: one unbuffered write a call, so the record
holds every call however the instance is stopped (vLLM's engine core is killed at shutdown
before its scheduler's own shutdown runs). The benchmark keeps the calls of the runs it asks
about. The timing is two clock reads and a write of 17 bytes a call.

    kv_connector="TimedKvrtConnector", kv_connector_module_path="tests.vllm.timed"
    kv_connector="TimedNixlConnector", kv_connector_module_path="tests.vllm.nixl_baseline"
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from kvrt.integrations.vllm.connector import KvrtConnector

TIMED_HOOKS = ("get_num_new_matched_tokens", "build_connector_meta")
RECORD = struct.Struct("<Bqq")
"""One call: its hook's index in `TIMED_HOOKS`, its start and its duration (ns)."""
_T = TypeVar("_T")


class HookTimes:
    """Mixin before a vLLM connector class: times the scheduler's hooks of the class after it."""

    _kv_transfer_config: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = (self._kv_transfer_config.kv_connector_extra_config or {}).get("hook_times")
        self._hook_file: BinaryIO | None = open(path, "ab", buffering=0) if path else None  # noqa: SIM115

    def _timed(self, hook: int, call: Callable[..., _T], *args: Any) -> _T:
        started = time.monotonic_ns()
        try:
            return call(*args)
        finally:
            spent = time.monotonic_ns() - started
            if self._hook_file is not None:
                self._hook_file.write(RECORD.pack(hook, started, spent))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        matched = super().get_num_new_matched_tokens  # type: ignore[misc]
        return self._timed(0, matched, request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self._timed(1, super().build_connector_meta, scheduler_output)  # type: ignore[misc]


class TimedKvrtConnector(HookTimes, KvrtConnector):
    pass


def hook_calls(paths: Sequence[Path]) -> dict[str, list[tuple[int, int]]]:
    """Per hook, the (start, duration) of every call the files of `HookTimes` connectors hold."""
    calls: dict[str, list[tuple[int, int]]] = {hook: [] for hook in TIMED_HOOKS}
    for path in paths:
        data = path.read_bytes()
        whole = len(data) // RECORD.size * RECORD.size  # a record cut by a kill is left out
        for hook, started, spent in RECORD.iter_unpack(data[:whole]):
            calls[TIMED_HOOKS[hook]].append((started, spent))
    return calls


def hook_summary(
    calls: dict[str, list[tuple[int, int]]], windows: Sequence[tuple[int, int]] | None = None
) -> dict[str, dict[str, float]]:
    """Per hook: calls, p50, p99 and max in ms, of `hook_calls`; only the calls that started
    within one of `windows` (CLOCK_MONOTONIC ns, first and last) if given."""
    summary = {}
    for hook, timed in calls.items():
        ordered = sorted(
            spent for started, spent in timed
            if windows is None or any(first <= started <= last for first, last in windows)
        )  # fmt: skip
        if not ordered:
            continue

        def at(share: float, ordered: list[int] = ordered) -> float:
            return ordered[min(len(ordered) - 1, int(share * len(ordered)))] / 1e6

        summary[hook] = {"calls": len(ordered), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": ordered[-1] / 1e6}
    return summary
