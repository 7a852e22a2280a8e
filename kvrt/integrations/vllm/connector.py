"""`KvrtConnector`: vLLM's KV connector interface mapped onto the connector's vLLM-free parts
(`_scheduler`, `_worker`, `layouts`). The only module of the connector that imports vLLM.

vLLM makes one connector in its scheduler's process (role SCHEDULER) and one in each worker
(role WORKER); the package docstring says what each does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch

# vLLM's connector interface (KVConnectorBase_V1, its role and metadata types) is its public
# surface for third-party KV transfer. Besides it, only the CPU backend's choice of attention
# kernel (which decides how CPU pages are laid out) and the worker's tensor-parallel rank are
# read from vLLM at run time.
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvrt.integrations.vllm._config import ConnectorConfigError, ConnectorSettings, instance_cores
from kvrt.integrations.vllm._lookups import Lookups
from kvrt.integrations.vllm._scheduler import DecodeScheduler, Load, PrefillScheduler, Save
from kvrt.integrations.vllm._worker import LOOP_REPORT_EVERY_S, StepOutcome, WorkerSettings, WorkerSide
from kvrt.integrations.vllm.layouts import CacheSpec, kv_cache_pools

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvrt.integrations.vllm")


@dataclass
class KvrtConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step: the prefills to publish, the loads."""

    saves: list[Save] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)


@dataclass
class KvrtWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after a step: its loads, and which of them failed
    (on any rank: vLLM recomputes their blocks on every rank)."""

    settled: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    """Producers a load found gone or too slow."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvrtWorkerMetadata)
        return KvrtWorkerMetadata(self.settled | other.settled, self.failed | other.failed, self.lost | other.lost)


_COUNTERS: Final = {
    "loads": "requests whose KV a decode worker loaded through kvrt (each rank counts its own)",
    "failed_loads": "loads that failed after the lookup found the KV (vLLM recomputed their blocks)",
    "loaded_tokens": "prompt tokens whose KV loads wrote",
    "saves": "requests a prefill worker published through kvrt",
    "refused_saves": "requests not published (the producer's buffer was full)",
    **{
        f"{side}_loop_{name}": f"{text} ({where})"
        for side, where in (("worker", "each worker's kvrt loop thread"), ("lookups", "the scheduler's lookups thread"))
        for name, text in (
            ("lag_seconds", "how late the turns of kvrt's loop came, summed"),
            ("late_turns", "turns of kvrt's loop later than kvrt._loop_watch.LOOP_LAG_LOG_S, each logged"),
            ("cpu_seconds", "CPU time of kvrt's loop thread"),
            ("runqueue_seconds", "time kvrt's loop thread was ready to run and waited for a core"),
        )
    },
}
"""The connector's counters, as vLLM's KV connector stats carry them (summed over the workers)
and as its Prometheus output shows them (`vllm:kvrt_<name>_total`)."""


