"""Streams of paged KV on CPU: a prefill streams its layers out of its pools as it writes
them, and a reader writes each into its own pools as it lands (TCP, and a gloo pair)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import kvrt
from kvrt import Layout, PoolTable
from kvrt.kernels.paged_kv import gather_layer_reference
from tests._checks import caught_up, same_bits
from tests.test_pull import CPU_LAYOUTS, HEADS, LAYERS, SLOTS, random_pools, row

TOKENS = 12
FROM_REPLICA = torch.arange(TOKENS) % 4
FROM_SLOTS = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(3))[:TOKENS]
INTO_SLOTS = torch.arange(16, 16 + TOKENS)


@pytest.fixture(params=["tcp", "gloo"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def producer(transport: str) -> AsyncIterator[kvrt.Producer]:
    async with kvrt.Producer(transport=transport) as started:
        yield started


@pytest.fixture
async def consumer(producer: kvrt.Producer, transport: str) -> AsyncIterator[kvrt.Consumer]:
    async with kvrt.Consumer(connect=producer.endpoint, transport=transport) as started:
        yield started


def compute_layer(pools: PoolTable, layer: int, *, seed: int) -> None:
    """What a prefill does: write fresh KV into one layer of every pool (after the stream
    opened, so a stream that read the pools too early would carry the old bytes)."""
    generator = torch.Generator().manual_seed(seed)
    for copies in pools.pools:
        for layers in copies:
            pool = layers[layer]
            pool.copy_(torch.randn(pool.shape, generator=generator).to(pool.dtype))


def layer_landed(source: PoolTable, target: PoolTable, layer: int) -> bool:
    """Layer `layer` of the request is at INTO_SLOTS of the target's replica 2 (every copy),
    as it was at FROM_SLOTS of the source's replicas."""
    return all(
        same_bits(
            row(target, 2, copy, layer, int(INTO_SLOTS[token]), kv),
            row(source, int(FROM_REPLICA[token]), 0, layer, int(FROM_SLOTS[token]), kv),
        )
        for token in range(TOKENS)
        for kv in range(source.geometry.kv)
        for copy in range(target.copies)
    )


@pytest.mark.parametrize("layout", CPU_LAYOUTS, ids=lambda layout: layout.value)
async def test_a_prefill_in_four_replicas_streams_into_replica_two_layer_by_layer_bit_for_bit(
    producer: kvrt.Producer, consumer: kvrt.Consumer, layout: Layout
) -> None:
    source = random_pools(4, layout, seed=1)
    target = random_pools(3, layout, copies=2 if layout is Layout.MLA else 1, seed=2)
    untouched = [pool.clone() for pool in target.pools[0][0]]
    producer.register_pools(source)
    tokens = torch.arange(500, 500 + TOKENS)
    stream = await producer.open_stream(tokens, slots=FROM_SLOTS, replica=FROM_REPLICA)
    assert stream.layers == LAYERS
    reader = await consumer.open_stream(tokens, into=target, slots=INTO_SLOTS, replica=2)
    assert reader is not None and reader.layers == LAYERS
    compute_layer(source, 0, seed=10)
    await stream.put_layer()
    await reader.layer(0)
    assert layer_landed(source, target, 0)
    assert not layer_landed(source, target, 1)  # not computed yet: nothing of it was written
    for layer in range(1, LAYERS):
        compute_layer(source, layer, seed=10 + layer)
        await stream.put_layer()
    await stream.finish()
    assert await reader.finished() is None
    assert all(layer_landed(source, target, layer) for layer in range(LAYERS))
    assert all(torch.equal(a, b) for a, b in zip(untouched, target.pools[0][0], strict=True))
    await caught_up(consumer)
    assert (producer.stats().items, producer.stats().buffer_bytes) == (0, 0)


