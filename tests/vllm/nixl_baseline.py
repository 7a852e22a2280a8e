"""vLLM's own `NixlConnector`, as the served benchmark's reference, as a deployment on a host
without spare cores runs it: each instance's threads on cores of their own (the benchmark pins
the instance's process tree there and binds its OpenMP threads there), and NIXL's agent
without its progress thread.

Two of vLLM's CPU defaults are for a host with cores to spare, and are set here as such a
deployment sets them:
* NixlConnector moves the thread that makes it, the worker's main thread (which runs the
  forward pass), to the host's last core, reserved for transfers where vLLM's automatic
  binding leaves one free, and its agent's threads start there. With each instance on a core
  of its own there is none: the prefill's forward pass and its agent would move onto the
  decode's core. Every thread of the worker goes back to its instance's cores.
* NIXL's agent starts a progress thread that polls a core; with none to spare it takes the
  forward pass's. It runs without one (UCX progresses as the connector polls its transfers).

    --kv-transfer-config '{"kv_connector": "OwnCoresNixlConnector",   (or TimedNixlConnector)
                           "kv_connector_module_path": "tests.vllm.nixl_baseline", ...}'
"""

from __future__ import annotations

import functools
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from tests.vllm.timed import HookTimes

if base_worker.nixl_agent_config is not None:
    base_worker.nixl_agent_config = functools.partial(base_worker.nixl_agent_config, enable_prog_thread=False)


class OwnCoresNixlConnector(NixlConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cores = os.sched_getaffinity(0)
        super().__init__(*args, **kwargs)
        for thread in os.listdir("/proc/self/task"):  # the worker's, and those its agent started
            os.sched_setaffinity(int(thread), cores)


class TimedNixlConnector(HookTimes, OwnCoresNixlConnector):
    """The same, its scheduler's hooks timed (`tests.vllm.timed`)."""
