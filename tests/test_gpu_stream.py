"""Layer-wise streams between two GPUs over NCCL (prefill on cuda:0, decode on cuda:1): each
layer's transfer starts when the prefill's stream wrote it, and the reader's stream waits for
its landing; no host waits for either.

Skipped without two CUDA devices, except cuda_ipc's cases that hold on one GPU, which run
there with both processes on cuda:0 (`tests/_gpus.py`); `tools/gpu_check.sh` runs them on a
GPU host.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest
import torch

import kvrt
from tests._checks import caught_up, same_bits
from tests._gpu_processes import (
    GPU_CYCLES_PER_MS,
    STREAM_SLOTS,
    kv_tokens,
    paged_layer_pools,
    paged_stream_request,
    run_gpu_streamer,
    stream_layer_kv,
    zeros,
)
from tests._gpus import (
    CONSUMER_DEVICE,
    PRODUCER_DEVICE,
    over_each_gpu_transport,
    over_each_gpu_transport_on_two_gpus,
)
from tests._processes import child_process

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.timeout(120, method="thread")]

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "uint8"]


def streamer(heartbeat_s: float = 1.0) -> Any:
    return child_process(run_gpu_streamer, (PRODUCER_DEVICE, heartbeat_s), "GPU streamer")


async def answer(control: Any) -> Any:
    assert await asyncio.to_thread(control.poll, 60), "the streamer did not answer"
    return control.recv()


async def opened_and_waiting(consumer: kvrt.Consumer, tokens: torch.Tensor, **into: Any) -> asyncio.Task[Any]:
    """`open_stream` started, and waiting on the producer (a round trip on the same link after
    its request proves that the producer read it)."""
    opening = asyncio.create_task(consumer.open_stream(tokens, timeout=30, **into))
    await asyncio.sleep(0)
    await caught_up(consumer)
    return opening


async def held_by_the_producer(consumer: kvrt.Consumer, control: Any) -> Any:
    """(items, in flight) on the producer once it handled all this consumer sent (a round trip)."""
    await caught_up(consumer)
    control.send("stats")
    return await answer(control)


async def landed_on(side: torch.cuda.Stream, layer: asyncio.Task[Any]) -> bool:
    """Whether a layer asked for with `layer(i, stream=side)` has landed by now. Over NCCL the
    layer is handed out at once and `side` waits for its landing on the GPU; over cuda_ipc it
    is handed out only once the producer wrote it (so not handed out: not landed). The task
    had its first round already (the caller awaited something since creating it)."""
    if not layer.done():
        return False
    now = torch.cuda.Event()
    now.record(side)
    return bool(now.query())


@over_each_gpu_transport_on_two_gpus
async def test_every_dtype_streams_bit_for_bit_and_layer_0_lands_while_the_last_is_still_computed(
    transport: str,
) -> None:
    torch.cuda.set_device(CONSUMER_DEVICE)
    layers, tokens = 4, 512
    async with (
        streamer() as (endpoint, _, control),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer,
    ):
        for index, dtype_name in enumerate(DTYPES):
            opening = await opened_and_waiting(consumer, kv_tokens(index, tokens))
            work_ms = 100 if index == 0 else 0  # GPU work before each layer (the first dtype only)
            control.send(("stream", index, dtype_name, layers, tokens, work_ms, None))
            reader = await opening
            assert reader is not None and reader.layers == layers
            landed = await reader.layer_event(0)
            assert isinstance(landed, torch.cuda.Event)
            first = await reader.layer(0)  # the current stream now waits for layer 0's landing
            first_landed = torch.cuda.Event()
            first_landed.record()
            side = torch.cuda.Stream()
            last_layer = asyncio.create_task(reader.layer(layers - 1, stream=side))
            await asyncio.to_thread(first_landed.synchronize)
            if work_ms:  # three more layers of 100 ms of prefill work were still to run
                assert not await landed_on(side, last_layer)
            last = await last_layer
            arrived = [first, *[await reader.layer(layer) for layer in range(1, layers - 1)], last]
            hidden = await reader.finished()
            await asyncio.to_thread(side.synchronize)
            await asyncio.to_thread(torch.cuda.current_stream().synchronize)
            for layer, (key, value) in enumerate(arrived):
                want_key, want_value = stream_layer_kv(index, layer, tokens, getattr(torch, dtype_name))
                assert key.device == torch.device(CONSUMER_DEVICE)
                assert same_bits(key, want_key) and same_bits(value, want_value), (dtype_name, layer)
            assert hidden is not None and torch.equal(hidden.cpu(), torch.full((tokens, 4), float(index)))
            assert await answer(control) == "streamed"
            assert await held_by_the_producer(consumer, control) == (0, 0)


@over_each_gpu_transport
async def test_a_prefill_aborted_midway_fails_the_reader_and_the_pair_stays_in_step(transport: str) -> None:
    torch.cuda.set_device(CONSUMER_DEVICE)
    async with (
        streamer() as (endpoint, _, control),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer,
    ):
        opening = await opened_and_waiting(consumer, kv_tokens(0, 256))
        control.send(("stream", 0, "bfloat16", 4, 256, 20, 2))  # aborts after 2 of 4 layers
        reader = await opening
        assert reader is not None
        with pytest.raises(kvrt.StreamAbortedError, match="ran out of memory"):
            await reader.layer(3)
        with pytest.raises(kvrt.StreamAbortedError):
            await reader.layer(0)  # what arrived is void
        assert await answer(control) == "streamed"
        assert await held_by_the_producer(consumer, control) == (0, 0)
        # The two layers' bytes were received all the same: the next stream reads right.
        opening = await opened_and_waiting(consumer, kv_tokens(1, 256))
        control.send(("stream", 1, "bfloat16", 2, 256, 0, None))
        reader = await opening
        assert reader is not None
        _, value = await reader.layer(1)
        await reader.finished()
        assert same_bits(value, stream_layer_kv(1, 1, 256, torch.bfloat16)[1])
        assert await answer(control) == "streamed"


async def test_a_killed_prefill_fails_the_reader_within_the_heartbeat_timeout() -> None:
    torch.cuda.set_device(CONSUMER_DEVICE)
    heartbeat_s = 0.25
    async with (
        streamer(heartbeat_s) as (endpoint, process, control),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, heartbeat_s=heartbeat_s, transport="nccl") as consumer,
    ):
        opening = await opened_and_waiting(consumer, kv_tokens(0, 256))
        control.send(("stream", 0, "bfloat16", 4, 256, 2000, None))  # 2 s of GPU work a layer
        reader = await opening
        assert reader is not None
        await reader.layer(0)
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(kvrt.PeerLostError):
            await reader.finished()
        assert time.monotonic() - killed_at < 4 * heartbeat_s + 1.0


async def test_put_layer_finish_and_insert_never_wait_for_the_prefills_stream() -> None:
    torch.cuda.set_device(PRODUCER_DEVICE)
    tokens = kv_tokens(0, 256)  # on the host, as an engine's scheduler holds them
    key, value = (tensor.to(PRODUCER_DEVICE) for tensor in stream_layer_kv(0, 0, 256, torch.bfloat16))
    async with kvrt.Producer(device=PRODUCER_DEVICE) as producer:
        # Each attempt twice; the first, with no work queued, only warms up: CUDA loads a
        # kernel's module at its first launch, and that waits for the device.
        for index, attempt in enumerate(["stream", "insert"] * 2):
            await asyncio.to_thread(torch.cuda.synchronize, PRODUCER_DEVICE)  # the last second of work
            if index >= 2:
                torch.cuda._sleep(1000 * GPU_CYCLES_PER_MS)  # a second of prefill work still queued
            started = time.monotonic()
            if attempt == "stream":
                stream = await producer.open_stream(tokens + index, layers=2)
                for _ in range(2):
                    await stream.put_layer(key, value)
                await stream.finish(torch.zeros(256, 4, device=PRODUCER_DEVICE))
            else:
                await producer.insert(tokens + index, None, key[None], value[None])
            took = time.monotonic() - started
            if index >= 2:
                assert not torch.cuda.current_stream().query(), attempt  # the work is still running
                assert took < 0.3, (attempt, took)
        assert producer.stats().items == 4
        await asyncio.to_thread(torch.cuda.synchronize, PRODUCER_DEVICE)


@over_each_gpu_transport
@pytest.mark.parametrize("published", [False, True], ids=["streamed-from-the-pools", "published-then-streamed"])
async def test_a_paged_prefill_lands_in_the_readers_pools_layer_by_layer_bit_for_bit(
    published: bool, transport: str
) -> None:
    """dp=4 token-major pools on the prefill, block pools with two replicas on the reader, which
    writes each layer into replica 1 as it lands. A published item read as a stream waits for
    its gathers (its layers once went with an event recorded before them)."""
    from kvrt import Layout, PoolTable

    torch.cuda.set_device(CONSUMER_DEVICE)
    layers, tokens = 4, 1024
    into_slots = torch.randperm(STREAM_SLOTS, generator=torch.Generator().manual_seed(99))[:tokens]
    async with (
        streamer() as (endpoint, _, control),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer,
    ):
        # The first round compiles the gather and scatter kernels (about a second each, in kvrt
        # threads); the second, the same specializations, must land layer 0 while the prefill
        # still computes the last.
        for index, dtype_name in enumerate(["bfloat16", "bfloat16", "float8_e4m3fn", "float32"]):
            dtype = getattr(torch, dtype_name)
            shape = (2, STREAM_SLOTS // 16, 16, 8, 128)
            pools = [[[zeros(shape, dtype, CONSUMER_DEVICE) for _ in range(layers)]] for _ in range(2)]
            target = PoolTable(pools, Layout.BLOCK)
            into = {"into": target, "slots": into_slots, "replica": 1}
            opening = await opened_and_waiting(consumer, kv_tokens(index, tokens), **into)
            work_ms = 100 if index == 1 else 20  # GPU work before each layer
            control.send(("paged", index, dtype_name, layers, tokens, work_ms, published))
            reader = await opening
            assert reader is not None and reader.layers == layers
            await reader.layer(0)  # the current stream now waits for layer 0's write into the pools
            first_written = torch.cuda.Event()
            first_written.record()
            side = torch.cuda.Stream()
            last_layer = asyncio.create_task(reader.layer(layers - 1, stream=side))
            await asyncio.to_thread(first_written.synchronize)
            if index == 1 and not published:  # three more layers of 100 ms of prefill work were still to run
                assert not await landed_on(side, last_layer)
            await last_layer
            await reader.finished()
            await asyncio.to_thread(side.synchronize)
            await asyncio.to_thread(landed_as_written, target, index, dtype, layers, tokens, into_slots)
            assert await answer(control) == "streamed"
            assert await held_by_the_producer(consumer, control) == (0, 0)


def landed_as_written(
    target: Any, index: int, dtype: torch.dtype, layers: int, tokens: int, into_slots: torch.Tensor
) -> None:
    """Replica 1 of `target` holds, at `into_slots`, every layer the prefill of stream `index`
    wrote at its slots; replica 0 holds nothing. (Bytes: fp8 has no CPU indexing to rely on.)"""
    replica, slots = paged_stream_request(index, tokens)
    row = 128 * dtype.itemsize
    for layer in range(layers):
        written = torch.stack([pool.view(torch.uint8) for pool in paged_layer_pools(index, layer, dtype)])
        source = written[replica, slots]  # [tokens, 16 (K heads, then V heads), row]
        landed = target.pools[1][0][layer].cpu().view(torch.uint8).view(2, STREAM_SLOTS, 8, row)[:, into_slots]
        assert torch.equal(landed[0], source[:, :8]), (str(dtype), layer, "key")
        assert torch.equal(landed[1], source[:, 8:]), (str(dtype), layer, "value")
    assert not any(pool.view(torch.uint8).any() for pool in target.pools[0][0])


async def test_a_published_item_streams_to_a_tcp_reader_while_the_prefills_stream_is_busy() -> None:
    """The stream's start (its tokens) and its layers are read back from the GPU in a kvrt
    thread, on a stream of kvrt's own, after the events that wrote them: neither the loop
    nor the reader waits for work the prefill queued after `publish` on the default stream."""
    from kvrt import Layout, PoolTable

    torch.cuda.set_device(PRODUCER_DEVICE)
    layers, tokens = 2, 256
    dtype = torch.bfloat16
    # Off the loop: building the pools took 0.52 s once (the loop guard's limit is 0.5 s).
    one_replica = await asyncio.to_thread(
        lambda: [paged_layer_pools(7, layer, dtype)[0].to(PRODUCER_DEVICE) for layer in range(layers)]
    )
    table = PoolTable([[one_replica]], Layout.TOKEN_MAJOR)
    slots = paged_stream_request(7, tokens)[1]
    async with (
        kvrt.Producer(device=PRODUCER_DEVICE) as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="tcp") as consumer,
    ):
        producer.register_pools(table)
        for index in range(2):  # the first round warms up: the first launches compile, modules load
            input_tokens = kv_tokens(100 + index, tokens)
            await producer.publish(input_tokens, slots)
            if index:
                torch.cuda._sleep(1000 * GPU_CYCLES_PER_MS)  # a second of prefill work, queued after
            started = time.monotonic()
            reader = await consumer.open_stream(input_tokens, timeout=10)
            assert reader is not None
            await reader.finished()
            took = time.monotonic() - started
            if index:
                assert not torch.cuda.current_stream().query()  # the work is still running
                assert took < 0.5, took
            await asyncio.to_thread(torch.cuda.synchronize, PRODUCER_DEVICE)  # before this test reads the pools
            for layer in range(layers):
                key, value = await reader.layer(layer)
                rows = table.pools[0][0][layer][slots.to(PRODUCER_DEVICE)].cpu()
                assert same_bits(key, rows[:, :8].contiguous()) and same_bits(value, rows[:, 8:].contiguous())
