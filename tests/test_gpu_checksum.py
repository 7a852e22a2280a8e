"""KV integrity on GPUs: a producer on a GPU with `checksum=True` checksums each item on its
GPU (`kvrt.kernels.checksum`) before the item's first delivery leaves, and the consumer checks
what landed before its caller sees it: over cuda_ipc on its GPU, over TCP on the host with the
kernel's reference. A bit flipped where the bytes land is detected every time, the item goes
back whole and is intact on the next take, and the failure is counted.

The flip: the consumer's cuda_ipc receive XORs one byte of the payload it landed, after the
copies and before the check (the producer's memory is never touched), once
(`tests._checks.flip_one_landed_byte`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import kvrt
from kvrt.transports.cuda_ipc import CudaIpcReceiver
from tests._checks import caught_up, flip_one_landed_byte, same_bits
from tests._gpu_processes import (
    PULL_LAYERS,
    kv_item,
    kv_tokens,
    pull_request,
    run_gpu_producer,
    run_gpu_publisher,
    run_gpu_streamer,
    stream_layer_kv,
)
from tests._gpus import CONSUMER_DEVICE, PRODUCER_DEVICE, one_gpu
from tests._processes import child_process

pytestmark = [one_gpu, pytest.mark.timeout(120, method="thread")]


@pytest.mark.parametrize("checksum", [True, False], ids=["checked", "unchecked"])
async def test_a_byte_flipped_where_a_cuda_ipc_item_landed_fails_the_call_and_the_item_comes_whole_next(
    monkeypatch: pytest.MonkeyPatch, checksum: bool
) -> None:
    monkeypatch.setenv("KVRT_CHECKSUM", "1" if checksum else "0")  # the producer's process reads it
    input_tokens, key, value, hidden = kv_item(0, 300, torch.bfloat16, CONSUMER_DEVICE)
    async with (
        child_process(run_gpu_producer, (PRODUCER_DEVICE, None, 1.0, [(0, 300, "bfloat16")]), "GPU producer") as (
            endpoint, _, _,
        ),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE) as consumer,
    ):  # fmt: skip
        assert consumer.transports == {endpoint: "cuda_ipc"}
        flipped = flip_one_landed_byte(monkeypatch, CudaIpcReceiver)
        if not checksum:  # what the check is for: the flip does damage what the caller gets
            item = await consumer.drop_select(input_tokens, None)
            assert flipped and item is not None
            assert not (same_bits(item.key, key) and same_bits(item.value, value) and same_bits(item.hidden, hidden))
            return
        with pytest.raises(kvrt.IntegrityError, match="GPU"):
            await consumer.drop_select(input_tokens, None)
        assert flipped and consumer.metrics.integrity_failures == 1
        item = await consumer.drop_select(input_tokens, None)
        assert item is not None and same_bits(item.key, key) and same_bits(item.value, value)
        assert same_bits(item.hidden, hidden)
        assert await consumer.drop_select(input_tokens, None) is None  # taken once
        assert consumer.metrics.integrity_failures == 1


async def test_a_byte_flipped_in_a_pull_over_cuda_ipc_fails_the_pull_and_the_retry_lands_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvrt import Layout, PoolTable

    monkeypatch.setenv("KVRT_CHECKSUM", "1")
    torch.cuda.set_device(CONSUMER_DEVICE)
    publisher = (PRODUCER_DEVICE, 5, 16 << 20, False, True, None)  # chunks of layers, indexes on the host
    async with child_process(run_gpu_publisher, publisher, "GPU publisher") as (endpoint, _, _):
        pools, tokens, replica, slots = await asyncio.to_thread(pull_request, 5)  # 1 GiB: no work for the loop
        target = PoolTable(
            [[[torch.zeros(pools[0][0][0].shape, dtype=torch.bfloat16, device=CONSUMER_DEVICE)
               for _ in range(PULL_LAYERS)]]],
            Layout.TOKEN_MAJOR,
        )  # fmt: skip
        into_slots = torch.arange(tokens.numel())
        async with kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE) as consumer:
            assert consumer.transports == {endpoint: "cuda_ipc"}
            flipped = flip_one_landed_byte(monkeypatch, CudaIpcReceiver)
            with pytest.raises(kvrt.IntegrityError):
                await consumer.pull(tokens, into=target, slots=into_slots, timeout=30)
            assert flipped and consumer.metrics.integrity_failures == 1
            item = await consumer.pull(tokens, into=target, slots=into_slots, timeout=30)
            assert item is not None and item.matched == tokens.numel()

        def landed_bit_for_bit() -> bool:  # in a thread: reading back and comparing is no work for the loop
            torch.cuda.set_device(CONSUMER_DEVICE)
            torch.cuda.synchronize(CONSUMER_DEVICE)
            for layer in range(PULL_LAYERS):
                want = torch.empty_like(pools[0][0][layer][: tokens.numel()])
                for r in range(len(pools)):
                    chosen = (replica == r).nonzero().flatten()
                    want[chosen] = pools[r][0][layer][slots[chosen]]
                if not same_bits(target.pools[0][0][layer][: tokens.numel()].cpu(), want):
                    return False
            return True

        assert await asyncio.to_thread(landed_bit_for_bit)


async def test_a_gpu_producers_items_are_checked_on_a_host_consumer_over_tcp() -> None:
    """The checksum a GPU computed, checked on the host with the kernel's reference: clean
    items pass bit for bit; an item whose recorded checksum is off fails and comes back."""
    torch.cuda.set_device(PRODUCER_DEVICE)
    items = [kv_item(index, tokens, torch.bfloat16, PRODUCER_DEVICE) for index, tokens in ((1, 64), (2, 1000))]
    async with (
        kvrt.Producer(device=PRODUCER_DEVICE, checksum=True, transport="tcp") as producer,
        kvrt.Consumer(connect=producer.endpoint, device="cpu") as consumer,
    ):
        for input_tokens, key, value, hidden in items:
            await producer.insert(input_tokens, None, key, value, hidden)
        for input_tokens, key, value, hidden in items:
            item = await consumer.drop_select(input_tokens.cpu(), None)
            assert item is not None and same_bits(item.key, key) and same_bits(item.value, value)
            assert same_bits(item.hidden, hidden)
        assert consumer.metrics.integrity_failures == 0
        input_tokens, key, value, hidden = kv_item(3, 500, torch.bfloat16, PRODUCER_DEVICE)
        await producer.insert(input_tokens, None, key, value, hidden)
        (buffered,) = [producer._bytes[item] for item in producer._core.buffer.items()]
        assert buffered.device_checksum is None
        buffered.device_checksum = 12345  # as if its bytes changed after the GPU checksummed them
        for failures in (1, 2):  # it came back whole, and fails again
            with pytest.raises(kvrt.IntegrityError):
                await consumer.drop_select(input_tokens.cpu(), None)
            assert consumer.metrics.integrity_failures == failures


def flip_one_landed_stream_layer(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the consumer's next cuda_ipc stream receive of a layer land one byte flipped: XORed
    on the GPU after the copy and before the event its reader (and its check) waits on, as a
    transfer damaged on the way would land it. The list returned gets the byte's offset."""
    from kvrt.transports._base import TensorsArrival

    flipped: list[int] = []
    receive = CudaIpcReceiver.receive_tensors

    def flipping(self: CudaIpcReceiver, metas: Any, frames: Any) -> TensorsArrival:
        arrival = receive(self, metas, frames)
        if flipped or arrival.landed is None or len(arrival.tensors) != 2:
            return arrival
        side = torch.cuda.Stream(arrival.tensors[0].device)
        with torch.cuda.stream(side):
            side.wait_event(arrival.landed)
            key = arrival.tensors[0].view(torch.uint8).reshape(-1)
            key[key.numel() // 2] ^= 0x10
            landed = torch.cuda.Event()
            landed.record(side)
        flipped.append(key.numel() // 2)
        return TensorsArrival(arrival.complete, arrival.tensors, landed)

    monkeypatch.setattr(CudaIpcReceiver, "receive_tensors", flipping)
    return flipped


@pytest.mark.parametrize("checksum", [True, False], ids=["checked", "unchecked"])
async def test_a_byte_flipped_where_a_gpu_streams_layer_landed_fails_the_stream_at_its_end_and_it_reads_whole_next(
    monkeypatch: pytest.MonkeyPatch, checksum: bool
) -> None:
    """A GPU producer's layers leave before the prefill wrote them, so they carry no checksum:
    its stream's end carries every layer's, and the consumer checks what landed, on its GPU,
    before the stream ends."""
    monkeypatch.setenv("KVRT_CHECKSUM", "1" if checksum else "0")  # the producer's process reads it
    torch.cuda.set_device(CONSUMER_DEVICE)
    layers, tokens = 4, 256
    async with (
        child_process(run_gpu_streamer, (PRODUCER_DEVICE, 1.0), "GPU streamer") as (endpoint, _, control),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE) as consumer,
    ):
        assert consumer.transports == {endpoint: "cuda_ipc"}
        flipped = flip_one_landed_stream_layer(monkeypatch)
        opening = asyncio.create_task(consumer.open_stream(kv_tokens(0, tokens), timeout=30))
        await asyncio.sleep(0)
        await caught_up(consumer)  # the producer has read the request: it takes the stream as it opens
        control.send(("stream", 0, "bfloat16", layers, tokens, 5, None))
        reader = await opening
        assert reader is not None
        if not checksum:  # what the check is for: the flip does damage what the reader gets
            key, _ = await reader.layer(0)
            await reader.finished()
            assert flipped and not same_bits(key, stream_layer_kv(0, 0, tokens, torch.bfloat16)[0])
            return
        with pytest.raises(kvrt.IntegrityError, match="layer 0"):
            await reader.finished()
        assert flipped and consumer.metrics.integrity_failures == 1
        assert await asyncio.to_thread(control.poll, 60) and control.recv() == "streamed"
        again = await consumer.open_stream(kv_tokens(0, tokens), timeout=30)  # the whole item, as a stream
        assert again is not None
        arrived = [await again.layer(layer) for layer in range(layers)]
        await again.finished()
        await asyncio.to_thread(torch.cuda.current_stream().synchronize)
        for layer, (key, value) in enumerate(arrived):
            want_key, want_value = stream_layer_kv(0, layer, tokens, torch.bfloat16)
            assert same_bits(key, want_key) and same_bits(value, want_value), layer
        assert consumer.metrics.integrity_failures == 1
        assert await consumer.drop_select(kv_tokens(0, tokens), None) is None  # read once


async def test_a_gpu_producers_stream_is_checked_on_a_host_consumer_with_the_kernels_reference() -> None:
    """Over TCP into host memory: each layer as it landed, with the kernel's torch reference,
    against the checksums the stream's end carries (the hidden states' too)."""
    torch.cuda.set_device(PRODUCER_DEVICE)
    tokens = kv_tokens(4, 128)
    layers = [stream_layer_kv(4, layer, 128, torch.bfloat16) for layer in range(3)]
    hidden = torch.randn(128, 16, device=PRODUCER_DEVICE)
    async with (
        kvrt.Producer(device=PRODUCER_DEVICE, checksum=True, transport="tcp") as producer,
        kvrt.Consumer(connect=producer.endpoint, device="cpu") as consumer,
    ):
        writer = await producer.open_stream(tokens, layers=len(layers))
        reader = await consumer.open_stream(tokens)
        assert reader is not None
        for key, value in layers:
            await writer.put_layer(key.to(PRODUCER_DEVICE), value.to(PRODUCER_DEVICE))
        await writer.finish(hidden)
        arrived = [(key, value) async for _, key, value in reader]
        assert same_bits(await reader.finished(), hidden.cpu())
        for (key, value), (want_key, want_value) in zip(arrived, layers, strict=True):
            assert same_bits(key, want_key) and same_bits(value, want_value)
        assert consumer.metrics.integrity_failures == 0
