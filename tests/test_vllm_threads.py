"""kvrt's threads in a vLLM worker (no vLLM needed): vLLM binds a worker's OpenMP threads, its
main thread among them, to its rank's cores, and every thread started later inherits that;
kvrt's loop thread, and the threads it starts, run on the instance's cores instead."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvrt.integrations.vllm._config import ConnectorConfigError, ConnectorSettings
from kvrt.integrations.vllm._worker import WorkerSettings, WorkerSide

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="2 cores"),
]


def test_a_workers_kvrt_threads_run_on_the_cores_it_is_given_not_its_callers() -> None:
    caller, given = os.sched_getaffinity(0), frozenset({min(os.sched_getaffinity(0))})
    side = WorkerSide(
        WorkerSettings(produces=False, consumes=True, bind=None, buffer_bytes=1 << 20, item_ttl_s=None,
                       connect_timeout_s=2.0, cores=given)
    )  # fmt: skip
    try:

        async def cores() -> set[int]:
            return os.sched_getaffinity(0)

        assert side._loop.call(cores, "cores") == given
        assert os.sched_getaffinity(0) == caller
    finally:
        side.close()


def test_the_instances_cores_include_those_its_engine_has_beside_the_ranks_own() -> None:
    # A worker whose main thread vLLM bound to one core (its rank's): kvrt's threads may use
    # every core of the process that started it.
    script = (
        f"import os; os.sched_setaffinity(0, {{{min(os.sched_getaffinity(0))}}}); "
        "from kvrt.integrations.vllm._config import instance_cores; print(sorted(instance_cores()))"
    )
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert found.stdout.strip() == str(sorted(os.sched_getaffinity(0)))


@pytest.mark.parametrize("cores", [3, [], ["0"], [-1]])
def test_cpu_cores_other_than_a_list_of_core_numbers_are_refused_naming_the_setting(cores: object) -> None:
    with pytest.raises(ConnectorConfigError, match="cpu_cores"):
        ConnectorSettings.read(
            {"cpu_cores": cores}, produces=False, consumes=True, tensor_parallel=1, pipeline_parallel=1,
            load_failure_policy="recompute",
        )  # fmt: skip
