"""`kvrt bench vllm`: the vLLM connector's worker side loading into pages laid out as vLLM 0.32
lays them out on a GPU (FlashAttention's LBNHC: [layers, blocks, block_size, heads, K | V],
blocks of 16), a Llama-8B shape (32 layers, 8 KV heads of 128 in bf16: 128 KiB a token), each
row beside a device copy of the same bytes in the same run:

* one 4,096-token request (512 MiB), read as a stream (as a load a probe found) and fetched
  (as a load the prefill's word planned: `Consumer.fetch`);
* a step of 32 requests of 128 tokens (16 MiB each) from one producer, fetched.

(`--quick`: 512-token requests, fewer steps; on the host, `--device cpu`: 256-token requests
and steps of 32 requests of 32 tokens.)

A prefill process publishes each step's requests from its own pages (shuffled blocks) as
`save_kv_layer` and `wait_for_save` do, when this process asks for the step (so its memory is
reused from step to step, as in serving); this process then loads each into its pages (other
shuffled blocks) as vLLM's model runner calls the worker side: `start_load_kv`,
`wait_for_layer_load` for every layer, `wait_for_save`. The clock runs from `start_load_kv`
until the decode's stream has every page (a synchronize); the CPU time of the calling thread
(vLLM's model runner) over the same span is counted per request, and so is the CPU of
kvrt's threads on each side: the decode process's other threads over that span, the prefill
process's threads but its main one from the step's publish to the load's end. On one GPU
both processes share it (two CUDA contexts time-slice it); `--device cpu` runs the same on
the host (CPU pages of the same shape, over TCP), with a host copy as the reference.

Goals (of the copy's rate): the 512 MiB request >= 70%, the step >= 50%; per request in the
step, <= 50 us of the calling thread's CPU and <= 150 us of kvrt's threads' on each side.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from kvrt._bench._processes import from_child, join
from kvrt.integrations.vllm._scheduler import Load, Save, slots_of
from kvrt.integrations.vllm._worker import WorkerSettings, WorkerSide
from kvrt.integrations.vllm.layouts import CacheSpec, kv_cache_pools

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
ONE_GOAL: Final = 0.70
STEP_GOAL: Final = 0.50
"""Of the device copy's rate."""
CALLER_CPU_GOAL_US: Final = 50.0
"""CPU of vLLM's calling thread per request of a step."""
KVRT_CPU_GOAL_US: Final = 150.0
"""CPU of kvrt's threads per request of a step, each side."""

spawn = multiprocessing.get_context("spawn")


