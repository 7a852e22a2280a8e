"""`Consumer.fetch`: a scheduler step's requests taken from one producer in one message and
written into the caller's pools, in two phases (`fetch` returns at once, `Fetch.landed` waits),
bit for bit; what each query found; and what happens on every fault."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

import kvrt
from kvrt import Layout, PoolTable
from kvrt.kernels.paged_kv import gather_reference
from tests._checks import same_bits
from tests._processes import item_tensors, producer_process

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 3, 2, 8, 4, 64


def pages(seed: int) -> PoolTable:
    """vLLM's CPU pages: [blocks, heads, 2, block_size, head_dim] per layer, random bytes."""
    generator = torch.Generator().manual_seed(seed)
    return PoolTable(
        [[[torch.randn(BLOCKS, HEADS, 2, BLOCK, DIM, generator=generator) for _ in range(LAYERS)]]],
        Layout.BLOCK_HEAD_MAJOR,
    )


def request(index: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    shape = (LAYERS, tokens, HEADS, DIM)
    key, value = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    return torch.arange(tokens) + 1000 * index, key, value


def slots_in(blocks: list[int], first: int, end: int) -> torch.Tensor:
    return torch.tensor([blocks[token // BLOCK] * BLOCK + token % BLOCK for token in range(first, end)])


def written(table: PoolTable, slots: torch.Tensor) -> torch.Tensor:
    """What the pools hold at `slots`: [layers, tokens, kv, heads, dim]."""
    return gather_reference(table, torch.zeros_like(slots), slots)


async def test_a_steps_requests_land_in_their_slots_bit_for_bit_and_each_says_what_it_matched() -> None:
    pools = pages(0)
    asked = [request(index, tokens) for index, tokens in enumerate([9, 16, 5])]
    blocks = [[3, 7, 1], [8, 2, 9, 4], [11, 12]]
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        for tokens, key, value in asked:
            await producer.insert(tokens, None, key, value)
        untouched = [pool.clone() for pool in pools.pools[0][0]]
        fetch = consumer.fetch(
            [tokens for tokens, _, _ in asked], into=pools,
            slots=[slots_in(blocks[i], 0, len(asked[i][0])) for i in range(3)],
        )  # fmt: skip
        assert not fetch.done()  # started: its request is on its way, nothing has come
        assert await fetch.landed() == [9, 16, 5]
        assert producer.stats().items == 0  # each taken, once
    for (tokens, key, value), request_blocks in zip(asked, blocks, strict=True):
        landed = written(pools, slots_in(request_blocks, 0, len(tokens)))
        assert same_bits(landed[:, :, 0], key) and same_bits(landed[:, :, 1], value)
    moved = {block for request_blocks in blocks for block in request_blocks}
    for layer, pool in enumerate(pools.pools[0][0]):
        for block in set(range(BLOCKS)) - moved:
            assert same_bits(pool[block], untouched[layer][block])


async def test_tokens_the_pools_hold_already_are_not_written_and_a_miss_writes_nothing() -> None:
    pools = pages(1)
    tokens, key, value = request(1, 12)
    before = pools.pools[0][0][0].clone()
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        await producer.insert(tokens, None, key, value)
        missing = torch.arange(7) + 50_000
        fetch = consumer.fetch(
            [tokens, missing], into=pools, slots=[slots_in([5, 6, 7], 4, 12), slots_in([9, 10], 0, 7)], skip=[4, 0]
        )
        assert await fetch.landed() == [12, 0]
    landed = written(pools, slots_in([5, 6, 7], 4, 12))
    assert same_bits(landed[:, :, 0], key[:, 4:]) and same_bits(landed[:, :, 1], value[:, 4:])
    assert same_bits(pools.pools[0][0][0][5], before[5])  # the block of the skipped tokens
    assert same_bits(pools.pools[0][0][0][9], before[9]) and same_bits(pools.pools[0][0][0][10], before[10])


async def test_bad_slots_are_refused_before_anything_is_taken() -> None:
    pools = pages(2)
    tokens, key, value = request(2, 8)
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        await producer.insert(tokens, None, key, value)
        with pytest.raises(kvrt.InvalidInputError, match="slot"):
            consumer.fetch([tokens], into=pools, slots=[torch.tensor([0, 1, 2, BLOCKS * BLOCK])])
        with pytest.raises(kvrt.InvalidInputError, match="skip"):
            consumer.fetch([tokens], into=pools, slots=[slots_in([1, 2], 0, 8)], skip=[-1])
        with pytest.raises(kvrt.InvalidInputError, match="one tensor of slots"):
            consumer.fetch([tokens, tokens], into=pools, slots=[slots_in([1, 2], 0, 8)])
        assert producer.stats().items == 1


async def test_a_producer_stalled_past_the_reply_timeout_fails_the_fetch_and_frees_nothing_of_the_callers() -> None:
    pools = pages(3)
    before = [pool.clone() for pool in pools.pools[0][0]]
    tokens, *_ = item_tensors(0)
    async with producer_process(1) as (endpoint, process, _):
        async with kvrt.Consumer(connect=endpoint, reply_timeout_s=1.0) as consumer:
            os.kill(process.pid, signal.SIGSTOP)
            try:
                fetch = consumer.fetch([tokens], into=pools, slots=[slots_in(list(range(8)), 0, 32)])
                with pytest.raises((kvrt.KVRTTimeoutError, kvrt.PeerLostError)):
                    await asyncio.wait_for(fetch.landed(), 20)
            finally:
                os.kill(process.pid, signal.SIGCONT)
    assert all(same_bits(pool, old) for pool, old in zip(pools.pools[0][0], before, strict=True))


async def test_a_fetch_on_its_way_when_the_consumer_closes_ends_with_closed_error() -> None:
    pools = pages(4)
    tokens, *_ = item_tensors(0)
    async with producer_process(1) as (endpoint, process, _):
        consumer = kvrt.Consumer(connect=endpoint, reply_timeout_s=30.0)
        await consumer.start()
        os.kill(process.pid, signal.SIGSTOP)
        try:
            fetch = consumer.fetch([tokens], into=pools, slots=[slots_in(list(range(8)), 0, 32)])
            await consumer.aclose()
            with pytest.raises(kvrt.ClosedError):
                await asyncio.wait_for(fetch.landed(), 10)
        finally:
            os.kill(process.pid, signal.SIGCONT)


def test_a_synchronous_engine_fetches_in_two_phases_through_the_blocking_api() -> None:
    pools = pages(5)
    tokens, key, value = request(5, 10)
    with kvrt.blocking.Producer() as producer, kvrt.blocking.Consumer(connect=producer.endpoint) as consumer:
        producer.insert(tokens, None, key, value)
        missing = torch.arange(3) + 90_000
        fetch = consumer.fetch([tokens, missing], into=pools, slots=[slots_in([2, 4, 6], 0, 10), slots_in([8], 0, 3)])
        assert fetch.landed(timeout=10) == [10, 0]
        assert fetch.done()
        with pytest.raises(kvrt.InvalidInputError, match="slot"):
            consumer.fetch([tokens], into=pools, slots=[torch.tensor([BLOCKS * BLOCK])]).landed(timeout=10)
    landed = written(pools, slots_in([2, 4, 6], 0, 10))
    assert same_bits(landed[:, :, 0], key) and same_bits(landed[:, :, 1], value)