async def test_a_stream_of_the_pools_reaches_a_plain_reader_as_tensors(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    source = random_pools(4, Layout.BLOCK, seed=4)
    producer.register_pools(source)
    tokens = torch.arange(600, 600 + TOKENS)
    stream = await producer.open_stream(tokens, slots=FROM_SLOTS, replica=FROM_REPLICA)
    reader = await consumer.open_stream(tokens)
    assert reader is not None
    for _ in range(LAYERS):
        await stream.put_layer()
    await stream.finish()
    for layer in range(LAYERS):
        key, value = await reader.layer(layer)
        assert key.shape == value.shape == (TOKENS, HEADS, source.geometry.head_dim)
        for token in range(TOKENS):
            replica, slot = int(FROM_REPLICA[token]), int(FROM_SLOTS[token])
            assert same_bits(key[token], row(source, replica, 0, layer, slot, 0))
            assert same_bits(value[token], row(source, replica, 0, layer, slot, 1))


async def test_a_plain_stream_lands_in_a_readers_pools(producer: kvrt.Producer, consumer: kvrt.Consumer) -> None:
    target = random_pools(1, Layout.TOKEN_MAJOR, seed=5)
    tokens = torch.arange(700, 700 + TOKENS)
    layers = [
        (torch.randn(TOKENS, HEADS, 8).to(torch.bfloat16), torch.randn(TOKENS, HEADS, 8).to(torch.bfloat16))
        for _ in range(LAYERS)
    ]
    stream = await producer.open_stream(tokens, layers=LAYERS)
    reader = await consumer.open_stream(tokens, into=target, slots=INTO_SLOTS)
    assert reader is not None
    async for layer, _, _ in _write_and_read(stream, reader, layers):
        key, value = layers[layer]
        for token in range(TOKENS):
            assert same_bits(row(target, 0, 0, layer, int(INTO_SLOTS[token]), 0), key[token])
            assert same_bits(row(target, 0, 0, layer, int(INTO_SLOTS[token]), 1), value[token])


async def _write_and_read(
    stream: kvrt.ProducerStream, reader: kvrt.ConsumerStream, layers: list[tuple[torch.Tensor, torch.Tensor]]
) -> AsyncIterator[tuple[int, torch.Tensor, torch.Tensor]]:
    async def prefill() -> None:
        for key, value in layers:
            await stream.put_layer(key, value)
        await stream.finish()

    writer = asyncio.create_task(prefill())
    async for arrived in reader:
        yield arrived
    await writer


async def test_a_stream_of_the_pools_nobody_read_is_pulled_whole_and_a_published_item_streamed(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    source = random_pools(4, Layout.TOKEN_MAJOR, seed=6)
    producer.register_pools(source)
    streamed, published = torch.arange(800, 800 + TOKENS), torch.arange(900, 900 + TOKENS)
    stream = await producer.open_stream(streamed, slots=FROM_SLOTS, replica=FROM_REPLICA)
    for _ in range(LAYERS):
        await stream.put_layer()
    await stream.finish()
    target = random_pools(3, Layout.TOKEN_MAJOR, seed=7)
    assert await consumer.pull(streamed, into=target, slots=INTO_SLOTS, replica=2) is not None
    assert all(layer_landed(source, target, layer) for layer in range(LAYERS))

    await producer.publish(published, FROM_SLOTS, FROM_REPLICA)
    target = random_pools(3, Layout.TOKEN_MAJOR, seed=8)
    reader = await consumer.open_stream(published, into=target, slots=INTO_SLOTS, replica=2)
    assert reader is not None
    assert await reader.finished() is None
    assert all(layer_landed(source, target, layer) for layer in range(LAYERS))


async def test_an_aborted_prefill_fails_a_reader_of_the_pools(producer: kvrt.Producer, consumer: kvrt.Consumer) -> None:
    source = random_pools(1, Layout.TOKEN_MAJOR, seed=9)
    producer.register_pools(source)
    tokens = torch.arange(1000, 1000 + TOKENS)
    stream = await producer.open_stream(tokens, slots=FROM_SLOTS)
    await stream.put_layer()
    reader = await consumer.open_stream(tokens, into=random_pools(1, Layout.TOKEN_MAJOR), slots=INTO_SLOTS)
    assert reader is not None
    await reader.layer(0)
    await stream.abort("the prefill GPU fell over")
    with pytest.raises(kvrt.StreamAbortedError, match="fell over"):
        await reader.finished()
    await caught_up(consumer)
    assert (producer.stats().items, producer.stats().buffer_bytes) == (0, 0)


async def test_bad_streams_of_the_pools_are_refused_before_anything_is_sent(producer: kvrt.Producer) -> None:
    tokens = torch.arange(4)
    with pytest.raises(kvrt.InvalidInputError, match="register_pools"):
        await producer.open_stream(tokens, slots=torch.arange(4))
    producer.register_pools(random_pools(2, Layout.TOKEN_MAJOR))
    with pytest.raises(kvrt.InvalidInputError, match="3 slots for 4 tokens"):
        await producer.open_stream(tokens, slots=torch.arange(3))
    with pytest.raises(kvrt.InvalidInputError, match="slot index 32 is out of range"):
        await producer.open_stream(tokens, slots=torch.tensor([0, 1, 2, SLOTS]))
    with pytest.raises(kvrt.InvalidInputError, match="replica index 2 is out of range"):
        await producer.open_stream(tokens, slots=torch.arange(4), replica=2)
    with pytest.raises(kvrt.InvalidInputError, match=f"has its {LAYERS} layers, not 2"):
        await producer.open_stream(tokens, slots=torch.arange(4), layers=2)
    assert producer.stats().items == 0
    stream = await producer.open_stream(tokens, slots=torch.arange(4))
    with pytest.raises(kvrt.InvalidInputError, match="takes no tensors"):
        await stream.put_layer(torch.zeros(4, HEADS, 8), torch.zeros(4, HEADS, 8))
    plain = await producer.open_stream(torch.arange(10, 14), layers=1)
    with pytest.raises(kvrt.InvalidInputError, match="key must be"):
        await plain.put_layer()


async def test_a_reader_whose_pools_do_not_fit_the_stream_fails_clearly_and_the_stream_goes_back(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    producer.register_pools(random_pools(1, Layout.TOKEN_MAJOR))
    tokens = torch.arange(1100, 1100 + TOKENS)
    stream = await producer.open_stream(tokens, slots=INTO_SLOTS)
    for _ in range(LAYERS):
        await stream.put_layer()
    await stream.finish()
    target = random_pools(1, Layout.TOKEN_MAJOR)
    with pytest.raises(kvrt.InvalidInputError, match="slot index 32 is out of range"):
        await consumer.open_stream(tokens, into=target, slots=torch.full((TOKENS,), SLOTS))
    with pytest.raises(kvrt.InvalidInputError, match="needs both into= and slots="):
        await consumer.open_stream(tokens, into=target)
    fewer_layers = PoolTable([[target.pools[0][0][:2]]], Layout.TOKEN_MAJOR)
    with pytest.raises(kvrt.InvalidInputError, match=f"the stream has {LAYERS} layers, the pools 2"):
        await consumer.open_stream(tokens, into=fewer_layers, slots=INTO_SLOTS)
    one_head = [torch.zeros(SLOTS, 2, 8).to(torch.bfloat16) for _ in range(LAYERS)]
    other_heads = PoolTable([[one_head]], Layout.TOKEN_MAJOR)
    # A finished item comes whole: it is found not to fit before the call returns.
    with pytest.raises(kvrt.InvalidInputError, match=r"key must be a torch.bfloat16 tensor \[3, >= 12, 1, 8\]"):
        await consumer.open_stream(tokens, into=other_heads, slots=INTO_SLOTS)
    item = await consumer.drop_select(tokens)  # nothing lost: the item went back each time
    assert item is not None and item.key.shape == (LAYERS, TOKENS, HEADS, 8)
    # A prefill still running streams: its first layer is found not to fit.
    running = await producer.open_stream(tokens, slots=INTO_SLOTS)
    reader = await consumer.open_stream(tokens, into=other_heads, slots=INTO_SLOTS)
    assert reader is not None
    await running.put_layer()
    with pytest.raises(kvrt.InvalidInputError, match=r"key must be a contiguous torch.bfloat16 tensor \[>= 12, 1, 8\]"):
        await reader.finished()


@pytest.mark.parametrize("layout", CPU_LAYOUTS, ids=lambda layout: layout.value)
async def test_a_reader_that_holds_a_prefix_has_only_the_rest_written_into_its_pools(
    producer: kvrt.Producer, consumer: kvrt.Consumer, layout: Layout
) -> None:
    # A decode instance whose own prefix cache holds the first tokens loads only the others:
    # the pages of the prefix (other requests may be reading them) are not written.
    held = 5
    source = random_pools(4, layout, seed=11)
    target = random_pools(3, layout, seed=12)
    before = [[pool.clone() for pool in layers] for layers in target.pools[2]]
    producer.register_pools(source)
    tokens = torch.arange(1200, 1200 + TOKENS)
    await producer.publish(tokens, FROM_SLOTS, FROM_REPLICA)
    reader = await consumer.open_stream(tokens, into=target, slots=INTO_SLOTS[held:], replica=2, skip=held)
    assert reader is not None and reader.matched == TOKENS
    await reader.finished()
    rest = range(held, TOKENS)
    for layer in range(LAYERS):
        for kv in range(source.geometry.kv):
            for token in rest:
                written = row(target, 2, 0, layer, int(INTO_SLOTS[token]), kv)
                assert same_bits(written, row(source, int(FROM_REPLICA[token]), 0, layer, int(FROM_SLOTS[token]), kv))
    # The prefix's slots keep their bytes.
    for layer in range(LAYERS):
        for slot in [int(slot) for slot in INTO_SLOTS[:held]]:
            for kv in range(source.geometry.kv):
                assert same_bits(row(target, 2, 0, layer, slot, kv), row(_table(before, layout), 0, 0, layer, slot, kv))


def _table(layers: list[list[torch.Tensor]], layout: Layout) -> PoolTable:
    return PoolTable([layers], layout)


@pytest.mark.parametrize("layout", [Layout.TOKEN_MAJOR, Layout.BLOCK, Layout.BLOCK_HEAD_MAJOR])
async def test_a_piece_of_the_heads_lands_at_their_place_among_the_pools_heads(
    producer: kvrt.Producer, consumer: kvrt.Consumer, layout: Layout
) -> None:
    # Decode pools holding the model's heads [1, 2) of a producer's two: a TP rank's share.
    source = random_pools(1, layout, seed=13)
    producer.register_pools(source)
    tokens = torch.arange(1300, 1300 + TOKENS)
    await producer.publish(tokens, FROM_SLOTS)
    shape = {
        Layout.TOKEN_MAJOR: (SLOTS, 2, 8),
        Layout.BLOCK: (2, SLOTS // 4, 4, 1, 8),
        Layout.BLOCK_HEAD_MAJOR: (SLOTS // 4, 1, 2, 4, 8),
    }[layout]
    target = PoolTable([[[torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]]], layout, heads=slice(1, 2))
    reader = await consumer.open_stream(tokens, into=target, slots=INTO_SLOTS, heads=slice(1, 2))
    assert reader is not None
    await reader.finished()
    for layer in range(LAYERS):
        landed = gather_layer_reference(target, torch.zeros(TOKENS, dtype=torch.int64), INTO_SLOTS, layer)
        for kv in range(2):
            for token in range(TOKENS):
                expected = row(source, 0, 0, layer, int(FROM_SLOTS[token]), kv)[1:2]
                assert same_bits(landed[kv][token], expected)
    with pytest.raises(kvrt.InvalidInputError, match=r"heads \[0, 2\) do not lie in the pools' heads \[1, 2\)"):
        await consumer.open_stream(tokens, into=target, slots=INTO_SLOTS, heads=slice(0, 2))


def test_pools_that_say_which_heads_they_hold_must_name_as_many_as_they_have() -> None:
    pools = [[[torch.zeros(SLOTS, 2, 8)]]]
    assert PoolTable(pools, Layout.TOKEN_MAJOR, heads=slice(3, 4)).first_head == 3
    with pytest.raises(kvrt.InvalidInputError, match=r"slice\(h0, h0 \+ 1\)"):
        PoolTable(pools, Layout.TOKEN_MAJOR, heads=slice(3, 5))


async def test_a_slow_gather_of_a_layer_on_the_host_holds_no_other_call_of_the_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer of the pools on the host is gathered on kvrt's gather thread: a probe (the decode
    scheduler's lookup), or any other peer's call, is answered meanwhile. On a starved host, with
    the engine's own threads holding the interpreter, one gather took a tenth of a second and a
    step's gathers seconds: on the loop, every lookup waited behind them."""
    import threading
    import time

    from kvrt.kernels import paged_kv

    gather, gathering = paged_kv.gather_layer_into_any, threading.Event()

    def slowly_the_first(*args: Any, **kwargs: Any) -> None:
        if not gathering.is_set():
            gathering.set()
            time.sleep(1.0)
        gather(*args, **kwargs)

    monkeypatch.setattr(paged_kv, "gather_layer_into_any", slowly_the_first)
    source = random_pools(4, Layout.TOKEN_MAJOR, seed=1)
    async with kvrt.Producer() as producer, kvrt.Client(producer.endpoint) as client:
        producer.register_pools(source)
        tokens = torch.arange(700, 700 + TOKENS)
        stream = await producer.open_stream(tokens, slots=FROM_SLOTS, replica=FROM_REPLICA)
        publishing = asyncio.create_task(stream.put_layer())
        await asyncio.to_thread(gathering.wait, 5)
        started = time.monotonic()
        await client.probe(tokens)
        assert time.monotonic() - started < 0.5 and not publishing.done()
        await publishing
        for _ in range(1, LAYERS):
            await stream.put_layer()
        await stream.finish()
        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            item = await consumer.drop_select(tokens)
        assert item is not None
        for layer in range(LAYERS):  # each layer as the pools held it
            key, value = gather_layer_reference(source, FROM_REPLICA, FROM_SLOTS, layer)
            assert same_bits(item.key[layer], key) and same_bits(item.value[layer], value)


async def test_layers_the_pools_hold_already_are_published_together_in_one_hand_off_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill that publishes once its forward pass ended (`put_layers`): every layer is
    gathered in one job of kvrt's gather thread, not one a layer, and the reader gets each
    layer as the pools held it, as `put_layer()` would have sent it."""
    import concurrent.futures

    submits: list[str] = []
    submit = concurrent.futures.ThreadPoolExecutor.submit

    def counted(self: concurrent.futures.ThreadPoolExecutor, *args: Any, **kwargs: Any) -> Any:
        submits.append(self._thread_name_prefix)
        return submit(self, *args, **kwargs)

    source = random_pools(4, Layout.TOKEN_MAJOR, seed=5)
    async with kvrt.Producer() as producer:
        producer.register_pools(source)
        tokens = torch.arange(710, 710 + TOKENS)
        stream = await producer.open_stream(tokens, slots=FROM_SLOTS, replica=FROM_REPLICA)
        await stream.put_layer()  # the gather thread started, as on the first step of a prefill
        monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", counted)
        await stream.put_layers()
        monkeypatch.undo()
        assert stream.published == LAYERS
        assert [prefix for prefix in submits if prefix.startswith("kvrt-gather")] == ["kvrt-gather"]
        await stream.finish()
        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            item = await consumer.drop_select(tokens)
        assert item is not None
        for layer in range(LAYERS):
            key, value = gather_layer_reference(source, FROM_REPLICA, FROM_SLOTS, layer)
            assert same_bits(item.key[layer], key) and same_bits(item.value[layer], value)


async def test_put_layers_publishes_as_many_layers_as_it_is_told_and_refuses_what_it_cannot_publish() -> None:
    source = random_pools(4, Layout.TOKEN_MAJOR, seed=6)
    async with kvrt.Producer() as producer:
        producer.register_pools(source)
        plain = await producer.open_stream(torch.arange(720, 720 + TOKENS), layers=LAYERS)
        with pytest.raises(kvrt.InvalidInputError, match="plain stream"):
            await plain.put_layers()
        await plain.abort()
        stream = await producer.open_stream(torch.arange(730, 730 + TOKENS), slots=FROM_SLOTS, replica=FROM_REPLICA)
        for count in (0, LAYERS + 1, 1.0, True):
            with pytest.raises(kvrt.InvalidInputError, match="count"):
                await stream.put_layers(count)  # type: ignore[arg-type]
        assert stream.published == 0
        await stream.put_layers(1)
        await stream.put_layers(LAYERS - 2)
        assert stream.published == LAYERS - 1
        await stream.put_layers()
        with pytest.raises(kvrt.InvalidInputError, match="published already"):
            await stream.put_layers()
        await stream.finish()
        with pytest.raises(kvrt.InvalidInputError, match="ended"):
            await stream.put_layers()
