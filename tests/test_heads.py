"""`heads=`: a consumer takes a range of an item's KV heads, through the embedded API, over
TCP and gloo: only those heads travel, they land where every landing call puts its bytes,
and a range spread over several producers is joined from a piece of each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

import kvrt
import kvrt.blocking
from kvrt import Layout, PoolTable
from tests._checks import caught_up

LAYERS, TOKENS, HEADS, DIM = 2, 6, 8, 4


def full_kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    key = torch.randn((LAYERS, TOKENS, HEADS, DIM), generator=generator)
    return key, torch.randn(key.shape, generator=generator), torch.randn((TOKENS, 3), generator=generator)


TOKEN_IDS = torch.arange(40, 40 + TOKENS)


@pytest.fixture(params=["tcp", "gloo"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[kvrt.Producer, kvrt.Consumer]]:
    async with (
        kvrt.Producer(transport=request.param) as producer,
        kvrt.Consumer(connect=producer.endpoint, transport=request.param) as consumer,
    ):
        yield producer, consumer


async def test_a_head_range_lands_those_heads_and_only_their_bytes_travel(
    pair: tuple[kvrt.Producer, kvrt.Consumer],
) -> None:
    producer, consumer = pair
    key, value, hidden = full_kv()
    await producer.insert(TOKEN_IDS, None, key, value, hidden)
    item = await consumer.drop_select(TOKEN_IDS, heads=slice(2, 5))
    assert item is not None and item.matched == TOKENS
    assert torch.equal(item.key, key[:, :, 2:5]) and torch.equal(item.value, value[:, :, 2:5])
    assert item.hidden is not None and torch.equal(item.hidden, hidden)
    await caught_up(consumer)
    stats = producer.stats()
    assert stats.totals.delivered_bytes < (key.nbytes + value.nbytes) // 2  # 3 of 8 heads, and the tokens
    assert stats.items == 0 and stats.buffer_bytes == 0  # one reader: its piece was the item's last


async def test_a_range_the_item_does_not_have_is_refused_and_the_item_stays() -> None:
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        await producer.insert(TOKEN_IDS, None, *full_kv())
        with pytest.raises(kvrt.InvalidInputError, match="8 KV heads"):
            await consumer.drop_select(TOKEN_IDS, heads=slice(6, 10))
        assert (await consumer.drop_select(TOKEN_IDS)) is not None  # whole, still there


@pytest.mark.parametrize("heads", [slice(3, 3), slice(-1, 2), slice(0, 4, 2), slice(None, 2), (0, 2), 3])
async def test_a_heads_argument_that_is_not_a_range_of_heads_is_refused_before_anything_is_asked(heads: object) -> None:
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        await producer.insert(TOKEN_IDS, None, *full_kv())
        with pytest.raises(kvrt.InvalidInputError, match="heads must be None or slice"):
            await consumer.drop_select(TOKEN_IDS, heads=heads)  # type: ignore[arg-type]
        assert producer.stats().items == 1


async def test_a_range_over_two_producers_is_joined_from_a_piece_of_each() -> None:
    key, value, hidden = full_kv(seed=3)
    async with (
        kvrt.Producer(heads=slice(0, 4)) as first,
        kvrt.Producer(heads=slice(4, 8)) as second,
    ):
        await first.insert(TOKEN_IDS, None, key[:, :, :4].clone(), value[:, :, :4].clone(), hidden)
        await second.insert(TOKEN_IDS, None, key[:, :, 4:].clone(), value[:, :, 4:].clone(), hidden)
        async with kvrt.Consumer(connect=[first.endpoint, second.endpoint]) as consumer:
            item = await consumer.drop_select(TOKEN_IDS, heads=slice(2, 7))
            assert item is not None
            assert torch.equal(item.key, key[:, :, 2:7]) and torch.equal(item.value, value[:, :, 2:7])
            assert item.hidden is not None and torch.equal(item.hidden, hidden)
            await caught_up(consumer)
        assert first.stats().items == 0 and second.stats().items == 0


async def test_a_piece_missing_on_one_producer_is_a_miss_and_the_others_go_back_whole() -> None:
    key, value, hidden = full_kv(seed=4)
    async with (
        kvrt.Producer(heads=slice(0, 4)) as first,
        kvrt.Producer(heads=slice(4, 8)) as second,
        kvrt.Consumer(connect=[first.endpoint, second.endpoint]) as consumer,
    ):
        await first.insert(TOKEN_IDS, None, key[:, :, :4].clone(), value[:, :, :4].clone(), hidden)
        assert await consumer.drop_select(TOKEN_IDS, heads=slice(0, 8)) is None
        whole = await consumer.drop_select(TOKEN_IDS)  # the first producer's item, whole again
        assert whole is not None and torch.equal(whole.key, key[:, :, :4])


async def test_a_waiting_range_over_two_producers_completes_when_the_last_piece_is_inserted() -> None:
    key, value, hidden = full_kv(seed=5)
    async with (
        kvrt.Producer(heads=slice(0, 4)) as first,
        kvrt.Producer(heads=slice(4, 8)) as second,
        kvrt.Consumer(connect=[first.endpoint, second.endpoint]) as consumer,
    ):
        await first.insert(TOKEN_IDS, None, key[:, :, :4].clone(), value[:, :, :4].clone(), hidden)
        waiting = asyncio.create_task(consumer.drop_select(TOKEN_IDS, heads=slice(0, 8), timeout=10))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await second.insert(TOKEN_IDS, None, key[:, :, 4:].clone(), value[:, :, 4:].clone(), hidden)
        item = await waiting
        assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)


async def test_a_cancelled_range_gives_every_piece_it_took_back() -> None:
    key, value, hidden = full_kv(seed=6)
    async with (
        kvrt.Producer(heads=slice(0, 4)) as first,
        kvrt.Producer(heads=slice(4, 8)) as second,
        kvrt.Consumer(connect=[first.endpoint, second.endpoint]) as consumer,
    ):
        await first.insert(TOKEN_IDS, None, key[:, :, :4].clone(), value[:, :, :4].clone(), hidden)
        waiting = asyncio.create_task(consumer.drop_select(TOKEN_IDS, heads=slice(0, 8), timeout=None))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        other = await consumer.drop_select(TOKEN_IDS, timeout=2)
        assert other is not None and torch.equal(other.key, key[:, :, :4])


async def test_a_joined_range_that_does_not_fit_the_callers_buffers_goes_back_whole() -> None:
    key, value, hidden = full_kv(seed=12)
    async with (
        kvrt.Producer(heads=slice(0, 4)) as first,
        kvrt.Producer(heads=slice(4, 8)) as second,
        kvrt.Consumer(connect=[first.endpoint, second.endpoint]) as consumer,
    ):
        await first.insert(TOKEN_IDS, None, key[:, :, :4].clone(), value[:, :, :4].clone(), hidden)
        await second.insert(TOKEN_IDS, None, key[:, :, 4:].clone(), value[:, :, 4:].clone(), hidden)
        small = kvrt.KVBuffers(key=torch.empty(10), value=torch.empty(10))
        with pytest.raises(kvrt.InvalidInputError):
            await consumer.drop_select(TOKEN_IDS, heads=slice(0, 8), into=small)
        item = await consumer.drop_select(TOKEN_IDS, heads=slice(0, 8))
        assert item is not None and torch.equal(item.key, key)


async def test_a_range_over_two_producers_for_any_item_never_joins_pieces_of_two_requests() -> None:
    """A query of None takes each producer's oldest item: when those are pieces of different
    requests (one prefill rank is behind), the call is a miss and both go back whole."""
    key, value, hidden = full_kv(seed=13)
    behind = TOKEN_IDS + 1000
    async with (
        kvrt.Producer(heads=slice(0, 4)) as first,
        kvrt.Producer(heads=slice(4, 8)) as second,
        kvrt.Consumer(connect=[first.endpoint, second.endpoint]) as consumer,
    ):
        await first.insert(behind, None, key[:, :, :4].clone(), value[:, :, :4].clone(), hidden)  # its pair is late
        await first.insert(TOKEN_IDS, None, key[:, :, :4].clone(), value[:, :, :4].clone(), hidden)
        await second.insert(TOKEN_IDS, None, key[:, :, 4:].clone(), value[:, :, 4:].clone(), hidden)
        assert await consumer.drop_select(None, heads=slice(0, 8)) is None
        item = await consumer.drop_select(TOKEN_IDS, heads=slice(0, 8))
        assert item is not None and torch.equal(item.input_tokens, TOKEN_IDS) and torch.equal(item.key, key)
        await caught_up(consumer)
        assert first.stats().items == 1 and second.stats().items == 0


async def test_several_producers_that_were_not_told_their_heads_cannot_split_a_range() -> None:
    async with (
        kvrt.Producer() as first,
        kvrt.Producer() as second,
        kvrt.Consumer(connect=[first.endpoint, second.endpoint]) as consumer,
    ):
        with pytest.raises(kvrt.InvalidInputError, match="each producer to say which heads it holds"):
            await consumer.drop_select(TOKEN_IDS, heads=slice(0, 2))


async def test_a_producer_told_its_heads_refuses_an_item_with_another_number() -> None:
    async with kvrt.Producer(heads=slice(4, 8)) as producer:
        with pytest.raises(kvrt.InvalidInputError, match=r"holds heads \[4, 8\)"):
            await producer.insert(TOKEN_IDS, None, *full_kv())


async def test_drop_select_many_takes_the_range_of_every_item_in_one_batch() -> None:
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        kvs = [full_kv(seed=index) for index in range(3)]
        for index, (key, value, hidden) in enumerate(kvs):
            await producer.insert(TOKEN_IDS + 100 * index, None, key, value, hidden)
        items = await consumer.drop_select_many([TOKEN_IDS + 100 * index for index in range(3)], heads=slice(7, 8))
        for item, (key, value, _) in zip(items, kvs, strict=True):
            assert item is not None
            assert torch.equal(item.key, key[:, :, 7:8]) and torch.equal(item.value, value[:, :, 7:8])


async def test_a_range_lands_in_the_callers_buffers() -> None:
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        key, value, hidden = full_kv(seed=8)
        await producer.insert(TOKEN_IDS, None, key, value, hidden)
        buffers = kvrt.KVBuffers(key=torch.empty(1000), value=torch.empty(1000))
        item = await consumer.drop_select(TOKEN_IDS, heads=slice(0, 2), into=buffers)
        assert item is not None and item.key.data_ptr() == buffers.key.data_ptr()
        assert torch.equal(item.key, key[:, :, :2]) and torch.equal(item.value, value[:, :, :2])


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
async def test_a_pull_of_a_range_writes_those_heads_of_a_published_request_into_the_pools(transport: str) -> None:
    slots = 16
    generator = torch.Generator().manual_seed(9)
    source = PoolTable([[[torch.randn((slots, 2 * HEADS, DIM), generator=generator) for _ in range(LAYERS)]]],
                       Layout.TOKEN_MAJOR)  # fmt: skip
    target = PoolTable([[[torch.zeros((slots, 2 * 2, DIM)) for _ in range(LAYERS)]]], Layout.TOKEN_MAJOR)
    from_slots, into_slots = torch.arange(3, 3 + TOKENS), torch.arange(8, 8 + TOKENS)
    async with (
        kvrt.Producer(transport=transport) as producer,
        kvrt.Consumer(connect=producer.endpoint, transport=transport) as consumer,
    ):
        producer.register_pools(source)
        await producer.publish(TOKEN_IDS, from_slots)
        item = await consumer.pull(TOKEN_IDS, into=target, slots=into_slots, heads=slice(5, 7))
        assert item is not None
    for layer in range(LAYERS):
        written, origin = target.pools[0][0][layer][into_slots], source.pools[0][0][layer][from_slots]
        assert torch.equal(written[:, 0:2], origin[:, 5:7])  # keys of heads 5, 6
        assert torch.equal(written[:, 2:4], origin[:, HEADS + 5 : HEADS + 7])  # their values


async def test_a_stream_of_a_range_carries_those_heads_of_every_layer() -> None:
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        key, value, hidden = full_kv(seed=10)
        await producer.insert(TOKEN_IDS, None, key, value, hidden)
        stream = await consumer.open_stream(TOKEN_IDS, heads=slice(1, 3))
        assert stream is not None
        for layer in range(LAYERS):
            layer_key, layer_value = await stream.layer(layer)
            assert torch.equal(layer_key, key[layer, :, 1:3]) and torch.equal(layer_value, value[layer, :, 1:3])
        await stream.finished()
        await caught_up(consumer)
        assert producer.stats().items == 0 and producer.stats().buffer_bytes == 0


def test_the_blocking_consumer_takes_a_range_too() -> None:
    key, value, hidden = full_kv(seed=11)
    with kvrt.blocking.Producer(heads=slice(8, 16)) as producer:
        producer.insert(TOKEN_IDS, None, key, value, hidden)
        with kvrt.blocking.Consumer(connect=producer.endpoint) as consumer:
            item = consumer.drop_select(TOKEN_IDS, heads=slice(12, 14))
            assert item is not None and torch.equal(item.key, key[:, :, 4:6])


async def test_a_latent_item_comes_whole_for_any_range() -> None:
    latent = torch.randn(LAYERS, TOKENS, 1, 32)
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        await producer.insert(TOKEN_IDS, None, latent, torch.empty(LAYERS, TOKENS, 0, 32), None)
        item = await consumer.drop_select(TOKEN_IDS, heads=slice(5, 6))
        assert item is not None and torch.equal(item.key, latent) and item.value.numel() == 0
