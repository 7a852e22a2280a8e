"""`kvrt.compat.vllm.KVLookupBuffer` through the seed's own behaviours (vLLM's SimpleBuffer
and its tests): the same calls and fields, over real sockets, from plain threads."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import kvrt
from kvrt.compat.vllm import KVLookupBuffer

JOIN_S = 30.0
SEED_THRESHOLD = 170000


@pytest.fixture
def producer() -> Iterator[KVLookupBuffer]:
    with KVLookupBuffer("producer", 1e9) as buffer:
        yield buffer


@pytest.fixture
def consumer(producer: KVLookupBuffer) -> Iterator[KVLookupBuffer]:
    with KVLookupBuffer("consumer", 1e9, endpoint=producer.endpoint) as buffer:
        yield buffer


def request(tokens: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """roi, key, value, hidden for `tokens`, in shapes the seed accepts and kvrt's API does not."""
    generator = torch.Generator().manual_seed(seed)
    roi = torch.ones(tokens.shape, dtype=torch.bool)
    return roi, torch.rand(5, 6, generator=generator), torch.rand(7, generator=generator), torch.rand(3, 2, 2)


def the_same(given: list[Any], got: list[Any]) -> bool:
    return all(
        (a is None and b is None) or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
        for a, b in zip(given, got, strict=True)
    )


def test_the_seeds_run_an_item_goes_across_equal_and_the_buffer_is_empty_again(
    producer: KVLookupBuffer, consumer: KVLookupBuffer
) -> None:
    assert producer.buffer_size == 0 and len(producer.buffer) == 0
    tokens = torch.tensor([1, 2, 3])
    roi = tokens > 0
    key, value, placeholder = 2.0 * torch.ones([5, 6]), 3.0 * torch.ones([5, 6]), torch.tensor([1])
    producer.insert(tokens, roi, key, value, placeholder)
    assert len(producer.buffer) == 1 and len(producer) == 1
    assert producer.buffer_size == 3 * 8 + 3 + 5 * 6 * 4 * 2 + 8  # the five tensors' bytes, as the seed counts
    got = consumer.drop_select(tokens, roi)
    assert the_same([tokens, roi, key, value, placeholder], got)
    assert producer.buffer_size == 0 and len(producer.buffer) == 0


def test_a_prefix_either_way_matches_and_the_rest_misses(producer: KVLookupBuffer, consumer: KVLookupBuffer) -> None:
    for tokens in (torch.tensor([1, 2, 3, 4]), torch.tensor([7, 8])):
        producer.insert(tokens, *request(tokens))
    assert consumer.drop_select(torch.tensor([9, 9]), None) == [None] * 5
    shorter = consumer.drop_select(torch.tensor([1, 2]), None)[0]
    assert shorter is not None and shorter.tolist() == [1, 2, 3, 4]
    longer = consumer.drop_select(torch.tensor([7, 8, 9]), None)[0]
    assert longer is not None and longer.tolist() == [7, 8]


def test_each_sides_roi_masks_its_tokens_before_matching(producer: KVLookupBuffer, consumer: KVLookupBuffer) -> None:
    tokens = torch.tensor([5, 1, 2, 5, 3])
    _, key, value, hidden = request(tokens)
    producer.insert(tokens, torch.tensor([False, True, True, False, True]), key, value, hidden)
    assert consumer.drop_select(torch.tensor([1, 2, 4]), torch.tensor([True, True, True]))[0] is None
    got = consumer.drop_select(torch.tensor([1, 2, 4, 3]), torch.tensor([1.0, 1.0, 0.0, 1.0]))  # a float roi, > 0.5
    assert got[0] is not None and got[0].tolist() == tokens.tolist()
    assert got[1] is not None and got[1].tolist() == [False, True, True, False, True]


def test_none_tokens_take_any_item_and_on_an_empty_buffer_miss(
    producer: KVLookupBuffer, consumer: KVLookupBuffer
) -> None:
    tokens = torch.tensor([4, 5, 6])
    producer.insert(tokens, *request(tokens))
    got = consumer.drop_select(None, None)
    assert got[0] is not None and got[0].tolist() == [4, 5, 6]
    assert consumer.drop_select(None, None) == [None, None, None, None, None]


def test_tokens_of_any_dtype_compare_by_value(producer: KVLookupBuffer, consumer: KVLookupBuffer) -> None:
    int32 = torch.tensor([10, 11, 12], dtype=torch.int32)
    floats = torch.rand(4)
    producer.insert(int32, *request(int32))
    producer.insert(floats, *request(floats))
    got = consumer.drop_select(torch.tensor([10.0, 11.0]), None)  # float query, integer item
    assert got[0] is not None and got[0].dtype == torch.int32 and got[0].tolist() == [10, 11, 12]
    got = consumer.drop_select(floats.clone(), None)
    assert got[0] is not None and torch.equal(got[0], floats)


def test_key_value_and_hidden_of_any_shape_and_dtype_come_back_as_given(
    producer: KVLookupBuffer, consumer: KVLookupBuffer
) -> None:
    tokens = torch.arange(3, dtype=torch.int16)
    given = [
        tokens,
        None,
        torch.randn(2, 3, 4, 5, 6).to(torch.bfloat16),
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
        None,
    ]
    producer.insert(*given)
    got = consumer.drop_select(tokens, None)
    assert the_same(given, got)


