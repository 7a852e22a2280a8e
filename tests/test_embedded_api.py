"""The embedded API over real ZeroMQ sockets, producer and consumer in one process."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

import kvrt
from kvrt import _messages as m
from kvrt._errors import ErrorCode
from tests._checks import caught_up, raw_exchange
from tests.conftest import insert_tokens, make_kv


async def test_an_inserted_item_arrives_equal_with_its_matched_length(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(16)
    key, value, hidden = make_kv(tokens, dtype=torch.bfloat16)
    roi = torch.ones(16, dtype=torch.bool)
    await producer.insert(tokens, roi, key, value, hidden)
    item = await consumer.drop_select(torch.arange(10), None)
    assert item is not None
    assert item.matched == 10
    assert torch.equal(item.input_tokens, tokens) and torch.equal(item.roi, roi)  # type: ignore[arg-type]
    assert torch.equal(item.key, key) and torch.equal(item.value, value) and torch.equal(item.hidden, hidden)  # type: ignore[arg-type]


async def test_a_selected_item_leaves_the_buffer(producer: kvrt.Producer, consumer: kvrt.Consumer) -> None:
    await insert_tokens(producer, torch.arange(4))
    assert await consumer.drop_select(torch.arange(4)) is not None
    assert await consumer.drop_select(torch.arange(4)) is None
    assert producer.stats().items == 0


async def test_tokens_none_takes_the_oldest_item(producer: kvrt.Producer, consumer: kvrt.Consumer) -> None:
    await insert_tokens(producer, torch.tensor([5, 6, 7]))
    await insert_tokens(producer, torch.tensor([1, 2]))
    item = await consumer.drop_select(None)
    assert item is not None and item.input_tokens.tolist() == [5, 6, 7] and item.matched == 3


async def test_the_longest_match_wins_then_the_oldest(producer: kvrt.Producer, consumer: kvrt.Consumer) -> None:
    await insert_tokens(producer, torch.tensor([1, 2]), seed=1)
    await insert_tokens(producer, torch.tensor([1, 2, 3, 4]), seed=2)
    await insert_tokens(producer, torch.tensor([1, 2, 3, 4, 5]), seed=3)
    item = await consumer.drop_select(torch.tensor([1, 2, 3, 4, 9]))
    assert item is not None and item.input_tokens.tolist() == [1, 2, 3, 4] and item.matched == 4
    item = await consumer.drop_select(torch.tensor([1, 2, 3]))
    assert item is not None and item.input_tokens.tolist() == [1, 2, 3, 4, 5] and item.matched == 3


async def test_roi_masks_apply_on_both_sides(producer: kvrt.Producer, consumer: kvrt.Consumer) -> None:
    tokens = torch.tensor([9, 1, 2, 9, 3])
    key, value, hidden = make_kv(tokens)
    await producer.insert(tokens, torch.tensor([False, True, True, False, True]), key, value, hidden)
    query_roi = torch.tensor([True, True, False, True])
    item = await consumer.drop_select(torch.tensor([1, 2, 7, 3]), query_roi)
    assert item is not None and item.matched == 3


async def test_drop_select_waits_for_a_later_insert(producer: kvrt.Producer, consumer: kvrt.Consumer) -> None:
    waiting = asyncio.create_task(consumer.drop_select(torch.arange(8), None, timeout=None))
    await caught_up(consumer)
    assert producer.stats().waiting_requests == 1
    await insert_tokens(producer, torch.arange(8))
    item = await waiting
    assert item is not None and item.matched == 8


async def test_drop_select_returns_none_once_its_timeout_passes(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    started = time.monotonic()
    assert await consumer.drop_select(torch.arange(3), None, timeout=0.2) is None
    assert time.monotonic() - started >= 0.2
    assert producer.stats().waiting_requests == 0


async def test_a_hundred_drop_selects_in_flight_each_get_their_own_item(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    for index in range(100):
        await insert_tokens(producer, torch.tensor([index, index + 1000]), seed=index)
    queries = [consumer.drop_select(torch.tensor([index, index + 1000])) for index in range(100)]
    items = await asyncio.gather(*queries)
    for index, item in enumerate(items):
        assert item is not None and item.input_tokens.tolist() == [index, index + 1000]
        assert torch.equal(item.key, make_kv(item.input_tokens, seed=index)[0])


async def test_insert_waits_while_the_buffer_is_full_and_resumes_when_room_is_made() -> None:
    tokens = torch.arange(64)
    key, value, hidden = make_kv(tokens, layers=4, heads=4, head_dim=64)
    item_bytes = tokens.nbytes + key.nbytes + value.nbytes + hidden.nbytes  # type: ignore[union-attr]
    async with (
        kvrt.Producer(buffer_bytes=2 * item_bytes) as producer,
        kvrt.Consumer(connect=producer.endpoint) as consumer,
    ):
        for _ in range(3):  # the third goes in: insert waits only while the buffer is *over* the limit
            await producer.insert(tokens, None, key, value, hidden)
        blocked = asyncio.create_task(producer.insert(tokens, None, key, value, hidden))
        await caught_up(consumer)
        assert not blocked.done()
        assert producer.stats().buffer_bytes == 3 * item_bytes
        assert await consumer.drop_select(tokens) is not None
        await blocked
        assert producer.stats().buffer_bytes <= 3 * item_bytes


async def test_insert_into_a_full_buffer_times_out_with_a_typed_error() -> None:
    tokens = torch.arange(8)
    key, value, hidden = make_kv(tokens)
    async with kvrt.Producer(buffer_bytes=1) as producer:
        await producer.insert(tokens, None, key, value, hidden)
        with pytest.raises(kvrt.KVRTTimeoutError, match="no consumer is taking items") as caught:
            await producer.insert(tokens, None, key, value, hidden, timeout=0.05)
        assert caught.value.phase == "insert"
        assert producer.stats().items == 1


async def test_the_caller_may_change_its_tensors_after_insert_returns(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(6)
    key, value, hidden = make_kv(tokens)
    original = key.clone()
    await producer.insert(tokens, None, key, value, hidden)
    key.fill_(0)
    tokens.fill_(0)
    item = await consumer.drop_select(torch.arange(6))
    assert item is not None and torch.equal(item.key, original)


async def test_hidden_none_and_non_contiguous_tensors_are_carried(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(5)
    key = torch.randn(4, 2, 5, 3).transpose(1, 2)
    value = torch.randn(4, 5, 2, 3)
    await producer.insert(tokens, None, key, value, None)
    item = await consumer.drop_select(tokens)
    assert item is not None and item.hidden is None and item.roi is None
    assert torch.equal(item.key, key) and item.key.is_contiguous()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"input_tokens": torch.arange(4.0)}, "input_tokens must be a 1-D integer tensor"),
        ({"roi": torch.ones(3, dtype=torch.bool)}, "roi has 3 entries for 4 input tokens"),
        ({"roi": torch.ones(4)}, "roi must be None or a 1-D bool mask"),
        ({"key": torch.zeros(2, 5, 2, 4)}, "key has 5 tokens on axis 1, input_tokens has 4"),
        ({"value": torch.zeros(4, 2, 4)}, "value must be a 4-D tensor"),
        ({"value": torch.zeros(3, 4, 2, 4)}, "key has 2 layers, value has 3"),
        ({"hidden": torch.zeros(3, 8)}, "hidden has 3 tokens on axis 0"),
        ({"input_tokens": [1, 2, 3, 4]}, "got list"),
    ],
)
async def test_bad_input_to_insert_is_refused_clearly_and_changes_nothing(
    producer: kvrt.Producer, consumer: kvrt.Consumer, change: dict[str, object], message: str
) -> None:
    tokens = torch.arange(4)
    key, value, hidden = make_kv(tokens)
    arguments: dict[str, object] = {"input_tokens": tokens, "roi": None, "key": key, "value": value, "hidden": hidden}
    arguments.update(change)
    with pytest.raises(kvrt.InvalidInputError, match=message):
        await producer.insert(**arguments)  # type: ignore[arg-type]
    assert producer.stats().items == 0
    await insert_tokens(producer, tokens)
    assert await consumer.drop_select(tokens) is not None


@pytest.mark.parametrize(
    ("tokens", "roi", "timeout", "message"),
    [
        (torch.zeros(2, 2, dtype=torch.int64), None, 0.0, "1-D integer tensor"),
        (torch.arange(3), torch.ones(2, dtype=torch.bool), 0.0, "roi has 2 entries"),
        (None, torch.ones(2, dtype=torch.bool), 0.0, "roi was given without input_tokens"),
        (torch.arange(3), None, -1.0, "timeout must be None or a finite number"),
        (torch.arange(3), None, float("inf"), "timeout must be None or a finite number"),
    ],
)
async def test_bad_input_to_drop_select_is_refused_clearly(
    consumer: kvrt.Consumer, tokens: torch.Tensor | None, roi: torch.Tensor | None, timeout: float, message: str
) -> None:
    with pytest.raises(kvrt.InvalidInputError, match=message):
        await consumer.drop_select(tokens, roi, timeout=timeout)


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\xff\x00garbage"], ErrorCode.PROTOCOL),
        ([msgspec.msgpack.encode([m.PROTOCOL_VERSION, {"type": "no_such_message"}])], ErrorCode.PROTOCOL),
        ([msgspec.msgpack.encode([99, {"type": "ping"}])], ErrorCode.VERSION),
        ([m.encode(m.DropSelect(request_id=1, tokens=bytes(8)))], ErrorCode.UNKNOWN_PEER),
        ([m.encode(m.Hello(version=m.PROTOCOL_VERSION)), b"unexpected payload"], ErrorCode.PROTOCOL),
    ],
    ids=["not-msgpack", "unknown-tag", "wrong-version", "no-hello", "payload-on-control"],
)
async def test_garbage_from_a_raw_socket_gets_a_typed_reply_and_others_are_still_served(
    producer: kvrt.Producer, consumer: kvrt.Consumer, frames: list[bytes], code: ErrorCode
) -> None:
    reply = await raw_exchange(producer.endpoint, frames)
    assert isinstance(reply, m.ErrorReply)
    assert reply.code is code and reply.message
    await insert_tokens(producer, torch.arange(3))
    assert await consumer.drop_select(torch.arange(3)) is not None


async def test_closing_the_consumer_ends_its_pending_calls_with_closed_error(producer: kvrt.Producer) -> None:
    consumer = await kvrt.Consumer(connect=producer.endpoint).start()
    pending = [asyncio.create_task(consumer.drop_select(torch.arange(3), None, timeout=None)) for _ in range(3)]
    await caught_up(consumer)
    await consumer.aclose()
    for task in pending:
        with pytest.raises(kvrt.ClosedError):
            await task
    with pytest.raises(kvrt.ClosedError):
        await consumer.drop_select(torch.arange(3))


async def test_an_item_taken_right_before_close_stays_taken_and_is_never_delivered_again(
    producer: kvrt.Producer,
) -> None:
    # Its receipt leaves before the consumer's bye: a bye first would put the item back in
    # the buffer, and the next consumer would get it a second time.
    await insert_tokens(producer, torch.arange(4))
    producer._serving.peer_left.clear()
    async with kvrt.Consumer(connect=producer.endpoint) as consumer:
        assert await consumer.drop_select(torch.arange(4)) is not None
    await asyncio.wait_for(producer._serving.peer_left.wait(), 5.0)
    stats = producer.stats()
    assert (stats.items, stats.in_flight, stats.totals.delivered_items, stats.totals.returned_items) == (0, 0, 1, 0)
    async with kvrt.Consumer(connect=producer.endpoint) as second:
        assert await second.drop_select(torch.arange(4)) is None


async def test_a_receipt_waits_for_room_in_a_full_send_queue_instead_of_being_dropped(
    producer: kvrt.Producer,
) -> None:
    # A dropped receipt would leave the item in flight until the consumer leaves, then put it
    # back in the buffer for the next consumer: taken twice.
    await insert_tokens(producer, torch.arange(4))
    producer._serving.peer_left.clear()
    refused: list[int] = []
    async with kvrt.Consumer(connect=producer.endpoint) as consumer:
        io = consumer.link_for_tests().session.io
        send_nowait = io.send_nowait

        def full_for_three_receipts(frames: Any) -> bool:
            if isinstance(m.decode(bytes(frames[0])), m.Received) and len(refused) < 3:
                refused.append(1)
                return False  # as a full queue answers
            return bool(send_nowait(frames))

        io.send_nowait = full_for_three_receipts
        assert await consumer.drop_select(torch.arange(4)) is not None
        await caught_up(consumer)
        assert producer.stats().totals.delivered_items == 1
    await asyncio.wait_for(producer._serving.peer_left.wait(), 5.0)
    stats = producer.stats()
    assert len(refused) == 3 and (stats.items, stats.totals.returned_items) == (0, 0)


async def test_a_closing_producer_ends_the_consumers_pending_calls_with_peer_lost() -> None:
    producer = await kvrt.Producer().start()
    async with kvrt.Consumer(connect=producer.endpoint) as consumer:
        pending = asyncio.create_task(consumer.drop_select(torch.arange(3), None, timeout=None))
        await caught_up(consumer)
        await producer.aclose()
        with pytest.raises(kvrt.PeerLostError, match="closed"):
            await pending


async def test_a_closing_producer_ends_inserts_waiting_for_room_with_closed_error() -> None:
    tokens = torch.arange(8)
    key, value, hidden = make_kv(tokens)
    producer = await kvrt.Producer(buffer_bytes=1).start()
    await producer.insert(tokens, None, key, value, hidden)
    blocked = asyncio.create_task(producer.insert(tokens, None, key, value, hidden))
    await asyncio.sleep(0)  # let it reach its wait; the assertion below holds either way
    await producer.aclose()
    with pytest.raises(kvrt.ClosedError):
        await blocked


async def test_a_cancelled_drop_select_stops_waiting_on_the_producer(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    waiting = asyncio.create_task(consumer.drop_select(torch.arange(3), None, timeout=None))
    await caught_up(consumer)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await caught_up(consumer)
    assert producer.stats().waiting_requests == 0
    await insert_tokens(producer, torch.arange(3))
    assert producer.stats().items == 1


async def test_connecting_to_nothing_fails_within_the_connect_timeout() -> None:
    context = zmq.Context()
    placeholder = context.socket(zmq.ROUTER)  # a port nobody answers on
    port = placeholder.bind_to_random_port("tcp://127.0.0.1")
    placeholder.close()
    context.term()
    started = time.monotonic()
    with pytest.raises(kvrt.KVRTTimeoutError, match="no producer answered") as caught:
        await kvrt.Consumer(connect=f"tcp://127.0.0.1:{port}", connect_timeout_s=0.3).start()
    assert caught.value.phase == "connect"
    assert time.monotonic() - started < 5


async def test_calls_on_a_producer_not_started_say_how_to_start_it() -> None:
    producer = kvrt.Producer()
    with pytest.raises(kvrt.ClosedError, match="not started"):
        await insert_tokens(producer, torch.arange(2))


async def test_binding_an_address_in_use_is_a_clear_error(producer: kvrt.Producer) -> None:
    with pytest.raises(kvrt.InvalidInputError, match="already in use"):
        await kvrt.Producer(bind=producer.endpoint).start()


def test_bad_constructor_arguments_are_refused() -> None:
    with pytest.raises(kvrt.InvalidInputError, match="buffer_bytes"):
        kvrt.Producer(buffer_bytes=0)
    with pytest.raises(kvrt.InvalidInputError, match="device"):
        kvrt.Producer(device="abacus")
    with pytest.raises(kvrt.InvalidInputError, match="connect"):
        kvrt.Consumer(connect="")
    with pytest.raises(kvrt.InvalidInputError, match="transfer_timeout_s"):
        kvrt.Consumer(connect="tcp://127.0.0.1:1", transfer_timeout_s=0)


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
async def test_both_sides_say_which_transport_the_items_travel_over(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="kvrt")
    async with (
        kvrt.Producer(transport=transport) as producer,
        kvrt.Consumer(connect=producer.endpoint, transport=transport) as consumer,
    ):
        assert consumer.transports == {producer.endpoint: transport}
        assert producer.stats().transports == {transport: 1}
        assert f"travel over {transport}" in caplog.text
    assert producer.stats().transports == {}
