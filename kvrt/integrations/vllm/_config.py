"""The connector's settings, read once from `kv_connector_extra_config` and vLLM's parallel
config, checked, and the endpoint of each tensor-parallel rank worked out.

    setting            side      meaning
    bind               producer  the address rank 0's worker binds; rank r binds its port + r
    endpoint           producer  the address advertised for rank 0 (default: bind); rank r: port + r
    connect            consumer  the producer to ask when a request names none
    buffer_bytes       producer  the bytes each rank's producer buffers (1 GiB)
    item_ttl_s         producer  how long an item nobody takes stays (120 s)
    lookup_timeout_s   consumer  how long a producer may take to answer a lookup (2 s)
    transport          both      kvrt's data plane: tcp, cuda_ipc, nccl, nixl (default: kvrt's
                                 choice, cuda_ipc between GPUs of one host, else nccl or tcp)
    heartbeat_s        both      how often kvrt's peers hear from each other (1 s); a peer
                                 silent for ten is lost: raise it on a host whose cores are all
                                 busy with forward passes
    cpu_cores          both      the CPU cores kvrt's threads run on in each worker (default:
                                 every core of the instance, `instance_cores`)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Final

import kvrt
from kvrt._protocol import DEFAULT_HEARTBEAT_S

DEFAULT_BUFFER_BYTES: Final = 1 << 30
DEFAULT_ITEM_TTL_S: Final = 120.0
"""An item that no decode takes (its request was routed elsewhere, its decode recomputed it)
leaves the producer after this long."""
DEFAULT_LOOKUP_TIMEOUT_S: Final = 2.0


def instance_cores() -> frozenset[int] | None:
    """The CPU cores this vLLM instance may use: those of the process that started this worker
    (vLLM's engine), with this process's own; None where the platform does not say.

    vLLM binds each worker's OpenMP threads to its rank's cores (`VLLM_CPU_OMP_THREADS_BIND`),
    its main thread among them, and every thread the worker starts later inherits that binding.
    kvrt's threads answer peers and land loads while the forward pass runs: bound to the
    rank's cores they wait behind it (and, on a small host, behind another instance's forward
    pass on the same core), for long enough to miss the peers' timeouts."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = set(os.sched_getaffinity(0))
    try:
        cores |= os.sched_getaffinity(os.getppid())
    except OSError:
        pass  # the parent is gone: this process's own cores
    return frozenset(cores)


class ConnectorConfigError(kvrt.InvalidInputError):
    """The KV transfer config cannot be used with kvrt (the message names the setting)."""


_PORT = re.compile(r"^(?P<head>.*):(?P<port>\d+)$")


def rank_endpoint(endpoint: str, rank: int, setting: str) -> str:
    """`endpoint` with its port moved up by `rank`: where tensor-parallel rank `rank` is."""
    found = _PORT.match(endpoint)
    if found is None or (rank and int(found["port"]) == 0):
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{setting!r}] must end with a fixed port (rank r uses port + r), "
            f"got {endpoint!r}"
        )
    return f"{found['head']}:{int(found['port']) + rank}"


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    produces: bool
    consumes: bool
    tensor_parallel: int
    bind: str | None
    endpoint: str | None
    connect: str | None
    buffer_bytes: int
    item_ttl_s: float | None
    lookup_timeout_s: float
    transport: str | None = None
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    cpu_cores: frozenset[int] | None = None
    """None: `instance_cores()`, worked out in each worker."""

    @staticmethod
    def read(
        extra: dict[str, Any], *, produces: bool, consumes: bool, tensor_parallel: int, pipeline_parallel: int,
        load_failure_policy: str,
    ) -> ConnectorSettings:  # fmt: skip
        if pipeline_parallel != 1:
            raise ConnectorConfigError("KvrtConnector moves the KV of pipeline parallel size 1 only")
        if consumes and load_failure_policy != "recompute":
            raise ConnectorConfigError(
                'a consuming KvrtConnector needs kv_load_failure_policy="recompute": a load that fails is recomputed'
            )
        bind = extra.get("bind")
        if produces and not bind:
            raise ConnectorConfigError('a producing KvrtConnector needs kv_connector_extra_config["bind"]')
        endpoint = extra.get("endpoint", bind)
        if produces and tensor_parallel > 1:
            rank_endpoint(str(bind), 1, "bind")
            rank_endpoint(str(endpoint), 1, "endpoint")
        ttl = extra.get("item_ttl_s", DEFAULT_ITEM_TTL_S)
        cores = extra.get("cpu_cores")
        if cores is not None and (
            not isinstance(cores, list) or not cores or not all(isinstance(core, int) and core >= 0 for core in cores)
        ):
            raise ConnectorConfigError(
                f"kv_connector_extra_config['cpu_cores'] must be a list of CPU core numbers, got {cores!r}"
            )
        try:
            return ConnectorSettings(
                produces=produces, consumes=consumes, tensor_parallel=tensor_parallel,
                bind=None if bind is None else str(bind), endpoint=None if endpoint is None else str(endpoint),
                connect=extra.get("connect"), buffer_bytes=int(extra.get("buffer_bytes", DEFAULT_BUFFER_BYTES)),
                item_ttl_s=None if ttl is None else float(ttl),
                lookup_timeout_s=float(extra.get("lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S)),
                transport=None if extra.get("transport") is None else str(extra["transport"]),
                heartbeat_s=float(extra.get("heartbeat_s", DEFAULT_HEARTBEAT_S)),
                cpu_cores=None if cores is None else frozenset(cores),
            )  # fmt: skip
        except (TypeError, ValueError) as exc:
            raise ConnectorConfigError(f"kv_connector_extra_config: {exc}") from None

    def bind_of(self, rank: int) -> str:
        assert self.bind is not None
        return rank_endpoint(self.bind, rank, "bind")

    def endpoints(self) -> tuple[str, ...]:
        """Every rank's advertised producer, in rank order."""
        assert self.endpoint is not None
        return tuple(rank_endpoint(self.endpoint, rank, "endpoint") for rank in range(self.tensor_parallel))
