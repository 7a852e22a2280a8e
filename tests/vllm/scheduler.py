"""vLLM's own `Scheduler`, built from vLLM's config classes, with `KvrtConnector` in it, and the
requests and model outputs to drive it: no model runs, the test plays the worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.vllm.instance import BLOCK_SIZE, MAX_MODEL_LEN

NUM_BLOCKS = 64
"""Blocks in the scheduler's KV cache (one of them vLLM's null block)."""

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 64
"""The tiny model of `tests.vllm.instance.make_model`."""


def make_scheduler(model: Path, role: str, *, num_blocks: int = NUM_BLOCKS, **extra: Any) -> Scheduler:
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
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False
        ),
        kv_transfer_config=transfer,
    )
    config.cache_config.num_gpu_blocks = num_blocks  # what the engine sets once it sized the cache
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    layers = [f"model.decoder.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]
    cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return Scheduler(config, cache, StructuredOutputManager(config), block_size=BLOCK_SIZE, include_finished_set=True)


def make_request(request_id: str, prompt: list[int], endpoint: str | None = None, *, max_tokens: int = 2) -> Request:
    """A greedy request, its KV at `endpoint` (its `kv_transfer_params`) when one is named."""
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if endpoint is not None:
        sampling.extra_args = {"kv_transfer_params": {"kvrt_endpoint": endpoint}}
    return Request(request_id, prompt, sampling, None)


def run_step(scheduler: Scheduler, output: SchedulerOutput, token: int = 7) -> list[EngineCoreOutput]:
    """The worker's side of one step: every request that computed its last prompt token (or
    decoded) samples `token`; what the engine hands back to its caller."""
    sampled = []
    for request_id, tokens in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        if request.num_computed_tokens + tokens >= request.num_prompt_tokens:
            sampled.append(request_id)
    model_output = ModelRunnerOutput(
        req_ids=sampled,
        req_id_to_index={request_id: index for index, request_id in enumerate(sampled)},
        sampled_token_ids=[[token]] * len(sampled),
    )
    engine = scheduler.update_from_output(output, model_output)
    return [done for outputs in engine.values() for done in outputs.outputs]
