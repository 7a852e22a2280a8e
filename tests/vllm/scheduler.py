"""vLLM's own `Scheduler`, built from vLLM's config classes, with `KvrtConnector` in it, and the
requests and model outputs to drive it: no model runs, the test plays the worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvrt.integrations.vllm.connector import KvrtConnector, KvrtConnectorMetadata, KvrtWorkerMetadata
from tests.vllm.instance import BLOCK_SIZE, MAX_MODEL_LEN

NUM_BLOCKS = 64
"""Blocks in the scheduler's KV cache (one of them vLLM's null block)."""

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 64
"""The tiny model of `tests.vllm.instance.make_model`."""

ANSWER_S = 10.0
"""Bound on waiting for the connector's lookups to be answered."""


def make_scheduler(
    model: Path, role: str, *, num_blocks: int = NUM_BLOCKS, prefix_caching: bool = False, max_num_seqs: int = 4,
    **extra: Any,
) -> Scheduler:  # fmt: skip
    """A scheduler of `model` with `num_blocks` blocks whose connector is `KvrtConnector` in `role`
    ("kv_producer" or "kv_consumer") with `extra` as its `kv_connector_extra_config`."""
    transfer = KVTransferConfig(
        kv_connector="KvrtConnector", kv_connector_module_path="kvrt.integrations.vllm", kv_role=role,
        kv_connector_extra_config=extra, kv_load_failure_policy="recompute",
    )  # fmt: skip
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=MAX_MODEL_LEN,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=transfer,
    )
    config.cache_config.num_gpu_blocks = num_blocks  # what the engine sets once it sized the cache
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    layers = [f"model.decoder.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]
    cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return Scheduler(config, cache, StructuredOutputManager(config), block_size=BLOCK_SIZE, include_finished_set=True)


def connector(scheduler: Scheduler) -> KvrtConnector:
    found = scheduler.connector
    assert isinstance(found, KvrtConnector)
    return found


def _block_hasher() -> Any:
    """What vLLM's engine gives each request when prefix caching (or a connector) is on."""
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK_SIZE, hash_fn)


def make_request(
    request_id: str, prompt: list[int], endpoint: str | None = None, *, max_tokens: int = 2,
    remote_decode: bool = False, params: dict[str, Any] | None = None,
) -> Request:  # fmt: skip
    """A greedy request, its KV at `endpoint` (its `kv_transfer_params`) when one is named, or
    with `params` as its `kv_transfer_params` (a prefill's, as a router hands them on); a
    prefill request whose KV a decode instance will take, with `remote_decode` (as a router
    sends it)."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if params is not None:
        sampling.extra_args = {"kv_transfer_params": params}
    elif endpoint is not None:
        sampling.extra_args = {"kv_transfer_params": {"kvrt_endpoint": endpoint}}
    elif remote_decode:
        sampling.extra_args = {"kv_transfer_params": {"do_remote_decode": True}}
    return Request(request_id, prompt, sampling, None, block_hasher=_block_hasher())


def loads_of(output: SchedulerOutput) -> list[Any]:
    meta = output.kv_connector_metadata
    assert isinstance(meta, KvrtConnectorMetadata)
    return list(meta.loads)


def run_step(
    scheduler: Scheduler, output: SchedulerOutput, token: int = 7, *, failed: set[str] | None = None
) -> list[EngineCoreOutput]:
    """The worker's side of one step: every request that computed its last prompt token (or
    decoded) samples `token`; the step's loads landed but those in `failed`, whose blocks are
    reported as failed (the workers' word to the scheduler). What the engine hands back."""
    failed = failed or set()
    scheduled = list(output.num_scheduled_tokens)
    sampled = []
    for request_id, tokens in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        done = request_id not in failed and request.num_computed_tokens + tokens >= request.num_prompt_tokens
        sampled.append([token] if done else [])
    loads = loads_of(output) if isinstance(output.kv_connector_metadata, KvrtConnectorMetadata) else []
    settled = {load.request_id for load in loads}
    connector_output = None
    if settled:
        blocks = {block for load in loads if load.request_id in failed for block in load.block_ids}
        connector_output = KVConnectorOutput(
            invalid_block_ids=blocks, kv_connector_worker_meta=KvrtWorkerMetadata(settled, failed & settled)
        )
    model_output = ModelRunnerOutput(
        req_ids=scheduled,
        req_id_to_index={request_id: index for index, request_id in enumerate(scheduled)},
        sampled_token_ids=sampled,
        kv_connector_output=connector_output,
    )
    engine = scheduler.update_from_output(output, model_output)
    return [done for outputs in engine.values() for done in outputs.outputs]


def schedule_answered(scheduler: Scheduler) -> SchedulerOutput:
    """The next step once the lookups the last one sent have their answers: what a scheduler
    whose forward passes take longer than a lookup sees (a first step only sends them)."""
    output = scheduler.schedule()
    if output.num_scheduled_tokens:
        return output
    run_step(scheduler, output)
    assert connector(scheduler)._lookups is not None
    assert connector(scheduler)._lookups.wait_settled(ANSWER_S), "the lookups were not answered in time"
    return scheduler.schedule()
