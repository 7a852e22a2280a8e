"""Layer-wise streams on CPU: decode reads layer i while prefill still computes layer i+1.

Every test runs over TCP (layers as frames) and over a gloo pair (layers out of band, one
transfer each, as over NCCL on GPUs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import torch

import kvrt
from kvrt import _messages as m
from kvrt._zmqio import MAX_QUEUED_MESSAGES
from tests._checks import caught_up, collected, damage_the_first, read_whole, reads_whole_again
from tests.conftest import give_up_when_its_reply_comes, make_kv

LAYERS, TOKENS, HEADS, DIM = 4, 6, 2, 8


def layer_kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(layer)
    return torch.randn(TOKENS, HEADS, DIM, generator=generator), torch.randn(TOKENS, HEADS, DIM, generator=generator)


@pytest.fixture(params=["tcp", "gloo"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def producer(transport: str) -> AsyncIterator[kvrt.Producer]:
    async with kvrt.Producer(bind="tcp://127.0.0.1:0", transport=transport) as started:
        yield started


@pytest.fixture
async def consumer(producer: kvrt.Producer, transport: str) -> AsyncIterator[kvrt.Consumer]:
    async with kvrt.Consumer(connect=producer.endpoint, transport=transport) as started:
        yield started


async def test_layer_i_arrives_while_layer_i_plus_one_is_not_yet_computed(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    await stream.put_layer(*layer_kv(0))
    reader = await consumer.open_stream(tokens)
    assert reader is not None and (reader.matched, reader.layers) == (TOKENS, LAYERS)
    key, value = await reader.layer(0)
    assert torch.equal(key, layer_kv(0)[0]) and torch.equal(value, layer_kv(0)[1])
    second = asyncio.ensure_future(reader.layer(1))
    await caught_up(consumer)
    assert not second.done()  # layer 1 has not been computed yet
    await stream.put_layer(*layer_kv(1))
    key, _ = await second
    assert torch.equal(key, layer_kv(1)[0])
    assert await reader.layer_event(1) is None  # on CPU a delivered layer is there already
    for layer in (2, 3):
        await stream.put_layer(*layer_kv(layer))
    hidden = torch.randn(TOKENS, 5)
    await stream.finish(hidden)
    got = await reader.finished()
    assert got is not None and torch.equal(got, hidden)
    await caught_up(consumer)
    stats = producer.stats()
    assert (stats.items, stats.in_flight, stats.buffer_bytes) == (0, 0, 0)


async def test_a_reader_can_iterate_layers_as_they_land(producer: kvrt.Producer, consumer: kvrt.Consumer) -> None:
    tokens = torch.arange(100, 100 + TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    reader = await consumer.open_stream(tokens)
    assert reader is not None

    async def prefill() -> None:
        for layer in range(LAYERS):
            await stream.put_layer(*layer_kv(layer))
        await stream.finish()

    writer = asyncio.create_task(prefill())
    seen = [(layer, torch.equal(key, layer_kv(layer)[0])) async for layer, key, _ in reader]
    await writer
    assert seen == [(layer, True) for layer in range(LAYERS)]
    assert await reader.finished() is None


async def test_a_reader_that_iterated_every_layer_holds_the_stream_and_no_second_reader_gets_it(
    producer: kvrt.Producer, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Iterating a stream ends once its end came and was confirmed, not at its last layer: a
    reader that leaves right after its loop does not hand its KV to the next reader. Here the
    end is handled 50 ms after the last layer, as a busy loop might."""
    from kvrt._consumer._stream_layers import StreamLayers

    on_streamed = StreamLayers.on_streamed

    def end_handled_later(self: StreamLayers, message: Any, payload: Any) -> None:
        if isinstance(message, m.StreamEnd):
            asyncio.get_running_loop().call_later(0.05, on_streamed, self, message, payload)
            return
        on_streamed(self, message, payload)

    monkeypatch.setattr(StreamLayers, "on_streamed", end_handled_later)
    tokens = torch.arange(150, 150 + TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    async with kvrt.Consumer(connect=producer.endpoint, transport=transport) as first:
        reader = await first.open_stream(tokens)
        assert reader is not None
        for layer in range(LAYERS):
            await stream.put_layer(*layer_kv(layer))
        await stream.finish()
        seen = [layer async for layer, _, _ in reader]
        assert seen == list(range(LAYERS))
    async with kvrt.Consumer(connect=producer.endpoint, transport=transport) as second:
        assert await second.drop_select(tokens) is None
        assert await second.open_stream(tokens, timeout=0) is None
    stats = producer.stats()
    assert (stats.items, stats.in_flight, stats.totals.delivered_items) == (0, 0, 1)


async def test_a_late_reader_gets_the_layers_so_far_at_once_then_the_rest(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(200, 200 + TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    for layer in range(3):
        await stream.put_layer(*layer_kv(layer))
    reader = await consumer.open_stream(tokens)
    assert reader is not None
    for layer in range(3):
        assert torch.equal((await reader.layer(layer))[1], layer_kv(layer)[1])
    await stream.put_layer(*layer_kv(3))
    await stream.finish()
    assert torch.equal((await reader.layer(3))[0], layer_kv(3)[0])


async def test_an_aborted_prefill_fails_the_reader_and_drops_what_it_received(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(300, 300 + TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    await stream.put_layer(*layer_kv(0))
    reader = await consumer.open_stream(tokens)
    assert reader is not None
    await reader.layer(0)
    waiting = asyncio.ensure_future(reader.layer(2))
    await stream.abort("out of memory on the prefill GPU")
    with pytest.raises(kvrt.StreamAbortedError, match="out of memory"):
        await waiting
    with pytest.raises(kvrt.StreamAbortedError):
        await reader.layer(0)  # what arrived is void
    await caught_up(consumer)
    assert (producer.stats().items, producer.stats().in_flight, producer.stats().buffer_bytes) == (0, 0, 0)


async def test_a_stream_nobody_read_becomes_an_ordinary_item(producer: kvrt.Producer, consumer: kvrt.Consumer) -> None:
    tokens = torch.arange(400, 400 + TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    assert await consumer.drop_select(tokens) is None  # unfinished: only a streaming request takes it
    for layer in range(LAYERS):
        await stream.put_layer(*layer_kv(layer))
    await stream.finish()
    item = await consumer.drop_select(tokens)
    assert item is not None and item.key.shape == (LAYERS, TOKENS, HEADS, DIM)
    assert all(torch.equal(item.value[layer], layer_kv(layer)[1]) for layer in range(LAYERS))


async def test_a_streaming_request_takes_a_finished_item_layer_by_layer(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(500, 500 + TOKENS)
    keys = torch.stack([layer_kv(layer)[0] for layer in range(LAYERS)])
    values = torch.stack([layer_kv(layer)[1] for layer in range(LAYERS)])
    await producer.insert(tokens, None, keys, values, None)
    reader = await consumer.open_stream(tokens)
    assert reader is not None and reader.layers == LAYERS
    arrived = [(await reader.layer(layer))[0] for layer in range(LAYERS)]
    assert all(torch.equal(key, keys[layer]) for layer, key in enumerate(arrived))
    assert await reader.finished() is None


async def test_a_reader_that_leaves_mid_stream_hands_it_to_the_next_reader(
    producer: kvrt.Producer, transport: str
) -> None:
    tokens = torch.arange(600, 600 + TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    await stream.put_layer(*layer_kv(0))
    async with kvrt.Consumer(connect=producer.endpoint, transport=transport) as first:
        reader = await first.open_stream(tokens)
        assert reader is not None
        await reader.layer(0)
    async with kvrt.Consumer(connect=producer.endpoint, transport=transport) as second:
        reader = await second.open_stream(tokens)  # the first said bye: the stream is back, layers kept
        assert reader is not None
        assert torch.equal((await reader.layer(0))[0], layer_kv(0)[0])
        for layer in range(1, LAYERS):
            await stream.put_layer(*layer_kv(layer))
        await stream.finish()
        assert await reader.finished() is None


async def test_a_waiting_streaming_request_takes_a_stream_opened_later(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    tokens = torch.arange(700, 700 + TOKENS)
    opening = asyncio.create_task(consumer.open_stream(tokens, None, timeout=None))
    await caught_up(consumer)
    stream = await producer.open_stream(tokens, layers=1)
    reader = await opening
    assert reader is not None
    await stream.put_layer(*layer_kv(0))
    await stream.finish()
    assert torch.equal((await reader.layer(0))[0], layer_kv(0)[0])


async def test_bad_layers_are_refused_clearly(producer: kvrt.Producer) -> None:
    stream = await producer.open_stream(torch.arange(TOKENS), layers=1)
    with pytest.raises(kvrt.InvalidInputError, match="tokens=6"):
        await stream.put_layer(torch.zeros(5, HEADS, DIM), torch.zeros(5, HEADS, DIM))
    with pytest.raises(kvrt.InvalidInputError, match="after 0 of 1 layers"):
        await stream.finish()
    for layers in (0, 65537):  # the protocol carries at most 65536: a stream it could not start
        with pytest.raises(kvrt.InvalidInputError, match=r"layers must be an int in \[1, 65536\]"):
            await producer.open_stream(torch.arange(3), layers=layers)


async def test_a_stream_opened_over_the_buffer_limit_waits_for_room_or_is_refused_at_once() -> None:
    async with (
        kvrt.Producer(bind="tcp://127.0.0.1:0", buffer_bytes=1) as producer,
        kvrt.Consumer(connect=producer.endpoint) as consumer,
    ):
        first = await producer.open_stream(torch.arange(TOKENS), layers=1)
        await first.put_layer(*layer_kv(0))
        await first.finish()
        assert producer.stats().buffer_bytes > producer.buffer_bytes
        with pytest.raises(kvrt.KVRTTimeoutError, match="stayed over 1 bytes"):
            await producer.open_stream(torch.arange(100, 100 + TOKENS), layers=1, timeout=0)
        waiting = asyncio.create_task(producer.open_stream(torch.arange(200, 200 + TOKENS), layers=1, timeout=10))
        await asyncio.sleep(0)
        assert not waiting.done()
        assert await consumer.drop_select(torch.arange(TOKENS)) is not None  # room again
        second = await waiting
        assert second.layers == 1
        await second.abort("done")


# -- over a pair: layers out of band --------------------------------------------------------


async def test_over_a_pair_each_layer_and_the_end_travel_out_of_band_in_one_transfer_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvrt.transports.paired import PairedReceiver

    received: list[int] = []
    receive_tensors = PairedReceiver.receive_tensors

    def counting(self: PairedReceiver, metas: Any, frames: Any) -> Any:
        received.append(len(frames))
        return receive_tensors(self, metas, frames)

    monkeypatch.setattr(PairedReceiver, "receive_tensors", counting)
    async with (
        kvrt.Producer(transport="gloo") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="gloo") as consumer,
    ):
        tokens = torch.arange(800, 800 + TOKENS)
        stream = await producer.open_stream(tokens, layers=LAYERS)
        reader = await consumer.open_stream(tokens)
        assert reader is not None
        for layer in range(LAYERS):
            await stream.put_layer(*layer_kv(layer))
        hidden = torch.randn(TOKENS, 3)
        await stream.finish(hidden)
        got = await reader.finished()
        assert got is not None and torch.equal(got, hidden)
        values = [(await reader.layer(layer))[1] for layer in range(LAYERS)]
        assert all(torch.equal(value, layer_kv(layer)[1]) for layer, value in enumerate(values))
    assert received == [0] * (LAYERS + 1)  # one posted receive per layer and one for the end; no frames


async def test_a_stream_whose_reader_gave_up_as_it_came_goes_back_with_its_layers(
    producer: kvrt.Producer, consumer: kvrt.Consumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = torch.arange(900, 900 + TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    for layer in range(2):
        await stream.put_layer(*layer_kv(layer))
    opening = asyncio.create_task(consumer.open_stream(tokens))
    give_up_when_its_reply_comes(monkeypatch, consumer, opening, m.StreamStart)
    with pytest.raises(asyncio.CancelledError):
        await opening
    # The two layers came all the same (over a pair: their bytes): received and dropped, so
    # the next transfer on the link is read right.
    other = torch.tensor([5, 5])
    await producer.insert(other, None, *make_kv(other, seed=3))
    item = await consumer.drop_select(other, timeout=10)
    assert item is not None and torch.equal(item.value, make_kv(other, seed=3)[1])
    reader = await consumer.open_stream(tokens, timeout=10)  # given back, its layers kept
    assert reader is not None
    for layer in range(2, LAYERS):
        await stream.put_layer(*layer_kv(layer))
    await stream.finish()
    keys = [(await reader.layer(layer))[0] for layer in range(LAYERS)]
    assert all(torch.equal(key, layer_kv(layer)[0]) for layer, key in enumerate(keys))
    assert await reader.finished() is None


async def test_a_stream_that_ends_without_a_layer_fails_that_layer_instead_of_hanging() -> None:
    stream = kvrt.ConsumerStream(torch.arange(TOKENS), None, TOKENS, 2, confirm=lambda: None)
    stream.deliver_layer(0, *layer_kv(0))
    stream.finish(None)  # a producer that skipped layer 1
    assert torch.equal((await stream.layer(0))[0], layer_kv(0)[0])
    with pytest.raises(kvrt.RemoteProtocolError, match="without layer 1"):
        await stream.layer(1)


async def test_an_ended_stream_frees_its_layers_though_the_prefill_keeps_its_handle(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    import weakref

    for ending in ("finish", "abort"):
        tokens = torch.arange(1000, 1000 + TOKENS) + (0 if ending == "finish" else 100)
        stream = await producer.open_stream(tokens, layers=LAYERS)
        for layer in range(LAYERS):
            await stream.put_layer(*layer_kv(layer))
        own_copy = weakref.ref(producer._bytes[stream._item].store.keys[0])  # type: ignore[union-attr]
        await (stream.finish() if ending == "finish" else stream.abort())
        await collected()
        assert own_copy() is None, ending  # `stream` is still referenced here
    item = await consumer.drop_select(torch.arange(1000, 1000 + TOKENS))  # the finished one, whole
    assert item is not None and all(torch.equal(item.key[layer], layer_kv(layer)[0]) for layer in range(LAYERS))


async def test_a_stream_read_to_its_end_is_written_whole_only_if_its_reader_leaves_unconfirmed(
    producer: kvrt.Producer, consumer: kvrt.Consumer, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import weakref

    stacks: list[int] = []
    stack = torch.stack

    def counted_stack(*args: Any, **kwargs: Any) -> torch.Tensor:
        stacks.append(len(args[0]))
        return stack(*args, **kwargs)

    monkeypatch.setattr(torch, "stack", counted_stack)
    # Read to the end and confirmed: the layers are never stacked into a whole item, and the
    # producer lets go of them once the reader confirmed.
    tokens = torch.arange(1200, 1200 + TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    reader = await consumer.open_stream(tokens)
    assert reader is not None
    for layer in range(LAYERS):
        await stream.put_layer(*layer_kv(layer))
    own_copy = weakref.ref(producer._bytes[stream._item].store.keys[0])  # type: ignore[union-attr]
    await stream.finish()
    await reader.finished()
    await caught_up(consumer)
    await collected()
    assert stacks == [] and own_copy() is None
    assert (producer.stats().items, producer.stats().buffer_bytes) == (0, 0)
    # Read to the end by a reader that leaves before confirming: written whole then, for the next.
    tokens = torch.arange(1300, 1300 + TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    async with kvrt.Consumer(connect=producer.endpoint, transport=transport) as leaving:
        reader = await leaving.open_stream(tokens)
        assert reader is not None
        monkeypatch.setattr(leaving.link_for_tests().session, "settle", lambda item_id, *, keep: True)
        for layer in range(LAYERS):
            await stream.put_layer(*layer_kv(layer))
        hidden = torch.randn(TOKENS, 3)
        await stream.finish(hidden)
        assert await reader.finished() is not None
        assert stacks == []
    item = await consumer.drop_select(tokens, timeout=10)
    assert stacks == [LAYERS, LAYERS]  # the keys, then the values: once each, when it was sent whole
    assert item is not None and item.hidden is not None and torch.equal(item.hidden, hidden)
    assert all(torch.equal(item.key[layer], layer_kv(layer)[0]) for layer in range(LAYERS))
    assert all(torch.equal(item.value[layer], layer_kv(layer)[1]) for layer in range(LAYERS))


async def test_a_stream_whose_layers_are_still_being_written_into_the_pools_ends_only_after_them() -> None:
    """A reader of the pools gets a layer once its write is queued (GPU: by a kvrt thread), which
    can be after the stream's end arrived: the end waits for those layers, not failing them."""
    stream = kvrt.ConsumerStream(torch.arange(TOKENS), None, TOKENS, 2, confirm=lambda: None)
    stream.deliver_layer(0, *layer_kv(0))
    stream.writing(1)  # layer 1 landed; its write is under way
    stream.finish(None)
    ended = asyncio.ensure_future(stream.finished())
    await asyncio.sleep(0)
    assert not ended.done()
    stream.deliver_layer(1, *layer_kv(1))
    assert await ended is None
    assert torch.equal((await stream.layer(1))[0], layer_kv(1)[0])


async def test_the_link_calls_its_transport_off_whenever_it_fails_its_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # cuda_ipc's receive streams wait on the GPU for the producer's marks; `abandon` releases them.
    from kvrt.transports.paired import PairedReceiver

    abandoned: list[str] = []
    monkeypatch.setattr(PairedReceiver, "abandon", lambda transport: abandoned.append(transport.name), raising=False)
    async with kvrt.Producer(transport="gloo") as producer:
        consumer = await kvrt.Consumer(connect=producer.endpoint, transport="gloo").start()
        await caught_up(consumer)
        assert abandoned == []
        await consumer.aclose()
    assert abandoned == ["gloo"]


async def test_over_a_pair_many_concurrent_streams_each_end_after_their_last_layer() -> None:
    # An end whose last layer's transfer completed in the same turn must still follow that
    # layer's own hand-over: if it ran first, the reader failed "ended without layer N" while the
    # producer counted the item delivered, so the item was lost to everyone.
    import random

    streams, layers = 200, 4
    pace = random.Random(7)
    delays = [[pace.random() * 0.02 for _ in range(layers)] for _ in range(streams)]
    async with (
        kvrt.Producer(transport="gloo") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="gloo") as consumer,
    ):

        async def one(index: int) -> None:
            tokens = torch.arange(TOKENS) + 1000 * (index + 1)
            stream = await producer.open_stream(tokens, layers=layers)
            reader = await consumer.open_stream(tokens, timeout=10)
            assert reader is not None
            for layer in range(layers):
                await asyncio.sleep(delays[index][layer])
                await stream.put_layer(*layer_kv(layer))
            await stream.finish()
            keys = [(await reader.layer(layer))[0] for layer in range(layers)]
            assert all(torch.equal(key, layer_kv(layer)[0]) for layer, key in enumerate(keys))
            assert await reader.finished() is None

        outcomes = await asyncio.gather(*(one(index) for index in range(streams)), return_exceptions=True)
        failed = [repr(outcome) for outcome in outcomes if outcome is not None]
        assert failed == []
        await caught_up(consumer)
        assert producer.stats().items == 0


async def test_a_finish_cancelled_while_the_host_stacks_the_layers_aborts_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the host a finished stream nobody reads is stacked into a whole item off the loop; a
    finish cancelled meanwhile ends the stream as an abort does, and leaves nothing held."""
    import threading
    import time

    from kvrt._producer._parts import ItemKeeper

    prepare, stacking = ItemKeeper.prepare, threading.Event()

    def slowly(self: ItemKeeper, record: Any, item: Any) -> None:
        stacking.set()
        time.sleep(0.3)
        prepare(self, record, item)

    monkeypatch.setattr(ItemKeeper, "prepare", slowly)
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        tokens = torch.arange(900, 900 + TOKENS)
        stream = await producer.open_stream(tokens, layers=LAYERS)
        for layer in range(LAYERS):
            await stream.put_layer(*layer_kv(layer))
        finishing = asyncio.create_task(stream.finish())
        await asyncio.to_thread(stacking.wait, 5)
        finishing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await finishing
        assert await consumer.drop_select(tokens) is None
        assert await consumer.open_stream(tokens, timeout=0) is None
        assert (producer.stats().items, producer.stats().in_flight) == (0, 0)


async def test_a_failure_of_kvrts_own_while_sending_a_layer_reaches_put_layer_typed_and_fails_the_reader(
    producer: kvrt.Producer, consumer: kvrt.Consumer, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever breaks inside kvrt as a layer goes out (a bug, an error no boundary translated)
    # reaches the prefill as one of kvrt's errors, never as the bare exception, and the stream is
    # aborted: its reader fails at once rather than wait for a layer that never comes.
    tokens = torch.arange(400, 400 + TOKENS)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    await stream.put_layer(*layer_kv(0))
    reader = await consumer.open_stream(tokens)
    assert reader is not None
    await reader.layer(0)
    sender = type(producer._transports[transport])

    async def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("a bug in the send path")

    monkeypatch.setattr(sender, "send", broken)
    with pytest.raises(kvrt.KVRTError, match="layer 1") as raised:
        await stream.put_layer(*layer_kv(1))
    assert not isinstance(raised.value, RuntimeError)
    with pytest.raises(kvrt.StreamAbortedError):
        await asyncio.wait_for(reader.layer(1), 10)


async def test_an_end_that_never_reaches_its_stream_fails_the_reader_after_the_transfer_timeout_and_it_goes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The stream's end comes with its item id damaged into another valid one (no checksums
    # here to tell): it reaches no stream. Its reader, every layer in hand, waits for the end
    # as long as a transfer may take, then fails, and the item goes back whole.
    tokens = torch.arange(500, 500 + TOKENS)
    damaged = damage_the_first(
        monkeypatch,
        lambda message: msgspec.structs.replace(message, item_id=message.item_id + 1000)
        if isinstance(message, m.StreamEnd) else None,
    )  # fmt: skip
    async with (
        kvrt.Producer() as producer,
        kvrt.Consumer(connect=producer.endpoint, transfer_timeout_s=1.0) as consumer,
    ):
        stream = await producer.open_stream(tokens, layers=LAYERS)
        reader = await consumer.open_stream(tokens)
        assert reader is not None
        for layer in range(LAYERS):
            await stream.put_layer(*layer_kv(layer))
        await stream.finish()
        for layer in range(LAYERS):
            await reader.layer(layer)
        with pytest.raises(kvrt.KVRTTimeoutError, match="end"):
            await asyncio.wait_for(reader.finished(), 10)
        assert damaged
        keys = torch.stack([layer_kv(layer)[0] for layer in range(LAYERS)])
        values = torch.stack([layer_kv(layer)[1] for layer in range(LAYERS)])
        await reads_whole_again(consumer, tokens, keys, values)


@pytest.mark.timeout(240)
async def test_a_prefill_publishing_faster_than_its_reader_reads_waits_for_it_instead_of_dropping_it() -> None:
    # Thousands of small layers published in a tight loop (the reader on the same event loop
    # here, so it reads only while the prefill waits): twice what a peer's outbox holds. The
    # prefill waits for the reader to read instead of the producer dropping the reader as one
    # that stopped reading; every layer arrives, once.
    layers, tokens = 2 * MAX_QUEUED_MESSAGES, torch.arange(600, 602)
    key = torch.arange(layers * 2, dtype=torch.float32).view(layers, 2, 1, 1)
    async with (
        kvrt.Producer() as producer,
        kvrt.Consumer(connect=producer.endpoint) as consumer,
    ):
        stream = await producer.open_stream(tokens, layers=layers)
        reader = await consumer.open_stream(tokens)
        assert reader is not None

        async def publish() -> None:
            for layer in range(layers):
                await stream.put_layer(key[layer], key[layer])
            await stream.finish()

        publishing = asyncio.ensure_future(publish())
        keys, _ = await asyncio.wait_for(read_whole(reader), 180)
        await publishing
        assert torch.equal(keys, key)
        assert producer.stats().peers == 1 and producer.stats().totals.delivered_items == 1