def test_a_stress_run_like_the_seeds_leaves_the_misses_buffered_and_counted() -> None:
    random.seed(0)
    generator = torch.Generator().manual_seed(100)
    requests = [
        (torch.rand(100, generator=generator), torch.ones(100).bool(), torch.rand(100, generator=generator),
         torch.rand(100, generator=generator), torch.rand(100, generator=generator))
        for _ in range(200)
    ]  # fmt: skip
    inserted, asked = random.sample(requests, len(requests)), random.sample(requests, len(requests))
    with (
        KVLookupBuffer("producer", 1e9) as producer,
        KVLookupBuffer("consumer", 1e9, endpoint=producer.endpoint) as consumer,
        ThreadPoolExecutor(max_workers=2) as pool,
    ):

        def decode() -> int:
            misses = 0
            for tokens, roi, key, value, hidden in asked:
                got = consumer.drop_select(tokens, roi)
                if got[0] is None:
                    assert got == [None] * 5
                    misses += 1
                else:
                    assert the_same([tokens, roi, key, value, hidden], got)
            return misses

        prefill = pool.submit(lambda: [producer.insert(*each) for each in inserted])
        misses = pool.submit(decode).result(JOIN_S)
        prefill.result(JOIN_S)
        assert misses == len(producer.buffer)
        assert producer.buffer_size == 1700 * len(producer.buffer)


def test_insert_waits_while_the_buffer_is_over_its_threshold_and_resumes_when_an_item_is_taken() -> None:
    with (
        KVLookupBuffer("producer", 100) as producer,
        KVLookupBuffer("consumer", 100, endpoint=producer.endpoint) as consumer,
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        first, second = torch.arange(50), torch.arange(50, 100)
        producer.insert(first, *request(first))  # the buffer held nothing: it goes in, over the threshold
        service = producer._producer._service  # type: ignore[union-attr]
        original, waiting = service.insert, threading.Event()

        async def waits(*args: Any, **kwargs: Any) -> None:
            waiting.set()
            await original(*args, **kwargs)

        service.insert = waits
        blocked = pool.submit(producer.insert, second, *request(second))
        assert waiting.wait(JOIN_S)
        assert not blocked.done() and len(producer.buffer) == 1
        got = consumer.drop_select(first, None)
        assert got[0] is not None
        blocked.result(JOIN_S)
        assert consumer.drop_select(second, None)[0] is not None


def test_many_items_in_flight_from_many_threads_each_arrive_once(
    producer: KVLookupBuffer, consumer: KVLookupBuffer
) -> None:
    tokens = [torch.arange(16) + 1000 * index for index in range(64)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda each: producer.insert(each, *request(each)), tokens, timeout=JOIN_S))
        got = list(pool.map(lambda each: consumer.drop_select(each, None), tokens, timeout=JOIN_S))
    assert [int(item[0][0]) for item in got if item[0] is not None] == [int(each[0]) for each in tokens]
    assert len(producer.buffer) == 0 and producer.buffer_size == 0


def test_a_closed_consumer_refuses_calls_and_the_producer_keeps_serving(producer: KVLookupBuffer) -> None:
    tokens = torch.arange(4)
    producer.insert(tokens, *request(tokens))
    consumer = KVLookupBuffer("consumer", 1e9, endpoint=producer.endpoint)
    consumer.close()
    with pytest.raises(kvrt.ClosedError):
        consumer.drop_select(tokens, None)
    with KVLookupBuffer("consumer", 1e9, endpoint=producer.endpoint) as another:
        assert another.drop_select(tokens, None)[0] is not None


def test_closing_the_producer_ends_an_insert_waiting_for_room_and_the_consumers_calls() -> None:
    producer = KVLookupBuffer("producer", 1)
    consumer = KVLookupBuffer("consumer", 1, endpoint=producer.endpoint)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            tokens = torch.arange(8)
            producer.insert(tokens, *request(tokens))
            blocked = pool.submit(producer.insert, tokens + 8, *request(tokens + 8))
            producer.close()
            with pytest.raises(kvrt.ClosedError):
                blocked.result(JOIN_S)
        with pytest.raises(kvrt.PeerLostError):
            consumer.drop_select(tokens, None)
    finally:
        producer.close()
        consumer.close()


def test_each_role_refuses_the_other_roles_call(producer: KVLookupBuffer, consumer: KVLookupBuffer) -> None:
    tokens = torch.arange(2)
    with pytest.raises(kvrt.InvalidInputError, match="drop_select is for the consumer role"):
        producer.drop_select(tokens, None)
    with pytest.raises(kvrt.InvalidInputError, match="insert is for the producer role"):
        consumer.insert(tokens, *request(tokens))
    assert consumer.buffer_size == 0 and len(consumer.buffer) == 0


@pytest.mark.parametrize(
    ("arguments", "options", "message"),
    [
        (("prefill", 1e9), {}, "role must be 'producer'"),
        (("consumer", 1e9), {}, "a consumer needs endpoint= \\(or KVRT_CONNECT\\)"),
        (("consumer", 1e9), {"endpoint": "127.0.0.1:5555"}, "has no scheme: write tcp://HOST:PORT"),
        (("producer", -1), {}, "buffer_size_thresh must be a number of bytes >= 0"),
        (("producer", 1e9), {"buffer_bytes": 10}, "buffer_bytes= is set by endpoint and buffer_size_thresh"),
    ],
)
def test_bad_arguments_are_refused_with_what_to_write(
    arguments: tuple[str, float], options: dict[str, Any], message: str
) -> None:
    with pytest.raises(kvrt.InvalidInputError, match=message):
        KVLookupBuffer(*arguments, **options)


def test_an_empty_token_tensor_is_refused(producer: KVLookupBuffer) -> None:
    empty = torch.tensor([], dtype=torch.int64)
    with pytest.raises(kvrt.InvalidInputError, match="at least one token"):
        producer.insert(empty, None, torch.ones(2), torch.ones(2), None)
