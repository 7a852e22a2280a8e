"""vLLM's own `NixlConnector`, as the served benchmark's reference: as on a host with cores to
spare. On the CPU platform its worker pins itself to the host's last core (leaving the forward
pass one core of two here) and its NIXL agent starts a progress thread that polls a core; this
subclass gives the worker back the cores it had and runs the agent without that thread, so the
comparison is of the transfer paths, not of a 2-core host's scheduling.

    --kv-transfer-config '{"kv_connector": "UnpinnedNixlConnector",
                           "kv_connector_module_path": "tests.vllm.nixl_baseline", ...}'
"""

from __future__ import annotations

import functools
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

if base_worker.nixl_agent_config is not None:
    base_worker.nixl_agent_config = functools.partial(base_worker.nixl_agent_config, enable_prog_thread=False)


class UnpinnedNixlConnector(NixlConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cores = os.sched_getaffinity(0)
        super().__init__(*args, **kwargs)
        os.sched_setaffinity(0, cores)