@dataclass
class KvrtConnectorStats(KVConnectorStats):
    """The connector's counters of one interval (see `_COUNTERS`), summed over the workers."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in _COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvrtPromMetrics(KVConnectorPromMetrics):
    """The connector's counters in vLLM's Prometheus output, per engine."""

    def __init__(
        self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
    ) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, documentation in _COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:kvrt_{name}", documentation=documentation, labelnames=labelnames)
            self._counters[name] = {
                index: counter.labels(*values) for index, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                per_engine[engine_idx].inc(value)


class KvrtConnector(KVConnectorBase_V1):
    """kvrt as vLLM's KV connector (see the package docstring for who calls what)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        parallel = vllm_config.parallel_config
        self._settings = ConnectorSettings.read(
            dict(transfer.kv_connector_extra_config or {}), produces=bool(transfer.is_kv_producer),
            consumes=bool(transfer.is_kv_consumer), tensor_parallel=parallel.tensor_parallel_size,
            pipeline_parallel=parallel.pipeline_parallel_size, load_failure_policy=transfer.kv_load_failure_policy,
        )  # fmt: skip
        self._block_size: int = vllm_config.cache_config.block_size
        model = vllm_config.model_config
        self._total_heads = int(model.get_total_num_kv_heads())
        self._mla = bool(model.use_mla)
        self._decode: DecodeScheduler | None = None
        self._prefill: PrefillScheduler | None = None
        self._lookups: Lookups | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._lookups = Lookups(timeout_s=self._settings.lookup_timeout_s, heartbeat_s=self._settings.heartbeat_s)
            if self._settings.consumes:
                self._decode = DecodeScheduler(
                    self._lookups, block_size=self._block_size, default_endpoint=self._settings.connect,
                    total_heads=self._total_heads, mla=self._mla,
                )  # fmt: skip
            if self._settings.produces:
                self._prefill = PrefillScheduler(
                    self._lookups, block_size=self._block_size, endpoints=self._settings.endpoints(),
                    total_heads=self._total_heads, mla=self._mla, item_ttl_s=self._settings.item_ttl_s,
                )  # fmt: skip
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = int(get_tensor_model_parallel_rank())
            settings = WorkerSettings(
                produces=self._settings.produces, consumes=self._settings.consumes,
                bind=self._settings.bind_of(self._rank) if self._settings.produces else None,
                buffer_bytes=self._settings.buffer_bytes, item_ttl_s=self._settings.item_ttl_s,
                connect_timeout_s=self._settings.lookup_timeout_s, rank=self._rank,
                tp=self._settings.tensor_parallel, total_heads=self._total_heads, mla=self._mla,
                transport=self._settings.transport, heartbeat_s=self._settings.heartbeat_s,
                cores=self._settings.cpu_cores or instance_cores(),
            )  # fmt: skip
            self._worker = WorkerSide(settings)
        self._layers: dict[str, int] = {}
        self._outcome: StepOutcome | None = None
        """The last step's loads (worker side), from `wait_for_save` until the scheduler has it."""

    # -- scheduler side: vLLM's scheduler thread ------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvrt can load beyond the `num_computed_tokens` vLLM holds (0: none; None: the
        lookup is on its way, ask again next step), loaded in the forward pass."""
        if self._decode is None:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        found = self._decode.matched(request.request_id, prompt, request.kv_transfer_params, num_computed_tokens)
        return found, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of the tokens counted above into the blocks vLLM allocated; note a
        prefill request whose KV a decode instance will take."""
        if self._prefill is not None:
            self._prefill.asked(request.request_id, request.kv_transfer_params)
        if self._decode is not None and num_external_tokens > 0:
            (block_ids, *_) = blocks.get_block_ids()
            self._decode.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's saves and loads, for the workers; the step's lookups leave now."""
        meta = KvrtConnectorMetadata()
        if self._decode is not None:
            meta.loads = self._decode.step(idle=not scheduler_output.total_num_scheduled_tokens)
        if self._prefill is not None:
            meta.saves = self._saves(self._prefill, scheduler_output)
        return meta

    def _saves(self, prefill: PrefillScheduler, output: SchedulerOutput) -> list[Save]:
        """The requests whose last prompt token this step computes, each published once."""
        saves = []
        for new in output.scheduled_new_reqs:
            prefill.new(new.req_id, list(new.prompt_token_ids or []), new.block_ids[0])
            done = new.num_computed_tokens + output.num_scheduled_tokens.get(new.req_id, 0)
            save = prefill.computed(new.req_id, done)
            if save is not None:
                saves.append(save)
        cached = output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            if new_blocks is not None:
                prefill.more_blocks(request_id, new_blocks[0], resumed=request_id in cached.resumed_req_ids)
            done = cached.num_computed_tokens[index] + output.num_scheduled_tokens.get(request_id, 0)
            save = prefill.computed(request_id, done)
            if save is not None:
                saves.append(save)
        return saves

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' word on the step's loads. The blocks of a failed load leave vLLM's
        prefix cache: it cached them as it allocated them and, recomputing them, keeps them
        there, so a request preempted before it recomputed them (or another with the same
        prefix) would read what the failed load left as its own prefix."""
        meta = connector_output.kv_connector_worker_meta
        if self._decode is not None and isinstance(meta, KvrtWorkerMetadata):
            self._decode.outcome(meta.failed, meta.settled, meta.lost)
        if connector_output.invalid_block_ids and self._kv_cache_manager is not None:
            self._kv_cache_manager.evict_blocks(set(connector_output.invalid_block_ids))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The blocks are vLLM's to free at once (kvrt gathered what it sends); the producers
        for the router; KV no load took released."""
        # By name: vLLM's RequestStatus is not part of the connector interface.
        aborted = request.status.name == "FINISHED_ABORTED"
        if self._decode is not None:
            prompt = list(request.prompt_token_ids or []) if aborted else None
            self._decode.finished(request.request_id, aborted, prompt, request.kv_transfer_params)
        if self._prefill is None:
            return False, None
        return False, self._prefill.finished(request.request_id, list(request.prompt_token_ids or []), aborted)

    def shutdown(self) -> None:
        """Close kvrt's side (its threads and sockets)."""
        if self._lookups is not None:
            self._lookups.close()
        if self._worker is not None:
            self._worker.close()

    # -- worker side: vLLM's model runner thread ------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's paged KV cache, per layer: kvrt's pools from now on (once, at start)."""
        assert self._worker is not None
        self._layers = {name: index for index, name in enumerate(kv_caches)}
        caches = list(kv_caches.values())
        self._worker.register(kv_cache_pools(caches, self._cache_spec(caches[0])))

    def _cache_spec(self, first: torch.Tensor) -> CacheSpec:
        groups = self._kv_cache_config.kv_cache_groups if self._kv_cache_config is not None else []
        if len(groups) != 1:
            raise ConnectorConfigError(
                f"KvrtConnector moves the KV of models with one KV cache group (full attention), not {len(groups)}"
            )
        spec = groups[0].kv_cache_spec
        head_size = int(spec.head_size)
        head_size_v = int(getattr(spec, "head_size_v", head_size) or 0)
        cpu_kernel = _cpu_kernel(spec.dtype, spec.block_size, head_size) if first.device.type == "cpu" else None
        quant = getattr(spec, "kv_quant_mode", None)
        packed = (
            getattr(spec, "num_head_slots", None) is not None
            or getattr(spec, "state_content_bytes", None) is not None
            or getattr(spec, "tokens_per_state", 1) != 1
        )
        assert self._worker is not None
        heads = self._worker.settings.heads
        return CacheSpec(
            block_size=int(spec.block_size), kv_heads=int(spec.num_kv_heads), head_size=head_size,
            head_size_v=head_size_v, dtype=spec.dtype, cpu_kernel=cpu_kernel,
            first_head=0 if heads is None else heads.start,
            kv_quant_mode="NONE" if quant is None else str(quant.name), packed=packed,
        )  # fmt: skip

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Take this step's streams from their producers, into the requests' blocks."""
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvrtConnectorMetadata)
        self._worker.start_loads(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this step's loads wrote layer `layer_name` (a failed load is noted)."""
        assert self._worker is not None
        layer = self._layers.get(layer_name)
        if layer is not None:
            self._worker.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Publish layer `layer_name` of this step's finished prompts from the pages."""
        assert self._worker is not None
        layer = self._layers.get(layer_name)
        meta = self._get_connector_metadata()
        if layer is not None and isinstance(meta, KvrtConnectorMetadata):
            self._worker.save_layer(meta.saves, layer)

    def wait_for_save(self) -> None:
        """End this step's streams (the last layer was published)."""
        assert self._worker is not None
        self._outcome = self._worker.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of loads that failed in this step: vLLM recomputes them."""
        return set() if self._outcome is None else set(self._outcome.failed_blocks)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's counters since the last call, or the scheduler side's loop figures
        (vLLM sums them, logs and exports them)."""
        if self._worker is not None:
            counters = self._worker.take_counters()
        elif self._lookups is not None:
            counters = self._lookups.take_counters(LOOP_REPORT_EVERY_S)
        else:
            return None
        return KvrtConnectorStats(data=counters) if any(counters.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvrtConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:  # fmt: skip
        return KvrtPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The step's loads and which failed, for the scheduler side."""
        outcome, self._outcome = self._outcome, None
        if outcome is None or not outcome.settled:
            return None
        return KvrtWorkerMetadata(set(outcome.settled), set(outcome.failed), set(outcome.lost))


def _cpu_kernel(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The attention kernel vLLM's CPU backend picks for these pages (its own choice, asked of it)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:
        raise ConnectorConfigError(
            f"this vLLM does not say which CPU attention kernel it uses ({exc}): KvrtConnector is tested with vLLM 0.32"
        ) from exc
    return str(_get_attn_isa(dtype, block_size, head_dim))
