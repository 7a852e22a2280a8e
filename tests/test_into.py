"""`drop_select(..., into=kvrt.KVBuffers(...))` and `drop_select_many(..., into=[...])`: an item
lands in memory the caller gave, and a destination it does not fit loses nothing."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import kvrt
from tests._checks import caught_up
from tests.conftest import make_kv

_SHARED = torch.zeros(16)


def _buffers(elements: int, dtype: torch.dtype = torch.float16, *, hidden: int | None = None) -> kvrt.KVBuffers:
    return kvrt.KVBuffers(
        key=torch.full((elements,), -1.0, dtype=dtype),
        value=torch.full((elements,), -1.0, dtype=dtype),
        hidden=None if hidden is None else torch.full((hidden,), -1.0, dtype=dtype),
    )


async def test_an_item_lands_in_the_callers_buffers_and_its_tensors_are_views_of_them(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(16)
    key, value, hidden = make_kv(tokens)
    assert hidden is not None
    await producer.insert(tokens, None, key, value, hidden)
    into = _buffers(key.numel(), hidden=hidden.numel())
    item = await consumer.drop_select(tokens, into=into)
    assert item is not None
    assert item.key.data_ptr() == into.key.data_ptr() and item.value.data_ptr() == into.value.data_ptr()
    assert item.hidden is not None and item.hidden.data_ptr() == into.hidden.data_ptr()  # type: ignore[union-attr]
    assert torch.equal(item.key, key) and torch.equal(item.value, value) and torch.equal(item.hidden, hidden)
    assert torch.equal(into.key.view(key.shape), key)


async def test_a_larger_buffer_takes_the_item_in_its_leading_elements(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(8)
    key, value, _ = make_kv(tokens, hidden_size=None)
    await producer.insert(tokens, None, key, value)
    into = _buffers(key.numel() + 100)
    item = await consumer.drop_select(tokens, into=into)
    assert item is not None and item.key.shape == key.shape and torch.equal(item.key, key)
    assert torch.equal(into.key[key.numel() :], torch.full((100,), -1.0, dtype=torch.float16))


async def test_a_buffer_the_item_does_not_fit_fails_the_call_and_the_item_stays_buffered(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(8)
    key, value, _ = make_kv(tokens, hidden_size=None)
    await producer.insert(tokens, None, key, value)
    with pytest.raises(kvrt.InvalidInputError, match="key"):
        await consumer.drop_select(tokens, into=_buffers(key.numel() - 1))
    with pytest.raises(kvrt.InvalidInputError, match="bfloat16"):
        await consumer.drop_select(tokens, into=_buffers(key.numel(), torch.bfloat16))
    item = await consumer.drop_select(tokens)
    assert item is not None and torch.equal(item.key, key)


async def test_an_item_with_hidden_states_and_no_buffer_for_them_gets_them_allocated(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(4)
    key, value, hidden = make_kv(tokens)
    await producer.insert(tokens, None, key, value, hidden)
    item = await consumer.drop_select(tokens, into=_buffers(key.numel()))
    assert item is not None and item.hidden is not None and torch.equal(item.hidden, hidden)


async def test_a_miss_leaves_the_buffers_untouched(consumer: kvrt.Consumer) -> None:
    into = _buffers(64)
    assert await consumer.drop_select(torch.arange(4), into=into) is None
    assert torch.equal(into.key, torch.full((64,), -1.0, dtype=torch.float16))


@pytest.mark.parametrize(
    ("into", "complaint"),
    [
        ("not buffers", "KVBuffers"),
        (kvrt.KVBuffers(key=torch.zeros(8), value=torch.zeros(8)[::2]), "contiguous"),
        (kvrt.KVBuffers(key=torch.zeros(8), value=torch.zeros(8, device="meta")), "device"),
        (kvrt.KVBuffers(key=torch.zeros(8, requires_grad=True), value=torch.zeros(8)), "grad"),
        (kvrt.KVBuffers(key=_SHARED[:8], value=_SHARED[4:]), "share memory"),
        (kvrt.KVBuffers(key=_SHARED, value=torch.zeros(8), hidden=_SHARED[8:]), "key and into.hidden share memory"),
    ],
)
async def test_unusable_buffers_are_refused_before_any_request(
    producer: kvrt.Producer, consumer: kvrt.Consumer, into: object, complaint: str
) -> None:
    tokens = torch.arange(4)
    key, value, _ = make_kv(tokens, hidden_size=None)
    await producer.insert(tokens, None, key, value)
    with pytest.raises(kvrt.InvalidInputError, match=complaint):
        await consumer.drop_select(tokens, into=into)  # type: ignore[arg-type]
    assert producer.stats().items == 1


async def test_drop_select_many_lands_each_item_in_its_querys_buffers(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    queries = [torch.arange(4) + 100 * index for index in range(3)]
    kvs = [make_kv(tokens, seed=index, hidden_size=None) for index, tokens in enumerate(queries)]
    for tokens, (key, value, _) in zip(queries, kvs, strict=True):
        await producer.insert(tokens, None, key, value)
    into = [_buffers(kvs[0][0].numel()), None, _buffers(kvs[2][0].numel())]
    items = await consumer.drop_select_many(queries, into=into)
    assert all(item is not None for item in items)
    for index in (0, 2):
        item, buffers = items[index], into[index]
        assert item is not None and buffers is not None
        assert item.key.data_ptr() == buffers.key.data_ptr() and torch.equal(item.key, kvs[index][0])
    assert items[1] is not None and torch.equal(items[1].value, kvs[1][1])


async def test_drop_select_many_refuses_a_buffer_list_of_another_length(consumer: kvrt.Consumer) -> None:
    with pytest.raises(kvrt.InvalidInputError, match="into"):
        await consumer.drop_select_many([torch.arange(4)], into=[None, None])


async def test_a_batch_with_one_item_that_does_not_fit_fails_and_every_item_stays_buffered(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    queries = [torch.arange(4), torch.arange(4) + 100]
    for index, tokens in enumerate(queries):
        key, value, _ = make_kv(tokens, seed=index, hidden_size=None)
        await producer.insert(tokens, None, key, value)
    fits = make_kv(queries[0], hidden_size=None)[0].numel()
    with pytest.raises(kvrt.InvalidInputError):
        await consumer.drop_select_many(queries, into=[_buffers(fits), _buffers(fits - 1)])
    items = await consumer.drop_select_many(queries)
    assert all(item is not None for item in items)


def test_the_blocking_consumer_lands_in_the_callers_buffers_too() -> None:
    tokens = torch.arange(8)
    key, value, _ = make_kv(tokens, hidden_size=None)
    with (
        kvrt.blocking.Producer() as producer,
        kvrt.blocking.Consumer(connect=producer.endpoint) as consumer,
    ):
        producer.insert(tokens, None, key, value)
        into = _buffers(key.numel())
        item = consumer.drop_select(tokens, into=into)
        assert item is not None and item.key.data_ptr() == into.key.data_ptr() and torch.equal(item.key, key)


async def test_with_several_producers_only_the_chosen_item_lands_in_the_buffers() -> None:
    shorter, longer = (
        torch.full((1, 4, 1, 4), 1.0, dtype=torch.float16),
        torch.full((1, 8, 1, 4), 2.0, dtype=torch.float16),
    )
    async with kvrt.Producer() as first, kvrt.Producer() as second:
        await first.insert(torch.arange(4), None, shorter, shorter)
        await second.insert(torch.arange(8), None, longer, longer)  # the longer match wins
        async with kvrt.Consumer(connect=[first.endpoint, second.endpoint]) as consumer:
            into = _buffers(longer.numel() + 16)
            item = await consumer.drop_select(torch.arange(8), into=into)
            assert item is not None and item.matched == 8 and item.key.data_ptr() == into.key.data_ptr()
            assert torch.equal(item.key, longer) and torch.equal(into.value.view(-1)[: longer.numel()], longer.view(-1))
            assert torch.equal(into.key[longer.numel() :], torch.full((16,), -1.0, dtype=torch.float16))
            await caught_up(consumer)
        assert (first.stats().items, second.stats().items) == (1, 0)  # the other one went back


async def test_buffers_torch_refuses_to_write_fail_the_call_and_the_item_stays_buffered(
    producer: kvrt.Producer, consumer: kvrt.Consumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever torch refuses past the checks made up front (here: a copy that raises) is a
    # typed error of that call; the item goes back, the link goes on.
    import kvrt._item

    tokens = torch.arange(8)
    key, value, _ = make_kv(tokens, hidden_size=None)
    await producer.insert(tokens, None, key, value)

    def refused(item: object, into: object) -> object:
        raise RuntimeError("unsupported operation: some elements of the input tensor and the written-to tensor")

    monkeypatch.setattr("kvrt._consumer._arrivals.land_in", refused)
    with pytest.raises(kvrt.InvalidInputError, match="could not be written"):
        await consumer.drop_select(tokens, into=_buffers(key.numel()))
    with pytest.raises(kvrt.InvalidInputError, match="could not be written"):
        await consumer.drop_select_many([tokens], into=[_buffers(key.numel())])
    monkeypatch.undo()
    assert kvrt._item.land_in is not refused
    item = await consumer.drop_select(tokens, into=_buffers(key.numel()))
    assert item is not None and torch.equal(item.key, key)


async def test_drop_select_many_refuses_buffers_that_two_queries_share_before_any_request(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    queries = [torch.arange(4), torch.arange(4) + 100]
    for index, tokens in enumerate(queries):
        key, value, _ = make_kv(tokens, seed=index, hidden_size=None)
        await producer.insert(tokens, None, key, value)
    shared = _buffers(64)
    with pytest.raises(kvrt.InvalidInputError, match="share memory"):
        await consumer.drop_select_many(queries, into=[shared, shared])
    halves = torch.zeros(96, dtype=torch.float16)
    overlapping = [kvrt.KVBuffers(key=halves[:48], value=torch.zeros(48)), _buffers(48)]
    overlapping[1] = kvrt.KVBuffers(key=halves[40:], value=torch.zeros(56, dtype=torch.float16))
    with pytest.raises(kvrt.InvalidInputError, match="share memory"):
        await consumer.drop_select_many(queries, into=overlapping)
    assert producer.stats().items == 2


@pytest.mark.parametrize("lazy", ["negated", "conjugated"])
async def test_a_lazily_negated_or_conjugated_view_is_refused(
    producer: kvrt.Producer, consumer: kvrt.Consumer, lazy: str
) -> None:
    base = torch.zeros(64, dtype=torch.complex64 if lazy == "conjugated" else torch.float16)
    view = base.conj() if lazy == "conjugated" else base._neg_view()
    with pytest.raises(kvrt.InvalidInputError, match="negated or conjugated"):
        await consumer.drop_select(torch.arange(4), into=kvrt.KVBuffers(key=view, value=base.clone()))


@pytest.mark.parametrize("waits", [False, True], ids=["at-once", "waiting"])
async def test_with_several_producers_a_match_that_does_not_fit_fails_the_call_and_every_item_stays(
    waits: bool,
) -> None:
    tokens = torch.arange(8)
    fits = torch.ones(1, 5, 1, 4, dtype=torch.float16)
    does_not = torch.ones(1, 8, 1, 4, dtype=torch.float32)  # the longer match, another dtype
    async with kvrt.Producer() as first, kvrt.Producer() as second:
        await second.insert(tokens[:5], None, fits, fits)
        async with kvrt.Consumer(connect=[first.endpoint, second.endpoint]) as consumer:
            into = _buffers(64)
            if waits:  # the second producer has no match for these: the call waits for one
                lookup = asyncio.create_task(consumer.drop_select(tokens + 1000, timeout=30.0, into=into))
                await caught_up(consumer)
                assert first.stats().waiting_requests == 1
                await first.insert(tokens + 1000, None, does_not, does_not)
                started = time.monotonic()
                with pytest.raises(kvrt.InvalidInputError, match="float32"):
                    await lookup
                assert time.monotonic() - started < 5.0  # at once, not at the timeout
            else:
                await first.insert(tokens, None, does_not, does_not)
                with pytest.raises(kvrt.InvalidInputError, match="float32"):
                    await consumer.drop_select(tokens, into=into)
            assert torch.equal(into.key, torch.full((64,), -1.0, dtype=torch.float16))
            await caught_up(consumer)
        assert (first.stats().items, second.stats().items) == (1, 1)
