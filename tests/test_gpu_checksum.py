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

import pytest
import torch

import kvrt
from kvrt.transports.cuda_ipc import CudaIpcReceiver
from tests._checks import flip_one_landed_byte, same_bits
from tests._gpu_processes import PULL_LAYERS, kv_item, pull_request, run_gpu_producer, run_gpu_publisher
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
        (buffered,) = [item for item in producer._core.buffer.items() if item.device_checksum is None]
        buffered.device_checksum = 12345  # as if its bytes changed after the GPU checksummed them
        for failures in (1, 2):  # it came back whole, and fails again
            with pytest.raises(kvrt.IntegrityError):
                await consumer.drop_select(input_tokens.cpu(), None)
            assert consumer.metrics.integrity_failures == failures
