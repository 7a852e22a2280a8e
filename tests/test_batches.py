"""drop_select_many: a scheduler step's lookups in one request, its items in one transfer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import torch

import kvrt
from kvrt import _messages as m
from kvrt._protocol import batch_segments, deliveries, outgoing
from kvrt._tensors import check_batch_segments
from tests.conftest import give_up_when_its_reply_comes, make_kv
from tests.test_protocol import Pair


def query(tokens: list[int] | None) -> bytes | None:
    return None if tokens is None else m.tokens_to_bytes(np.array(tokens))


# -- the protocol core -----------------------------------------------------------------------


def test_a_batch_is_answered_in_query_order_with_its_hits_back_to_back_and_aligned() -> None:
    pair = Pair()
    pair.connect()
    first, _ = pair.insert([1, 2, 3])
    second, _ = pair.insert([4, 5])
    request_id, message = pair.consumer.start_request(
        lambda rid: m.DropSelectMany(request_id=rid, queries=[query([4, 5, 6]), query([9]), query([1, 2])]), pair.now
    )
    (out,) = pair.send(message)
    reply = out.message
    assert isinstance(reply, m.DeliverMany) and reply.request_id == request_id
    hit_second, miss, hit_first = reply.hits
    assert miss is None and hit_second is not None and hit_first is not None
    assert (hit_second.item_id, hit_second.matched, hit_first.item_id, hit_first.matched) == (
        second.item_id, 2, first.item_id, 2,
    )  # fmt: skip
    assert out.items == (second, first)
    assert hit_second.offset == 0 and hit_first.offset % m.BATCH_ALIGNMENT == 0
    assert hit_first.offset >= second.nbytes and reply.payload_bytes == hit_first.offset + first.nbytes
    assert pair.producer.counters.misses == 1


def test_an_item_goes_to_one_query_of_a_batch_and_returns_when_its_consumer_leaves() -> None:
    pair = Pair()
    pair.connect()
    item, _ = pair.insert([1, 2])
    _, message = pair.consumer.start_request(
        lambda rid: m.DropSelectMany(request_id=rid, queries=[query([1, 2]), query([1]), query(None)]), pair.now
    )
    (out,) = pair.send(message)
    assert isinstance(out.message, m.DeliverMany)
    assert [hit is not None for hit in out.message.hits] == [True, False, False]
    assert pair.producer.buffer.nbytes == item.nbytes  # in flight
    pair.send(m.Bye())
    _, message = pair.consumer.start_request(
        lambda rid: m.DropSelectMany(request_id=rid, queries=[query([1])]), pair.now
    )
    pair.connect()
    (out,) = pair.send(message)
    assert isinstance(out.message, m.DeliverMany) and out.items == (item,)


def test_small_hits_share_transfers_and_a_large_hit_travels_alone() -> None:
    unit = outgoing.BATCH_SEGMENT_BYTES // 8
    hits = [(0, 2 * unit), (2 * unit, 3 * unit), (5 * unit, 3 * unit), (8 * unit, 10 * unit), (18 * unit, unit)]
    assert batch_segments(hits) == [(0, 8 * unit), (8 * unit, 10 * unit), (18 * unit, unit)]
    assert batch_segments([(0, 0), (256, 10)]) == [(256, 10)]  # an empty hit moves nothing
    check_batch_segments(batch_segments(hits), hits, 19 * unit)


@pytest.mark.parametrize(
    ("segments", "message"),
    [([(0, 10), (5, 10)], "out of order"), ([(0, 10), (10, 300)], "past"), ([(0, 8), (256, 10)], "not inside")],
)
def test_batch_transfers_that_miss_a_hit_or_overlap_are_refused(segments: list[tuple[int, int]], message: str) -> None:
    with pytest.raises(kvrt.RemoteProtocolError, match=message):
        check_batch_segments(segments, [(0, 10), (256, 10)], 266)


def test_a_batch_with_a_bad_query_is_refused_whole_and_takes_nothing() -> None:
    pair = Pair()
    pair.connect()
    pair.insert([1, 2])
    _, message = pair.consumer.start_request(
        lambda rid: m.DropSelectMany(request_id=rid, queries=[query([1, 2]), b"\x01\x02\x03"]), pair.now
    )
    (out,) = pair.send(message)
    assert isinstance(out.message, m.ErrorReply) and "whole number" in out.message.message
    assert len(pair.producer.buffer) == 1


# -- over TCP and over a pair (gloo), end to end --------------------------------------------


@pytest.fixture(params=["tcp", "gloo"])
async def linked(request: pytest.FixtureRequest) -> AsyncIterator[tuple[kvrt.Producer, kvrt.Consumer]]:
    async with (
        kvrt.Producer(transport=request.param) as producer,
        kvrt.Consumer(connect=producer.endpoint, transport=request.param) as consumer,
    ):
        yield producer, consumer


async def test_every_query_gets_its_own_item_or_none_in_order_and_the_items_arrive_equal(
    linked: tuple[kvrt.Producer, kvrt.Consumer],
) -> None:
    producer, consumer = linked
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
    for index, dtype in enumerate(dtypes):
        tokens = torch.tensor([index, 7, 7])
        key, value, hidden = make_kv(tokens, seed=index, layers=1 + index, dtype=torch.float32)
        await producer.insert(tokens, None, key.to(dtype), value.to(dtype), hidden)
    items = await consumer.drop_select_many([torch.tensor([3, 7]), torch.tensor([99]), torch.tensor([0, 7, 7, 7])] + [
        torch.tensor([index, 7, 7]) for index in (1, 2)
    ])  # fmt: skip
    assert [None if item is None else item.input_tokens[0].item() for item in items] == [3, None, 0, 1, 2]
    for item in items:
        if item is None:
            continue
        index = int(item.input_tokens[0])
        key, value, hidden = make_kv(item.input_tokens, seed=index, layers=1 + index, dtype=torch.float32)
        assert torch.equal(item.key, key.to(dtypes[index])) and torch.equal(item.value, value.to(dtypes[index]))
        assert item.hidden is not None and hidden is not None and torch.equal(item.hidden, hidden)
    assert [item.matched for item in items if item is not None] == [2, 3, 3, 3]
    assert producer.stats().items == 0
    await producer.insert(torch.tensor([5]), None, *make_kv(torch.tensor([5]), seed=5))
    single = await consumer.drop_select(torch.tensor([5]))  # the pair is still in step
    assert single is not None and torch.equal(single.key, make_kv(torch.tensor([5]), seed=5)[0])


async def test_rois_apply_and_none_takes_the_oldest_items(linked: tuple[kvrt.Producer, kvrt.Consumer]) -> None:
    producer, consumer = linked
    for index in range(3):
        await producer.insert(torch.tensor([index, 1, 2]), None, *make_kv(torch.tensor([index, 1, 2]), seed=index))
    items = await consumer.drop_select_many(
        [torch.tensor([2, 9, 1]), None, None], rois=[torch.tensor([True, False, True]), None, None]
    )
    assert [None if item is None else int(item.input_tokens[0]) for item in items] == [2, 0, 1]
    assert await consumer.drop_select_many([None]) == [None]
    assert await consumer.drop_select_many([]) == []


async def test_hits_packed_together_and_hits_sent_alone_all_arrive_intact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outgoing, "BATCH_SEGMENT_BYTES", 4096)  # items of 4 KiB or more travel alone
    planned: list[list[tuple[int, int]]] = []
    plan = outgoing.batch_segments
    monkeypatch.setattr(deliveries, "batch_segments", lambda hits: planned.append(plan(hits)) or planned[-1])
    async with (
        kvrt.Producer(transport="gloo") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="gloo") as consumer,
    ):
        sizes = [1, 40, 2, 3, 64, 1, 1]  # tokens, about 90 bytes each: 64 tokens travel alone
        queries = [torch.arange(tokens) + 1000 * index for index, tokens in enumerate(sizes)]
        for index, query in enumerate(queries):
            await producer.insert(query, None, *make_kv(query, seed=index))
        items = await consumer.drop_select_many(queries)
        (segments,) = planned
        assert 2 < len(segments) < len(sizes)  # some hits packed together, one alone
        for index, (tokens, item) in enumerate(zip(sizes, items, strict=True)):
            key, value, hidden = make_kv(torch.arange(tokens) + 1000 * index, seed=index)
            assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)
            assert item.hidden is not None and hidden is not None and torch.equal(item.hidden, hidden)


async def test_hits_back_to_back_are_packed_by_one_copy_and_arrive_intact(monkeypatch: pytest.MonkeyPatch) -> None:
    packed: list[int] = []
    cat = torch.cat

    def counted_cat(tensors: list[torch.Tensor], **kwargs: torch.Tensor) -> torch.Tensor:
        if "out" in kwargs:
            packed.append(len(tensors))
        return cat(tensors, **kwargs)

    monkeypatch.setattr(torch, "cat", counted_cat)
    async with (
        kvrt.Producer(transport="gloo") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="gloo") as consumer,
    ):
        # 32 tokens and a float32 key and value [2, 32, 2, 4]: 4352 bytes, a multiple of the
        # batch alignment, so the next item starts right after; 3 tokens leave a gap after them.
        sizes = [32, 32, 32, 3, 32, 32]
        expected = []
        for index, tokens in enumerate(sizes):
            query = torch.arange(tokens) + 1000 * index
            generator = torch.Generator().manual_seed(index)
            key, value = (torch.randn(2, tokens, 2, 4, generator=generator) for _ in range(2))
            await producer.insert(query, None, key, value)
            expected.append((query, key, value))
        items = await consumer.drop_select_many([query for query, _, _ in expected])
        assert packed == [4, 2]  # two runs of back-to-back hits (the gap ends the first), one copy each
        for item, (query, key, value) in zip(items, expected, strict=True):
            assert item is not None and torch.equal(item.input_tokens, query)
            assert torch.equal(item.key, key) and torch.equal(item.value, value)


async def test_more_queries_than_one_request_carries_are_split_and_all_answered(
    linked: tuple[kvrt.Producer, kvrt.Consumer],
) -> None:
    producer, consumer = linked
    count = m.MAX_BATCH + 44
    for index in range(count):
        await producer.insert(torch.tensor([index]), None, *make_kv(torch.tensor([index]), hidden_size=None))
    items = await consumer.drop_select_many([torch.tensor([index]) for index in range(count)])
    assert [None if item is None else int(item.input_tokens[0]) for item in items] == list(range(count))


async def test_bad_input_is_refused_before_anything_is_taken(linked: tuple[kvrt.Producer, kvrt.Consumer]) -> None:
    producer, consumer = linked
    await producer.insert(torch.tensor([1]), None, *make_kv(torch.tensor([1])))
    with pytest.raises(kvrt.InvalidInputError, match="a sequence of token tensors"):
        await consumer.drop_select_many(torch.tensor([1]))  # type: ignore[arg-type]
    with pytest.raises(kvrt.InvalidInputError, match="2 rois for 1 queries"):
        await consumer.drop_select_many([torch.tensor([1])], rois=[None, None])
    with pytest.raises(kvrt.InvalidInputError, match="1-D integer tensor"):
        await consumer.drop_select_many([torch.tensor([1]), torch.tensor([0.5])])
    assert producer.stats().items == 1


async def test_a_batch_that_crosses_its_cancel_is_received_and_given_back_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with (
        kvrt.Producer(transport="gloo") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="gloo") as consumer,
    ):
        for index in range(3):
            await producer.insert(torch.tensor([index]), None, *make_kv(torch.tensor([index]), seed=index))
        batch = asyncio.create_task(consumer.drop_select_many([torch.tensor([0]), torch.tensor([1])]))
        give_up_when_its_reply_comes(monkeypatch, consumer, batch, m.DeliverMany)
        with pytest.raises(asyncio.CancelledError):
            await batch
        (third,) = await consumer.drop_select_many([torch.tensor([2])])
        assert third is not None and torch.equal(third.key, make_kv(torch.tensor([2]), seed=2)[0])
        for index in (1, 0):  # back in the buffer once their bytes landed here
            item = await consumer.drop_select(torch.tensor([index]), timeout=10)
            assert item is not None and torch.equal(item.key, make_kv(torch.tensor([index]), seed=index)[0])


async def test_with_several_producers_each_query_takes_the_longest_match_of_any() -> None:
    async with kvrt.Producer() as first, kvrt.Producer() as second:
        await first.insert(torch.tensor([1, 2]), None, *make_kv(torch.tensor([1, 2])))
        await second.insert(torch.tensor([1, 2, 3]), None, *make_kv(torch.tensor([1, 2, 3])))
        async with kvrt.Consumer(connect=[first.endpoint, second.endpoint]) as consumer:
            items = await consumer.drop_select_many([torch.tensor([1, 2, 3]), torch.tensor([1, 2])])
            assert [None if item is None else item.matched for item in items] == [3, 2]
