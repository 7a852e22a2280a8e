"""`kvrt bench stream`: a simulated prefill on cuda:0 streamed layer by layer to cuda:1, beside
the same prefill followed by a whole-request transfer, and beside raw NCCL of one layer's
bytes, all in the same run.

The prefill: 32 layers, each one bf16 matmul of an 8B model's layer at 8k tokens
([8192 x 4096] @ [4096 x 53248]: the ~3.6 TFLOP of a Llama-3-8B layer's projections), whose
output's first columns are the layer's K and V (8192 tokens x 8 heads x 128, 32 MiB a layer).
The metric: from the last layer computed (a timestamp the producer's GPU
writes right after its matmul) to the last layer received (one the consumer's GPU writes on
the reader's stream once `layer(31)` made it wait for the landing). The two GPUs' clocks
(`%globaltimer`) are put on one by a ping-pong over NCCL before and after the rounds (its
drift is printed), so no host thread is in the measurement. Streaming: the reader is
waiting, `put_layer` after each layer's matmul. Whole request: the same prefill writes K and
V into one [32, 8192, 8, 128] pair, then `insert`, which a waiting `drop_select` takes; its
"received" is stamped when `drop_select` returned (the caller has the item then). Paged: the
same prefill writes each layer's K and V into token-major pools (as an engine's attention
does) and streams it out of them (`put_layer()` gathers it at the request's slots); the
reader writes each layer into its own pools as it lands (`open_stream(into=...)`), and its
"received" is stamped once the last layer is written there. The goal:
streaming within 1.5x one layer's transfer time, that is, raw NCCL send/recv of one
layer's bytes on the same pair, timed the same way (sender's GPU before the send, receiver's
GPU after the receive, the receive posted first), median of its repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing.connection
import statistics
import sys
from typing import Any, Final

import torch

from kvrt._bench._gpu_clock import Stamps, calibrate
from kvrt._bench._processes import from_child, join, start_producer
from kvrt._bench.nccl import _barrier, _raw_group, _warm_p2p

LAYERS: Final = 32
TOKENS: Final = 8192
HEADS: Final = 8
DIM: Final = 128
HIDDEN: Final = 4096
PROJECTIONS: Final = 53248
"""Output columns of the one matmul standing for a layer: 2 * 8192 * 4096 * 53248 flops is
what Llama-3-8B's q, k, v, o, gate, up and down projections cost at 8k tokens."""
KV_COLUMNS: Final = HEADS * DIM
LAYER_BYTES: Final = 2 * TOKENS * KV_COLUMNS * 2
RAW_REPEATS: Final = 21
ROUNDS: Final = 7
PRODUCER_DEVICE: Final = "cuda:0"
CONSUMER_DEVICE: Final = "cuda:1"
MODES: Final = ("stream", "paged", "whole")
SLOTS: Final = 2 * TOKENS
"""Slots of each token-major pool of the paged mode ([SLOTS, 2 * HEADS, DIM], one replica)."""
SENDER_HEAD_START_CYCLES: Final = 400_000
"""~0.2 ms of GPU sleep before a raw send's timestamp: the receiver has posted its receive by
then, so the raw time is the transfer's, not the receiver's host's."""


def _raw_sends(group: Any) -> list[int]:
    """Rank 0's side of the raw references: a timestamp before each send (one layer alone,
    RAW_REPEATS times; then 32 layers back to back, RAW_REPEATS times)."""
    one = torch.ones(LAYER_BYTES, dtype=torch.uint8, device=PRODUCER_DEVICE)
    layers = [torch.ones(LAYER_BYTES, dtype=torch.uint8, device=PRODUCER_DEVICE) for _ in range(LAYERS)]
    stamps = Stamps(PRODUCER_DEVICE, 2 * RAW_REPEATS)
    for case, buffers in enumerate(([one], layers)):
        for repeat in range(RAW_REPEATS):
            _barrier(group, PRODUCER_DEVICE)
            torch.cuda._sleep(SENDER_HEAD_START_CYCLES)  # type: ignore[no-untyped-call]
            stamps.stamp(case * RAW_REPEATS + repeat)
            for work in [group.send([buffer], 1, 0) for buffer in buffers]:
                work.wait()
            torch.cuda.synchronize(PRODUCER_DEVICE)
    return stamps.read()


