"""Connectors that time their scheduler-side hooks, for the served benchmark: how long vLLM's
scheduler thread spends in `get_num_new_matched_tokens` and `build_connector_meta`, each call,
written as JSON to the file its `kv_connector_extra_config["hook_times"]` names when the
scheduler shuts down (the server's SIGTERM). Each call is kept as (start, duration) in
nanoseconds of CLOCK_MONOTONIC, which every process on the host reads alike: the benchmark
keeps the calls of the runs it asks about. The timing is two clock reads a call.

    kv_connector="TimedKvrtConnector", kv_connector_module_path="tests.vllm.timed"
    kv_connector="TimedNixlConnector", kv_connector_module_path="tests.vllm.nixl_baseline"
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvrt.integrations.vllm.connector import KvrtConnector

TIMED_HOOKS = ("get_num_new_matched_tokens", "build_connector_meta")
_T = TypeVar("_T")


class HookTimes:
    """Mixin before a vLLM connector class: times the scheduler's hooks of the class after it."""

    _kv_transfer_config: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hook_ns: dict[str, list[tuple[int, int]]] = {hook: [] for hook in TIMED_HOOKS}

    def _timed(self, hook: str, call: Callable[..., _T], *args: Any) -> _T:
        started = time.monotonic_ns()
        try:
            return call(*args)
        finally:
            self._hook_ns[hook].append((started, time.monotonic_ns() - started))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        matched = super().get_num_new_matched_tokens  # type: ignore[misc]
        return self._timed("get_num_new_matched_tokens", matched, request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self._timed("build_connector_meta", super().build_connector_meta, scheduler_output)  # type: ignore[misc]

    def shutdown(self) -> None:
        path = (self._kv_transfer_config.kv_connector_extra_config or {}).get("hook_times")
        if path and any(self._hook_ns.values()):
            Path(path).write_text(json.dumps(self._hook_ns))
        super().shutdown()  # type: ignore[misc]


class TimedKvrtConnector(HookTimes, KvrtConnector):
    pass


def hook_summary(path: Path, windows: Sequence[tuple[int, int]] | None = None) -> dict[str, dict[str, float]]:
    """Per hook: calls, p50, p99 and max in ms, of a file a `HookTimes` connector wrote; only
    the calls that started within one of `windows` (CLOCK_MONOTONIC ns, first and last) if
    given."""
    summary = {}
    for hook, calls in json.loads(path.read_text()).items():
        ordered = sorted(
            duration for started, duration in calls
            if windows is None or any(first <= started <= last for first, last in windows)
        )  # fmt: skip
        if not ordered:
            continue

        def at(share: float, ordered: list[int] = ordered) -> float:
            return ordered[min(len(ordered) - 1, int(share * len(ordered)))] / 1e6

        summary[hook] = {"calls": len(ordered), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": ordered[-1] / 1e6}
    return summary
