"""`kvrt bench vllm` on a host with a GPU: one 4,096-token Llama-8B-shaped request (32 layers,
8 KV heads of 128 in bf16: 128 KiB a token, 512 MiB) through the vLLM connector's GPU path,
beside a device copy of the same bytes in the same run.

* prefill (a process of its own on cuda:0): the connector's worker side over a KV cache laid
  out as vLLM 0.32's FlashAttention default (LBNHC: [layers, blocks, block_size, heads,
  K | V], blocks of 16), publishes each request layer by layer from its pages (in shuffled
  blocks), as a prefill's forward pass does (`save_kv_layer`, `wait_for_save`);
* decode (this process, cuda:0): the connector's worker side loads each request into its own
  cache of that layout, at other shuffled blocks: `start_loads`, `wait_layer` for every layer,
  `end_step`, as vLLM's model runner calls them. The clock runs from `start_loads` until the
  decode's stream has every page (a synchronize);
* reference: a device copy (`copy_`) of the same 512 MiB on the decode's GPU.

Goal: the load at >= 70% of the copy's rate. Both processes share the one GPU (two CUDA
contexts time-slice it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import random
import statistics
import time
from pathlib import Path
from typing import Any, Final

import torch

from kvrt._bench._processes import from_child, join
from kvrt.integrations.vllm._scheduler import Load, Save, slots_of
from kvrt.integrations.vllm._worker import WorkerSettings, WorkerSide
from kvrt.integrations.vllm.layouts import CacheSpec, kv_cache_pools

DEVICE: Final = "cuda:0"
LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
GOAL: Final = 0.70
"""Of the device copy's rate."""

spawn = multiprocessing.get_context("spawn")


def vllm_cache(blocks: int, device: str) -> list[torch.Tensor]:
    """Per layer, the [blocks, heads, block_size, 2*head_size] view vLLM 0.32 makes of its
    LBNHC allocation ([layers, blocks, block_size, heads, K | V])."""
    raw = torch.empty((LAYERS, blocks, BLOCK_SIZE, KV_HEADS, 2 * HEAD_SIZE), dtype=torch.bfloat16, device=device)
    raw.normal_()
    return [raw[layer].permute(0, 2, 1, 3) for layer in range(LAYERS)]


def spec() -> CacheSpec:
    return CacheSpec(
        block_size=BLOCK_SIZE, kv_heads=KV_HEADS, head_size=HEAD_SIZE, head_size_v=HEAD_SIZE, dtype=torch.bfloat16
    )


def settings(*, produces: bool, transport: str | None) -> WorkerSettings:
    return WorkerSettings(
        produces=produces, consumes=not produces, bind="tcp://127.0.0.1:0" if produces else None,
        buffer_bytes=1 << 40, item_ttl_s=None, connect_timeout_s=30.0, total_heads=KV_HEADS, transport=transport,
    )  # fmt: skip


def request_tokens(index: int, tokens: int) -> list[int]:
    return [1_000_000 * (index + 1) + token for token in range(tokens)]


def run_prefill(
    tokens: int, requests: int, transport: str | None, control: multiprocessing.connection.Connection
) -> None:
    """Publish `requests` requests of `tokens` tokens; send the endpoint; serve until told."""
    blocks = 2 * -(-tokens // BLOCK_SIZE)
    side = WorkerSide(settings(produces=True, transport=transport))
    try:
        side.register(kv_cache_pools(vllm_cache(blocks, DEVICE), spec()))
        for index in range(requests):
            block_ids = random.Random(index).sample(range(blocks), -(-tokens // BLOCK_SIZE))
            save = Save(f"r{index}", request_tokens(index, tokens), slots_of(block_ids, BLOCK_SIZE, 0, tokens))
            for layer in range(LAYERS):
                side.save_layer([save], layer)
            side.end_step()
        torch.cuda.synchronize(DEVICE)
        control.send(side.endpoint)
        control.recv()
    finally:
        side.close()


def copy_ms(nbytes: int, repeats: int) -> float:
    """The median of a device copy of `nbytes`, from one buffer to another (ms)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_()
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)))
    return statistics.median(times[2:])


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("kvrt bench vllm needs a GPU")
        return 1
    tokens = 512 if args.quick else 4096
    requests = 4 if args.quick else 10
    warmup = 2
    transport = args.transport
    nbytes = tokens * LAYERS * KV_HEADS * 2 * HEAD_SIZE * 2
    control, child = spawn.Pipe()
    prefill = spawn.Process(target=run_prefill, args=(tokens, requests, transport, child), name="kvrt-bench-prefill")
    prefill.start()
    decode = WorkerSide(settings(produces=False, transport=transport))
    blocks = 2 * -(-tokens // BLOCK_SIZE)
    try:
        endpoint = from_child(control, 600)
        decode.register(kv_cache_pools(vllm_cache(blocks, DEVICE), spec()))
        times = []
        for index in range(requests):
            block_ids = random.Random(1000 + index).sample(range(blocks), -(-tokens // BLOCK_SIZE))
            load = Load(
                f"r{index}", (endpoint,), request_tokens(index, tokens), 0, slots_of(block_ids, BLOCK_SIZE, 0, tokens),
                block_ids,
            )  # fmt: skip
            torch.cuda.synchronize(DEVICE)
            started = time.perf_counter()
            decode.start_loads([load])
            for layer in range(LAYERS):
                decode.wait_layer(layer)
            outcome = decode.end_step()
            torch.cuda.synchronize(DEVICE)
            times.append((time.perf_counter() - started) * 1e3)
            if outcome.failed:
                raise RuntimeError(f"request {index} failed to load")
        kvrt_ms = statistics.median(times[warmup:])
        reference_ms = copy_ms(nbytes, 20)
    finally:
        decode.close()
        control.send("stop")
        join(prefill)
    share = reference_ms / kvrt_ms
    mib = nbytes / (1 << 20)
    print(f"one {tokens}-token Llama-8B-shaped request ({mib:.0f} MiB over {LAYERS} layers), one GPU, "
          f"transport {decode.settings.transport or 'default (cuda_ipc)'}")  # fmt: skip
    print("| path | p50 ms | GB/s | vs the copy | goal | met |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| device copy of the same bytes | {reference_ms:.3f} | {nbytes / reference_ms / 1e6:.0f} | 100% | | |")
    met = share >= GOAL
    print(f"| connector load (layer by layer) | {kvrt_ms:.3f} | {nbytes / kvrt_ms / 1e6:.0f} | {share:.0%} "
          f"| >= {GOAL:.0%} | {'met' if met else 'not met'} |")  # fmt: skip
    print(f"all load times (ms): {' '.join(f'{value:.2f}' for value in times)}")
    if args.json:
        record: dict[str, Any] = {
            "tokens": tokens, "bytes": nbytes, "layers": LAYERS, "copy_ms": reference_ms, "kvrt_ms": kvrt_ms,
            "kvrt_times_ms": times, "share": share, "goal": GOAL, "transport": transport,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0 if met or args.quick else 1
