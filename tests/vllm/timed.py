"""`KvrtConnector` that times its scheduler-side hooks, for the served benchmark: how long vLLM's
scheduler thread spends in `get_num_new_matched_tokens` and `build_connector_meta`, each call,
written as JSON to the file its `kv_connector_extra_config["hook_times"]` names when the
scheduler shuts down (the server's SIGTERM). The timing is two clock reads a call.

    kv_connector="TimedKvrtConnector", kv_connector_module_path="tests.vllm.timed"
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kvrt.integrations.vllm.connector import KvrtConnector

TIMED_HOOKS = ("get_num_new_matched_tokens", "build_connector_meta")


class TimedKvrtConnector(KvrtConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hook_ns: dict[str, list[int]] = {hook: [] for hook in TIMED_HOOKS}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        started = time.perf_counter_ns()
        try:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        finally:
            self._hook_ns["get_num_new_matched_tokens"].append(time.perf_counter_ns() - started)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        started = time.perf_counter_ns()
        try:
            return super().build_connector_meta(scheduler_output)
        finally:
            self._hook_ns["build_connector_meta"].append(time.perf_counter_ns() - started)

    def shutdown(self) -> None:
        path = (self._kv_transfer_config.kv_connector_extra_config or {}).get("hook_times")
        if path and any(self._hook_ns.values()):
            Path(path).write_text(json.dumps(self._hook_ns))
        super().shutdown()


def hook_summary(path: Path) -> dict[str, dict[str, float]]:
    """Per hook: calls, p50, p99 and max in ms, of a file `TimedKvrtConnector` wrote."""
    summary = {}
    for hook, durations in json.loads(path.read_text()).items():
        if not durations:
            continue
        ordered = sorted(durations)

        def at(share: float, ordered: list[int] = ordered) -> float:
            return ordered[min(len(ordered) - 1, int(share * len(ordered)))] / 1e6

        summary[hook] = {"calls": len(ordered), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": ordered[-1] / 1e6}
    return summary