@dataclass(frozen=True, slots=True)
class Shape:
    """What a run moves: `requests` requests of `tokens` tokens, `per_step` of them a step."""

    tokens: int
    requests: int
    per_step: int
    seed: int

    @property
    def blocks(self) -> int:
        return self.per_step * -(-self.tokens // BLOCK_SIZE)


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


def request_tokens(shape: Shape, index: int) -> list[int]:
    return [1_000_000 * (shape.seed + index + 1) + token for token in range(shape.tokens)]


def step_blocks(shape: Shape, step: int) -> list[list[int]]:
    """Each request of a step's blocks, shuffled over the cache."""
    per_request = -(-shape.tokens // BLOCK_SIZE)
    order = random.Random(shape.seed + step).sample(range(shape.blocks), shape.blocks)
    return [order[index * per_request : (index + 1) * per_request] for index in range(shape.per_step)]


def run_prefill(
    shapes: list[Shape], device: str, transport: str | None, control: multiprocessing.connection.Connection
) -> None:
    """Send the endpoint; then publish each step the decode names (`(shape, step)`), as a
    prefill's steps do, and say so once its bytes are written; until told to stop."""
    side = WorkerSide(settings(produces=True, transport=transport))
    try:
        side.register(kv_cache_pools(vllm_cache(max(shape.blocks for shape in shapes), device), spec()))
        control.send(side.endpoint)
        serving_from = other_threads_cpu_s()
        while (asked := control.recv()) != "stop":
            if asked == "served":  # the CPU of kvrt's threads here since the step was published
                control.send(other_threads_cpu_s() - serving_from)
                continue
            shape_index, step = asked
            shape = shapes[shape_index]
            saves = [
                Save(f"{shape.seed}-{step}-{index}", request_tokens(shape, step * shape.per_step + index),
                     slots_of(blocks, BLOCK_SIZE, 0, shape.tokens))
                for index, blocks in enumerate(step_blocks(shape, step))
            ]  # fmt: skip
            for layer in range(LAYERS):
                side.save_layer(saves, layer)
            side.end_step()
            synchronize(device)  # the load is timed alone on the card
            serving_from = other_threads_cpu_s()
            control.send("published")
    finally:
        side.close()


def other_threads_cpu_s() -> float:
    """The CPU seconds of this process's threads but the calling one (kvrt's, here), so far."""
    return time.process_time() - time.thread_time()


def copy_ms(nbytes: int, device: str, repeats: int) -> float:
    """The median of a copy of `nbytes`, from one buffer to another (ms)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 2):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[2:])


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


@dataclass(frozen=True, slots=True)
class Measured:
    step_ms: list[float]
    caller_us: list[float]
    """Per step, the calling thread's CPU per request."""
    decode_threads_us: list[float]
    """Per step, the CPU of the decode process's other threads (kvrt's) per request."""
    prefill_threads_us: list[float]
    """Per step, the CPU of the prefill process's threads but its main one (kvrt's, serving
    the load) per request, from the step's publish to the load's end."""


def load_steps(
    decode: WorkerSide, endpoint: str, shape: Shape, device: str, *, published: bool,
    prefill: tuple[multiprocessing.connection.Connection, int],
) -> Measured:  # fmt: skip
    """Each step's requests published by the prefill (`prefill`: its control pipe and the
    shape's index there), then loaded and timed. As in serving, the producer's memory is
    reused from step to step: a decode maps the prefill's registered memory once, not for
    every step (all requests published ahead would put each step in memory mapped anew)."""
    control, shape_index = prefill
    blocks_total = shape.blocks
    times: list[float] = []
    caller: list[float] = []
    decode_threads: list[float] = []
    prefill_threads: list[float] = []
    for step in range(shape.requests // shape.per_step):
        control.send((shape_index, step))
        if from_child(control, 300) != "published":
            raise RuntimeError("the prefill process did not publish the step")
        loads = [
            Load(f"{shape.seed}-{step}-{index}", (endpoint,), request_tokens(shape, step * shape.per_step + index), 0,
                 slots_of(blocks, BLOCK_SIZE, 0, shape.tokens), blocks, published=published)
            for index, blocks in enumerate(step_blocks(shape, 10_000 + step))
        ]  # fmt: skip
        assert all(block < blocks_total for load in loads for block in load.block_ids)
        synchronize(device)
        started, cpu, others = time.perf_counter(), time.thread_time(), other_threads_cpu_s()
        decode.start_loads(loads)
        for layer in range(LAYERS):
            decode.wait_layer(layer)
        outcome = decode.end_step()
        cpu_s = time.thread_time() - cpu
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
        caller.append(cpu_s * 1e6 / shape.per_step)
        decode_threads.append((other_threads_cpu_s() - others) * 1e6 / shape.per_step)
        control.send("served")
        prefill_threads.append(float(from_child(control, 60)) * 1e6 / shape.per_step)
        if outcome.failed:
            raise RuntimeError(f"step {step} of {shape}: {len(outcome.failed)} loads failed")
    return Measured(times, caller, decode_threads, prefill_threads)


def main(args: argparse.Namespace) -> int:
    device = args.device or "cuda:0"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("kvrt bench vllm needs a GPU (or --device cpu)")
        return 1
    host = device == "cpu"
    quick = args.quick or host
    big = 256 if host else 512 if quick else 4096
    one_stream = Shape(big, 4 if quick else 10, 1, seed=0)
    one_fetch = Shape(big, 4 if quick else 10, 1, seed=100)
    step = Shape(32 if host else 128, 32 * (4 if quick else 8), 32, seed=200)
    shapes = [one_stream, one_fetch, step]
    warmup = 2
    transport = args.transport
    control, child = spawn.Pipe()
    prefill = spawn.Process(target=run_prefill, args=(shapes, device, transport, child), name="kvrt-bench-prefill")
    prefill.start()
    decode = WorkerSide(settings(produces=False, transport=transport))
    try:
        endpoint = from_child(control, 900)
        decode.register(kv_cache_pools(vllm_cache(max(shape.blocks for shape in shapes), device), spec()))
        runs = [
            ("one request, read as a stream", one_stream, False),
            ("one request, fetched", one_fetch, True),
            ("a step of 32 requests, fetched", step, True),
        ]
        measured = {}
        for name, shape, published in runs:
            prefill_of = (control, shapes.index(shape))
            measured[name] = (
                shape,
                load_steps(decode, endpoint, shape, device, published=published, prefill=prefill_of),
            )
        references = {name: copy_ms(_bytes(shape) * shape.per_step, device, 20) for name, shape, _ in runs}
    finally:
        decode.close()
        control.send("stop")
        join(prefill)
    print(f"the vLLM connector's worker side, Llama-8B-shaped pages (LBNHC, bf16), on {device}, "
          f"transport {decode.settings.transport or 'default'}")  # fmt: skip
    print("| what | bytes a step | p50 ms | GB/s | copy of the bytes ms | vs the copy | goal "
          "| caller CPU us/request | decode's kvrt threads us/request | prefill's kvrt threads us/request |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")  # fmt: skip
    rows: list[dict[str, Any]] = []
    met = True
    for name, (shape, result) in measured.items():
        nbytes = _bytes(shape) * shape.per_step
        kvrt_ms = statistics.median(result.step_ms[warmup:] or result.step_ms)
        caller_us, decode_us, prefill_us = (
            statistics.median(per_step[warmup:] or per_step)
            for per_step in (result.caller_us, result.decode_threads_us, result.prefill_threads_us)
        )
        share = references[name] / kvrt_ms
        goal = STEP_GOAL if shape.per_step > 1 else ONE_GOAL
        cpu_met = caller_us <= CALLER_CPU_GOAL_US and max(decode_us, prefill_us) <= KVRT_CPU_GOAL_US
        met = met and share >= goal and (shape.per_step == 1 or cpu_met)
        print(f"| {name} | {nbytes / (1 << 20):.0f} MiB | {kvrt_ms:.3f} | {nbytes / kvrt_ms / 1e6:.1f} | "
              f"{references[name]:.3f} | {share:.0%} | >= {goal:.0%} | {caller_us:.0f} | {decode_us:.0f} | "
              f"{prefill_us:.0f} |")  # fmt: skip
        rows.append({
            "what": name, "tokens": shape.tokens, "per_step": shape.per_step, "bytes_a_step": nbytes,
            "kvrt_ms": kvrt_ms, "copy_ms": references[name], "share": share, "goal": goal,
            "caller_cpu_us_per_request": caller_us, "decode_kvrt_threads_us_per_request": decode_us,
            "prefill_kvrt_threads_us_per_request": prefill_us, "step_ms": result.step_ms,
            "caller_us": result.caller_us, "decode_threads_us": result.decode_threads_us,
            "prefill_threads_us": result.prefill_threads_us,
        })  # fmt: skip
    print(f"CPU goals, per request of the step: the caller (vLLM's model runner) <= {CALLER_CPU_GOAL_US:.0f} us, "
          f"kvrt's threads <= {KVRT_CPU_GOAL_US:.0f} us each side")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "transport": transport, "rows": rows}, indent=2))
    return 0 if met or quick else 1


def _bytes(shape: Shape) -> int:
    return shape.tokens * LAYERS * KV_HEADS * 2 * HEAD_SIZE * 2
