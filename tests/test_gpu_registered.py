"""Registered memory (`kvrt.transports._arena`): a GPU producer's items are regions of a few
slabs that a cuda_ipc consumer maps once, so a delivery opens nothing new; a region is
reused only once nothing views it and the GPU finished writing it; past the arena's limit
items are allocated and shared by torch as before, and travel all the same.

Skipped without CUDA; one GPU will do (both processes on it).
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
from typing import Any

import pytest
import torch

import kvrt
from kvrt.transports import cuda_ipc
from kvrt.transports._arena import RegisteredArena
from tests._checks import same_bits
from tests._gpu_processes import kv_item, run_gpu_consumer, run_gpu_producer_registering
from tests._gpus import CONSUMER_DEVICE, PRODUCER_DEVICE, one_gpu
from tests._processes import child_process

pytestmark = [one_gpu, pytest.mark.timeout(120, method="thread")]

spawn = multiprocessing.get_context("spawn")


def arena_of(producer: kvrt.Producer) -> RegisteredArena:
    arena = producer._transports["cuda_ipc"]._arena  # type: ignore[attr-defined]
    assert isinstance(arena, RegisteredArena)
    return arena


def collected(arena: RegisteredArena) -> RegisteredArena:
    gc.collect()
    arena.collect()
    return arena


async def test_a_region_is_reused_only_once_nothing_views_it_and_its_writes_are_done() -> None:
    torch.cuda.set_device(PRODUCER_DEVICE)
    arena = RegisteredArena(torch.device(PRODUCER_DEVICE), limit_bytes=1 << 30, slab_bytes=16 << 20)
    region = arena.allocate(1 << 20)
    assert region is not None and region.nbytes == 1 << 20
    address = region.data_ptr()
    slab, start = arena.place(region[4096:]) or (None, -1)
    assert slab is arena.slabs[0] and start == address - slab.tensor.data_ptr() + 4096

    view = region[100:200]  # a view alone keeps the region
    del region
    assert collected(arena).used_bytes == 1 << 20
    assert arena.allocate(1 << 20).data_ptr() != address  # type: ignore[union-attr]
    del view

    # Written by a kernel still running: the region waits for it.
    region = arena.allocate(1 << 20)
    assert region is not None
    writer = torch.cuda.Stream()
    written = torch.cuda.Event()
    with torch.cuda.stream(writer):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        region.fill_(7)
        written.record(writer)
    arena.written(region, written)
    busy = region.data_ptr()
    del region
    other = arena.allocate(1 << 20)
    assert other is not None and other.data_ptr() != busy, "reused while the GPU still writes it"
    written.synchronize()
    del other
    again = [arena.allocate(1 << 20) for _ in range(3)]
    assert busy in {tensor.data_ptr() for tensor in again if tensor is not None}
    assert len(arena.slabs) == 1


async def test_past_its_limit_the_arena_gives_nothing_and_never_grows() -> None:
    torch.cuda.set_device(PRODUCER_DEVICE)
    arena = RegisteredArena(torch.device(PRODUCER_DEVICE), limit_bytes=32 << 20, slab_bytes=16 << 20)
    held = [arena.allocate(8 << 20) for _ in range(4)]
    assert all(tensor is not None for tensor in held) and arena.reserved_bytes == 32 << 20
    assert arena.allocate(1 << 20) is None and arena.allocate(64 << 20) is None
    assert arena.reserved_bytes == 32 << 20
    del held
    assert collected(arena).used_bytes == 0 and arena.allocate(30 << 20) is None  # no slab holds it
    assert arena.allocate(16 << 20) is not None


async def test_an_item_taken_and_confirmed_gives_its_region_back_for_the_next_insert() -> None:
    torch.cuda.set_device(PRODUCER_DEVICE)
    tokens, key, value, hidden = kv_item(0, 4096, torch.bfloat16, PRODUCER_DEVICE)
    async with kvrt.Producer(device=PRODUCER_DEVICE) as producer:
        arena = arena_of(producer)
        await producer.insert(tokens, None, key, value, hidden)
        first = producer._bytes[producer._core.buffer.items()[0]].storage
        assert arena.place(first) is not None and arena.used_bytes >= key.nbytes + value.nbytes
        address = first.data_ptr()
        del first
        control, child = spawn.Pipe()
        taker = spawn.Process(
            target=run_gpu_consumer, args=(producer.endpoint, CONSUMER_DEVICE, tokens.tolist(), "cuda_ipc", child)
        )
        await asyncio.to_thread(taker.start)
        assert await asyncio.to_thread(control.poll, 60) and control.recv() == tokens.numel()
        await asyncio.to_thread(taker.join, 30)
        assert producer.stats().totals.delivered_items == 1
        assert collected(arena).used_bytes == 0
        await producer.insert(tokens, None, key, value, hidden)
        second = producer._bytes[producer._core.buffer.items()[0]].storage
        assert second.data_ptr() == address and len(arena.slabs) == 1


@pytest.mark.parametrize(
    "registered_bytes", [None, 300 << 20, 0], ids=["registered", "partly-registered", "torch-shared"]
)
async def test_items_arrive_bit_exact_and_registered_ones_open_nothing_new(
    monkeypatch: pytest.MonkeyPatch, registered_bytes: int | None
) -> None:
    sizes = [600, 4000, 12000, 600, 3000, 12000, 100, 8000, 4000, 600, 12000, 2000]  # 476 MiB in all
    items = [(index, tokens, "bfloat16") for index, tokens in enumerate(sizes)]
    opened: list[bool] = []
    new_shared = cuda_ipc._new_shared

    def counting(device_index: int, share: Any, *, counted: bool) -> Any:
        opened.append(counted)
        return new_shared(device_index, share, counted=counted)

    torch.cuda.set_device(CONSUMER_DEVICE)
    async with (
        child_process(run_gpu_producer_registering, (PRODUCER_DEVICE, registered_bytes, items), "GPU producer") as (
            endpoint,
            _,
            _,
        ),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport="cuda_ipc") as consumer,
    ):
        monkeypatch.setattr(cuda_ipc, "_new_shared", counting)  # after the join's probe
        for index, tokens in enumerate(sizes):
            input_tokens, key, value, hidden = kv_item(index, tokens, torch.bfloat16, CONSUMER_DEVICE)
            item = await consumer.drop_select(input_tokens, timeout=30)
            assert item is not None and item.matched == tokens
            assert same_bits(item.key, key) and same_bits(item.value, value)
            assert item.hidden is not None and same_bits(item.hidden, hidden)
    counted = opened.count(True)
    if registered_bytes is None:
        # Every item in slabs: each slab opened once, never a counted share.
        assert counted == 0 and 1 <= opened.count(False) <= 3, opened
    elif registered_bytes == 0:
        assert counted == len(sizes), opened
    else:
        assert 0 < counted < len(sizes), opened