def _raw_receives(group: Any) -> list[int]:
    """Rank 1's side: a timestamp after each receive."""
    one = torch.empty(LAYER_BYTES, dtype=torch.uint8, device=CONSUMER_DEVICE)
    layers = [torch.empty(LAYER_BYTES, dtype=torch.uint8, device=CONSUMER_DEVICE) for _ in range(LAYERS)]
    stamps = Stamps(CONSUMER_DEVICE, 2 * RAW_REPEATS)
    for case, buffers in enumerate(([one], layers)):
        for repeat in range(RAW_REPEATS):
            _barrier(group, CONSUMER_DEVICE)
            for work in [group.recv([buffer], 0, 0) for buffer in buffers]:
                work.wait()
            stamps.stamp(case * RAW_REPEATS + repeat)
            torch.cuda.synchronize(CONSUMER_DEVICE)
    return stamps.read()


def _pools(device: str) -> Any:
    from kvrt import Layout, PoolTable

    shape = (SLOTS, 2 * HEADS, DIM)
    return PoolTable([[[torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]]],
                     Layout.TOKEN_MAJOR)  # fmt: skip


def _producer(store_port: int, control: multiprocessing.connection.Connection) -> None:
    from kvrt._producer import Producer

    torch.cuda.set_device(PRODUCER_DEVICE)
    _, group = _raw_group(f"127.0.0.1:{store_port}", 0, PRODUCER_DEVICE)
    _warm_p2p(group, 0, PRODUCER_DEVICE)
    calibrate(group, 0, PRODUCER_DEVICE)
    control.send(_raw_sends(group))
    generator = torch.Generator(device=PRODUCER_DEVICE).manual_seed(0)
    activations = torch.randn((TOKENS, HIDDEN), generator=generator, device=PRODUCER_DEVICE).to(torch.bfloat16)
    weights = (torch.randn((HIDDEN, PROJECTIONS), generator=generator, device=PRODUCER_DEVICE) / 64).to(torch.bfloat16)
    keys = torch.empty((LAYERS, TOKENS, HEADS, DIM), dtype=torch.bfloat16, device=PRODUCER_DEVICE)
    values = torch.empty_like(keys)
    pools = _pools(PRODUCER_DEVICE)
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(1))[:TOKENS]  # as the scheduler has them
    rows = slots.to(PRODUCER_DEVICE)  # as the engine's attention has them
    stamps = Stamps(PRODUCER_DEVICE, 1)

    def layer_kv() -> tuple[torch.Tensor, torch.Tensor]:
        out = activations @ weights  # its first columns stand for the layer's K and V
        key, value = out[:, :KV_COLUMNS], out[:, KV_COLUMNS : 2 * KV_COLUMNS]
        return key.view(TOKENS, HEADS, DIM), value.view(TOKENS, HEADS, DIM)

    async def main() -> None:
        async with Producer(device=PRODUCER_DEVICE, buffer_bytes=1 << 40) as producer:
            producer.register_pools(pools)
            control.send(producer.endpoint)
            while (command := await asyncio.to_thread(control.recv)) != "stop":
                mode, index = command
                tokens = torch.arange(TOKENS) + index * TOKENS
                torch.cuda.synchronize(PRODUCER_DEVICE)
                started = torch.cuda.Event(enable_timing=True)
                computed = torch.cuda.Event(enable_timing=True)
                copied = torch.cuda.Event(enable_timing=True)
                started.record()
                if mode == "stream":
                    stream = await producer.open_stream(tokens, layers=LAYERS)
                    for layer in range(LAYERS):
                        key, value = layer_kv()
                        if layer == LAYERS - 1:
                            stamps.stamp(0)
                            computed.record()
                        await stream.put_layer(key, value)
                    copied.record()  # after put_layer's copy of the last layer, on the same stream
                    await stream.finish()
                elif mode == "paged":
                    stream = await producer.open_stream(tokens, slots=slots)
                    for layer in range(LAYERS):
                        key, value = layer_kv()
                        pool = pools.pools[0][0][layer]  # what the engine's attention writes
                        pool[rows, :HEADS] = key
                        pool[rows, HEADS:] = value
                        if layer == LAYERS - 1:
                            stamps.stamp(0)
                            computed.record()
                        await stream.put_layer()
                    copied.record()  # after put_layer's gather of the last layer
                    await stream.finish()
                else:
                    for layer in range(LAYERS):
                        key, value = layer_kv()
                        keys[layer].copy_(key)
                        values[layer].copy_(value)
                    stamps.stamp(0)
                    computed.record()
                    await producer.insert(tokens, None, keys, values, None)
                    copied.record()  # after insert's copy into the item's buffer
                (computed_ns,) = await asyncio.to_thread(stamps.read)
                control.send((computed_ns, started.elapsed_time(computed) / 1e3, computed.elapsed_time(copied) / 1e3))

    asyncio.run(main())
    calibrate(group, 0, PRODUCER_DEVICE)  # again, for the drift


