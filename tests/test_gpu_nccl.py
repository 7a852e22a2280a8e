"""The GPU transports, NCCL and CUDA IPC, between two processes on two GPUs (producer on cuda:0,
consumer on cuda:1): the producer offers both, the consumer forces one (`over_each_gpu_transport`;
`over_each_gpu_item_transport` adds NIXL, offered by a producer forced to it).

Skipped without two CUDA devices, except cuda_ipc's cases that hold on one GPU, which run
there with both processes on cuda:0 (`tests/_gpus.py`); `tools/gpu_check.sh` runs them on a
GPU host.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from typing import Any

import pytest
import torch

import kvrt
from tests._checks import same_bits
from tests._gpu_processes import kv_item, kv_tokens, run_gpu_consumer_that_dies
from tests._gpus import (
    CONSUMER_DEVICE,
    PRODUCER_DEVICE,
    over_each_gpu_item_transport,
    over_each_gpu_transport_on_two_gpus,
    producer_transport,
)
from tests._processes import child_process, fails_with_peer_lost_in_time, gpu_producer_process, killed_and_forgotten

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.timeout(100, method="thread")]

spawn = multiprocessing.get_context("spawn")
GIB_TOKENS = 1 << 17
"""Tokens of an item of about 1 GiB: key and value [2, T, 8, 128] bf16 are 512 MiB each."""




DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn", "int8", "uint8", "bool", "int64"]


@over_each_gpu_item_transport
async def test_every_dtype_arrives_bit_for_bit_on_the_consumers_gpu(transport: str) -> None:
    items = [(index, 64 + index, dtype) for index, dtype in enumerate(DTYPES)]
    async with (
        gpu_producer_process(items, transport=producer_transport(transport)) as (endpoint, _, _),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer,
    ):
        assert consumer.transports == {endpoint: transport}
        for index, tokens, dtype in items:
            input_tokens, key, value, hidden = kv_item(index, tokens, getattr(torch, dtype), CONSUMER_DEVICE)
            item = await consumer.drop_select(input_tokens, None)
            assert item is not None and item.key.device == torch.device(CONSUMER_DEVICE)
            assert same_bits(item.key, key) and same_bits(item.value, value), dtype
            assert item.hidden is not None and same_bits(item.hidden, hidden)
            assert torch.equal(item.input_tokens, input_tokens)


@over_each_gpu_item_transport
async def test_a_batch_of_every_dtype_arrives_bit_for_bit(transport: str) -> None:
    items = [(index, 64 + 3 * index, dtype) for index, dtype in enumerate(DTYPES)]
    async with (
        gpu_producer_process(items, transport=producer_transport(transport)) as (endpoint, _, _),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer,
    ):
        queries = [kv_tokens(index, tokens, CONSUMER_DEVICE) for index, tokens, _ in reversed(items)]
        arrived = await consumer.drop_select_many([*queries, kv_tokens(99, 4, CONSUMER_DEVICE)])
        assert arrived[-1] is None
        for item, (index, tokens, dtype) in zip(arrived, reversed(items), strict=False):
            input_tokens, key, value, hidden = kv_item(index, tokens, getattr(torch, dtype), CONSUMER_DEVICE)
            assert item is not None and item.key.device == torch.device(CONSUMER_DEVICE)
            assert same_bits(item.key, key) and same_bits(item.value, value), dtype
            assert item.hidden is not None and same_bits(item.hidden, hidden)
            assert torch.equal(item.input_tokens, input_tokens) and item.matched == tokens


def matmuls(count: int) -> None:
    a = torch.randn(8192, 8192, device=CONSUMER_DEVICE, dtype=torch.bfloat16)
    for _ in range(count):
        a = (a @ a).clamp_(-1, 1)


@over_each_gpu_transport_on_two_gpus
async def test_compute_on_the_default_stream_overlaps_transfers(transport: str) -> None:
    items = [(index, GIB_TOKENS, "bfloat16") for index in range(8)]
    async with (
        gpu_producer_process(items) as (endpoint, _, _),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer,
    ):
        queries = [kv_tokens(index, GIB_TOKENS) for index in range(8)]
        matmuls(2)
        torch.cuda.synchronize(CONSUMER_DEVICE)

        started = time.perf_counter()
        matmuls(20)
        torch.cuda.synchronize(CONSUMER_DEVICE)
        compute_alone = time.perf_counter() - started

        started = time.perf_counter()
        assert all(await asyncio.gather(*(consumer.drop_select(q) for q in queries[:4])))
        transfer_alone = time.perf_counter() - started

        started = time.perf_counter()
        pending = asyncio.gather(*(consumer.drop_select(q) for q in queries[4:]))
        await asyncio.sleep(0)
        matmuls(20)
        assert all(await pending)
        torch.cuda.synchronize(CONSUMER_DEVICE)
        together = time.perf_counter() - started
        print(f"compute {compute_alone * 1e3:.1f} ms, 4 GiB transfer {transfer_alone * 1e3:.1f} ms, "
              f"both {together * 1e3:.1f} ms")  # fmt: skip
        assert together < compute_alone + 0.7 * transfer_alone  # serialized would be the sum


@over_each_gpu_transport_on_two_gpus
async def test_a_control_round_trip_stays_fast_while_gigabytes_move(transport: str) -> None:
    items = [(index, GIB_TOKENS, "bfloat16") for index in range(8)]
    async with (
        gpu_producer_process(items) as (endpoint, _, _),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer,
    ):
        queries = [kv_tokens(index, GIB_TOKENS) for index in range(8)]
        assert await consumer.drop_select(torch.tensor([-5])) is None  # warm
        # A warm caching allocator, as in a serving engine: posting a receive then allocates
        # from the cache, not with cudaMalloc (about 0.3 ms per GiB on an H200 host, on the loop).
        await asyncio.to_thread(
            lambda: [torch.empty(5 << 28, dtype=torch.uint8, device=CONSUMER_DEVICE) for _ in range(8)]
        )
        # The round trip starts once every transfer is posted (all eight Deliver headers
        # handled on both sides): from then on only the GPUs are busy with them, and a
        # control message must not wait for the bytes.
        posted = asyncio.Event()
        link = consumer.link_for_tests()
        in_use = link.receiver
        assert in_use is not None
        receive = in_use.receive
        count = 0

        def counting(deliver: Any, frames: Any) -> Any:
            nonlocal count
            arrival = receive(deliver, frames)
            count += 1
            if count == len(queries):
                posted.set()
            return arrival

        in_use.receive = counting  # type: ignore[method-assign]
        transfers = [asyncio.create_task(consumer.drop_select(q)) for q in queries]
        await asyncio.wait_for(posted.wait(), 30)
        started = time.perf_counter()
        assert await consumer.drop_select(torch.tensor([-5])) is None
        round_trip = time.perf_counter() - started
        still_moving = sum(not task.done() for task in transfers)
        assert all(await asyncio.gather(*transfers))
        print(f"control round trip {round_trip * 1e3:.2f} ms with {still_moving} of 8 GiB transfers still moving")
        assert still_moving > 0 and round_trip < 0.010


@over_each_gpu_item_transport
async def test_a_consumer_killed_mid_transfer_loses_nothing_and_a_new_one_gets_the_item(transport: str) -> None:
    heartbeat_s = 0.25
    tokens, key, value, hidden = kv_item(0, GIB_TOKENS, torch.bfloat16, PRODUCER_DEVICE)
    async with kvrt.Producer(
        device=PRODUCER_DEVICE, heartbeat_s=heartbeat_s, transport=producer_transport(transport)
    ) as producer:
        await producer.insert(tokens, None, key, value, hidden)
        query = tokens[:16].tolist()
        for attempt in ("killed", "served"):
            control, child = spawn.Pipe()
            process = spawn.Process(
                target=run_gpu_consumer_that_dies,
                args=(producer.endpoint, CONSUMER_DEVICE, heartbeat_s, query, child, transport),
                daemon=True,
            )
            await asyncio.to_thread(process.start)
            assert await asyncio.to_thread(control.poll, 180)
            assert control.recv() == "asked"
            if attempt == "served":
                assert await asyncio.to_thread(control.poll, 60) and control.recv() == "arrived"
            await killed_and_forgotten(process, producer, heartbeat_s)
            stats = producer.stats()
            assert (stats.peers, stats.items, stats.in_flight) == (0, 1, 0), attempt
            assert producer._transports[transport]._pairs == {}  # type: ignore[attr-defined]


@over_each_gpu_item_transport
async def test_a_killed_producer_fails_the_consumers_pending_calls_within_the_heartbeat_timeout(
    transport: str,
) -> None:
    heartbeat_s = 0.25
    offered = producer_transport(transport)
    async with (
        gpu_producer_process([(0, 64, "bfloat16")], heartbeat_s, offered) as (endpoint, process, _),
        kvrt.Consumer(
            connect=endpoint, device=CONSUMER_DEVICE, heartbeat_s=heartbeat_s, transport=transport
        ) as consumer,
    ):
        assert await consumer.drop_select(kv_tokens(0, 64)) is not None
        waiting = asyncio.create_task(consumer.drop_select(torch.tensor([-1]), None, timeout=None))
        await asyncio.sleep(0)
        await fails_with_peer_lost_in_time(waiting, process, heartbeat_s)


@over_each_gpu_item_transport
@pytest.mark.parametrize(
    ("chunk_bytes", "mla", "host_indexes"),
    [(1 << 40, False, False), (16 << 20, False, False), (1 << 20, True, False), (16 << 20, False, True)],
    ids=["whole", "layer-by-layer", "mla-layer-by-layer", "layer-by-layer-indexes-on-the-host"],
)
async def test_a_pull_from_four_replicas_lands_in_replica_two_bit_for_bit_and_the_callers_stream_sees_it(
    chunk_bytes: int, mla: bool, host_indexes: bool, transport: str
) -> None:
    from kvrt import Layout, PoolTable
    from tests._gpu_processes import PULL_LAYERS, pull_request, run_gpu_publisher

    torch.cuda.set_device(CONSUMER_DEVICE)
    publisher = (PRODUCER_DEVICE, 5, chunk_bytes, mla, host_indexes, producer_transport(transport))
    async with child_process(run_gpu_publisher, publisher, "GPU publisher") as (endpoint, _, _):

        def build() -> tuple[Any, ...]:  # in a thread: generating 1 GiB of pools is no work for the loop
            torch.cuda.set_device(CONSUMER_DEVICE)
            pools, tokens, replica, slots = pull_request(5, mla)
            shape = pools[0][0][0].shape
            copies = 2 if mla else 1  # MLA: every card of the replica's group gets the latents
            target = PoolTable(
                [[[torch.zeros(shape, dtype=torch.bfloat16, device=CONSUMER_DEVICE) for _ in range(PULL_LAYERS)]
                  for _ in range(copies)] for _ in range(3)],
                Layout.MLA if mla else Layout.TOKEN_MAJOR,
            )  # fmt: skip
            into_slots = torch.randperm(shape[0], device="cpu" if host_indexes else CONSUMER_DEVICE)[: tokens.numel()]
            torch.cuda.synchronize(CONSUMER_DEVICE)
            return pools, tokens, replica, slots, target, into_slots

        pools, tokens, replica, slots, target, into_slots = await asyncio.to_thread(build)
        async with kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer:
            item = await consumer.pull(tokens, into=target, slots=into_slots, replica=2, timeout=30)
        assert item is not None and item.matched == tokens.numel()

        def check() -> None:  # in a thread: reading back and comparing 64 MiB is no work for the loop
            # Read on the caller's stream, with no synchronize of kvrt's streams: the pull's fence orders it.
            torch.cuda.set_device(CONSUMER_DEVICE)
            for copy in range(target.copies):
                landed = [target.pools[2][copy][layer][into_slots].cpu() for layer in range(PULL_LAYERS)]
                for layer in range(PULL_LAYERS):
                    want = torch.empty_like(landed[layer])
                    for r in range(len(pools)):
                        chosen = (replica == r).nonzero().flatten()
                        want[chosen] = pools[r][0][layer][slots[chosen]]
                    assert same_bits(landed[layer], want)
            assert not target.pools[0][0][0].any() and not target.pools[1][0][0].any()

        await asyncio.to_thread(check)