def _peer_copy_one_layer() -> float:
    """One layer's bytes copied from cuda:0 to cuda:1 by the copy engines (`copy_` on the
    consumer's stream), timed by events around it on that stream: one layer's transfer time
    over the path cuda_ipc takes, median of RAW_REPEATS after a warm-up."""
    source = torch.ones(LAYER_BYTES, dtype=torch.uint8, device=PRODUCER_DEVICE)
    target = torch.empty(LAYER_BYTES, dtype=torch.uint8, device=CONSUMER_DEVICE)
    torch.cuda.synchronize(PRODUCER_DEVICE)
    seconds = []
    with torch.cuda.device(CONSUMER_DEVICE):
        for _ in range(RAW_REPEATS + 1):
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            target.copy_(source, non_blocking=True)
            ended.record()
            ended.synchronize()
            seconds.append(began.elapsed_time(ended) / 1e3)
    return float(statistics.median(seconds[1:]))


def main(args: argparse.Namespace) -> int:
    from kvrt import _messages as m
    from kvrt._consumer import Consumer

    if torch.cuda.device_count() < 2:
        print("kvrt bench stream needs two CUDA devices", file=sys.stderr)
        return 1
    transport = getattr(args, "transport", None) or "nccl"
    torch.cuda.set_device(CONSUMER_DEVICE)
    store, port, control, producer = start_producer(_producer, "kvrt-bench-stream-producer")
    latencies: dict[str, list[float]] = {mode: [] for mode in MODES}
    copies: dict[str, list[float]] = {mode: [] for mode in MODES}
    prefills: list[float] = []
    try:
        _, group = _raw_group(f"127.0.0.1:{port}", 1, CONSUMER_DEVICE)
        _warm_p2p(group, 1, CONSUMER_DEVICE)
        offset = calibrate(group, 1, CONSUMER_DEVICE)
        assert offset is not None
        received_raw = _raw_receives(group)
        sent_raw = from_child(control)
        raw = [(received - offset - sent) / 1e9 for sent, received in zip(sent_raw, received_raw, strict=True)]
        one_layer_s = statistics.median(raw[:RAW_REPEATS])
        per_layer_s = statistics.median(raw[RAW_REPEATS:]) / LAYERS
        peer_one_layer_s = _peer_copy_one_layer() if transport == "cuda_ipc" else None
        endpoint = from_child(control)
        stamps = Stamps(CONSUMER_DEVICE, 1)
        into = _pools(CONSUMER_DEVICE)
        into_slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(2))[:TOKENS]

        async def run() -> None:
            async with Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer:
                assert consumer.transports == {endpoint: transport}, consumer.transports
                link = consumer.link_for_tests()
                for round_index in range(ROUNDS + 1):  # the first round warms both paths up
                    for mode_index, mode in enumerate(MODES):
                        index = len(MODES) * round_index + mode_index
                        tokens = torch.arange(TOKENS) + index * TOKENS
                        if mode == "stream":
                            waiting: asyncio.Task[Any] = asyncio.create_task(consumer.open_stream(tokens, timeout=60))
                        elif mode == "paged":
                            waiting = asyncio.create_task(
                                consumer.open_stream(tokens, timeout=60, into=into, slots=into_slots)
                            )
                        else:
                            waiting = asyncio.create_task(consumer.drop_select(tokens, timeout=60))
                        await asyncio.sleep(0)  # the request leaves; the health check's answer proves it read
                        await link.call(lambda request_id: m.Health(request_id=request_id))
                        control.send((mode, index))
                        got = await waiting
                        if got is None:
                            raise RuntimeError(f"{mode}: the prefill's KV did not arrive")
                        if mode != "whole":
                            for layer in range(LAYERS):
                                await got.layer(layer)  # the current stream waits for each landing (write)
                        stamps.stamp(0)
                        (received_ns,) = await asyncio.to_thread(stamps.read)
                        if mode != "whole":
                            await got.finished()
                        del got
                        computed_ns, prefill_s, copy_s = await asyncio.to_thread(from_child, control)
                        if round_index:
                            latencies[mode].append((received_ns - offset - computed_ns) / 1e9)
                            copies[mode].append(copy_s)
                            prefills.append(prefill_s)

        asyncio.run(run())
    finally:
        with contextlib.suppress(OSError):
            control.send("stop")
    try:
        drift = calibrate(group, 1, CONSUMER_DEVICE)
    finally:
        join(producer)
        del store
    assert drift is not None
    result: dict[str, Any] = {
        "layer_bytes": LAYER_BYTES,
        "raw_one_layer_s": one_layer_s,
        "raw_per_layer_back_to_back_s": per_layer_s,
        "prefill_s": statistics.median(prefills),
        "clock_offset_ns": offset,
        "clock_drift_ns": drift - offset,
    }
    for mode, seconds in latencies.items():
        result[mode] = {"median_s": statistics.median(seconds), "best_s": min(seconds), "runs_s": seconds}
        result[mode]["layers"] = result[mode]["median_s"] / one_layer_s
        result[mode]["copy_s"] = statistics.median(copies[mode])
        if peer_one_layer_s is not None:
            result[mode]["peer_layers"] = result[mode]["median_s"] / peer_one_layer_s
    if peer_one_layer_s is not None:
        result["peer_one_layer_s"] = peer_one_layer_s
    print(f"\nkvrt bench stream — a simulated prefill on {PRODUCER_DEVICE} ({LAYERS} layers, one "
          f"[{TOKENS}x{HIDDEN}] @ [{HIDDEN}x{PROJECTIONS}] bf16 matmul each), read on {CONSUMER_DEVICE}; "
          f"KV {LAYER_BYTES >> 20} MiB a layer ({TOKENS} tokens x {HEADS} heads x {DIM}, K and V, bf16); "
          f"kvrt over {transport}")  # fmt: skip
    print(f"prefill, first matmul to last computed (GPU):  {result['prefill_s'] * 1e3:8.2f} ms (median)")
    print(f"GPU clocks: cuda:1 - cuda:0 = {offset / 1e3:.1f} us, moved {(drift - offset) / 1e3:+.1f} us over the run")
    print(f"raw NCCL, one layer's bytes alone:             {one_layer_s * 1e3:8.3f} ms  (the goal's unit)")
    print(f"raw NCCL, {LAYERS} layers back to back, per layer:  {per_layer_s * 1e3:8.3f} ms")
    if peer_one_layer_s is not None:
        print(f"peer copy (copy engines), one layer's bytes:   {peer_one_layer_s * 1e3:8.3f} ms  "
              "(cuda_ipc's own one-layer time)")  # fmt: skip
    print(f"from the last layer computed to the last layer received, median of {ROUNDS} (best):")
    for mode, label, goal in (
        ("stream", "streaming (put_layer per layer)", "goal <= 1.5x"),
        ("paged", "streaming, pools to pools", ""),
        ("whole", "whole request after the prefill", ""),
    ):
        row = result[mode]
        against_peer = f" ({row['peer_layers']:4.2f}x a peer copy of one)" if "peer_layers" in row else ""
        print(f"  {label:34} {row['median_s'] * 1e3:8.3f} ms ({row['best_s'] * 1e3:6.3f}) = "
              f"{row['layers']:5.2f}x one layer{against_peer}  {goal}")  # fmt: skip
    print(f"of which the producer's copy after the last layer (GPU events): put_layer "
          f"{result['stream']['copy_s'] * 1e3:.3f} ms, its gather from the pools {result['paged']['copy_s'] * 1e3:.3f} "
          f"ms, insert {result['whole']['copy_s'] * 1e3:.3f} ms")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0
