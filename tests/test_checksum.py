"""KV integrity end to end: with `Producer(checksum=True)` an item's bytes carry a checksum
computed where they were written and checked where they land; a corrupted delivery never
reaches the caller, the item goes back whole, and the failure is counted."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator

import msgspec
import pytest
import torch

import kvrt
from kvrt import Layout, PoolTable
from kvrt import _messages as m
from kvrt._checksum import CHECKSUM_ENV, checksum_wanted, item_checksum, metas_seed, payload_checksum
from kvrt._item_bytes import ItemBytes
from kvrt._protocol.lookup_buffer import BufferedItem
from kvrt.transports.paired import PairedReceiver
from tests._checks import damage_the_first, flip_one_landed_byte, read_as_published, read_whole

ITEM_BYTES = 4 << 20
FLIP_AT = 3 << 20
"""Where in the producer's byte stream the relay flips a byte: inside the 4 MiB item's payload."""


class FlippingRelay:
    """A TCP relay between consumers and a producer that flips one byte of the producer's
    stream, `flip_at` bytes into the first connection, once (`flips` counts it)."""

    def __init__(self, upstream_port: int, flip_at: int) -> None:
        self._upstream_port = upstream_port
        self._flip_at = flip_at
        self.flips = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> FlippingRelay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        flip = self.flips == 0 and not self._tasks
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer, flip=False)),
            asyncio.create_task(self._pipe(up_reader, writer, flip=flip)),
        ):
            self._tasks.add(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, flip: bool) -> None:
        passed = 0
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(1 << 16):
                if flip and passed <= self._flip_at < passed + len(chunk):
                    flipped = bytearray(chunk)
                    flipped[self._flip_at - passed] ^= 0x10
                    chunk = bytes(flipped)
                    self.flips += 1
                passed += len(chunk)
                writer.write(chunk)
                await writer.drain()
        writer.close()


def _item(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.arange(64) + 1000 * seed
    key = torch.randn(4, 64, 4, ITEM_BYTES // 2 // 4 // 64 // 4 // 4, generator=generator)
    value = torch.randn(key.shape, generator=generator)
    return tokens, key, value


@contextlib.asynccontextmanager
async def _through_relay(
    checksum: bool, flip_at: int = FLIP_AT
) -> AsyncIterator[tuple[kvrt.Producer, FlippingRelay, kvrt.Consumer]]:
    async with kvrt.Producer(checksum=checksum) as producer:
        port = int(producer.endpoint.rsplit(":", 1)[1])
        async with FlippingRelay(port, flip_at) as relay:
            async with kvrt.Consumer(connect=f"tcp://127.0.0.1:{relay.port}") as consumer:
                yield producer, relay, consumer


async def test_a_byte_flipped_in_transit_fails_the_call_the_item_goes_back_whole_and_is_counted() -> None:
    tokens, key, value = _item()
    async with _through_relay(checksum=True) as (producer, relay, consumer):
        await producer.insert(tokens, None, key, value)
        with pytest.raises(kvrt.IntegrityError, match="checksum"):
            await consumer.drop_select(tokens)
        assert relay.flips == 1
        assert consumer.metrics.integrity_failures == 1
        item = await consumer.drop_select(tokens)  # the producer's copy was never touched
        assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)
        assert await consumer.drop_select(tokens) is None  # taken once
        assert consumer.metrics.integrity_failures == 1
    stats = producer.stats()
    assert (stats.items, stats.in_flight, stats.totals.delivered_items) == (0, 0, 1)


async def test_an_item_a_gpu_checksummed_is_checked_on_a_host_consumer_with_the_kernels_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU producer's items carry `device_checksum` (`kvrt.kernels.checksum`) in place of
    XXH3; over TCP into host memory the consumer checks it with the kernel's torch reference.
    Here a CPU producer computes it as a GPU producer would, with that reference."""
    from kvrt._producer._parts import ItemKeeper
    from kvrt.kernels.checksum import checksum_reference

    prepare = ItemKeeper.prepare

    def as_a_gpu_producer_does(self: ItemKeeper, record: BufferedItem, item: ItemBytes) -> None:
        prepare(self, record, item)
        record.checksum, item.device_checksum = None, checksum_reference(item.storage, metas_seed(record.metas))

    monkeypatch.setattr(ItemKeeper, "prepare", as_a_gpu_producer_does)
    tokens, key, value = _item()
    async with _through_relay(checksum=True) as (producer, relay, consumer):
        await producer.insert(tokens, None, key, value)
        with pytest.raises(kvrt.IntegrityError, match="GPU"):
            await consumer.drop_select(tokens)
        assert relay.flips == 1 and consumer.metrics.integrity_failures == 1
        item = await consumer.drop_select(tokens)
        assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)


async def test_without_checksums_the_same_flip_reaches_the_caller() -> None:
    # What the check is for: the relay does corrupt what it carries.
    tokens, key, value = _item()
    async with _through_relay(checksum=False) as (producer, relay, consumer):
        await producer.insert(tokens, None, key, value)
        item = await consumer.drop_select(tokens)
        assert relay.flips == 1
        assert item is not None and not (torch.equal(item.key, key) and torch.equal(item.value, value))


async def test_a_flip_in_a_batch_fails_the_batch_and_every_item_of_it_goes_back_whole() -> None:
    first, second = _item(1), _item(2)
    async with _through_relay(checksum=True) as (producer, relay, consumer):
        for tokens, key, value in (first, second):
            await producer.insert(tokens, None, key, value)
        with pytest.raises(kvrt.IntegrityError):
            await consumer.drop_select_many([first[0], second[0]])
        assert relay.flips == 1 and consumer.metrics.integrity_failures == 1
        items = await consumer.drop_select_many([first[0], second[0]])
        for item, (_, key, value) in zip(items, (first, second), strict=True):
            assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)
        assert await consumer.drop_select_many([first[0], second[0]]) == [None, None]  # taken once


async def test_a_flip_in_a_piece_of_the_heads_fails_the_call_and_the_piece_can_be_taken_again() -> None:
    tokens, key, value = _item(3)  # 4 heads: the piece [0, 2) is half the item, 2 MiB
    async with _through_relay(checksum=True, flip_at=1 << 20) as (producer, relay, consumer):
        await producer.insert(tokens, None, key, value)
        with pytest.raises(kvrt.IntegrityError):
            await consumer.drop_select(tokens, heads=slice(0, 2))
        assert relay.flips == 1 and consumer.metrics.integrity_failures == 1
        piece = await consumer.drop_select(tokens, heads=slice(0, 2))
        assert piece is not None
        assert torch.equal(piece.key, key[:, :, 0:2]) and torch.equal(piece.value, value[:, :, 0:2])


async def test_a_flip_in_a_published_prefill_fails_the_pull_and_writes_nothing_then_the_retry_lands() -> None:
    slots, heads, dim, layers = 1024, 8, 128, 4  # token-major pools: 4 KiB a token and layer, 16 MiB
    generator = torch.Generator().manual_seed(4)
    source = PoolTable(
        [[[torch.randn((slots, 2 * heads, dim), generator=generator).to(torch.bfloat16) for _ in range(layers)]]],
        Layout.TOKEN_MAJOR,
    )
    target = PoolTable([[[torch.zeros((slots, 2 * heads, dim), dtype=torch.bfloat16) for _ in range(layers)]]],
                       Layout.TOKEN_MAJOR)  # fmt: skip
    tokens, from_slots = torch.arange(512), torch.randperm(slots, generator=generator)[:512]
    async with _through_relay(checksum=True) as (producer, relay, consumer):
        producer.register_pools(source)
        await producer.publish(tokens, from_slots)
        with pytest.raises(kvrt.IntegrityError):
            await consumer.pull(tokens, into=target, slots=torch.arange(512))
        assert relay.flips == 1 and consumer.metrics.integrity_failures == 1
        assert all(not pool.any() for pool in target.pools[0][0])  # nothing landed in the pools
        item = await consumer.pull(tokens, into=target, slots=torch.arange(512))
        assert item is not None
        for layer in range(layers):
            assert torch.equal(target.pools[0][0][layer][:512], source.pools[0][0][layer][from_slots])


async def test_a_flip_in_a_streamed_layer_fails_the_reader_and_the_stream_is_read_whole_again() -> None:
    """An open stream's layers carry the checksum `put_layer` computed; each is checked as it
    lands, before the reader sees it."""
    tokens, key, value = _item(5)  # 4 layers of 1 MiB: the flip at 3 MiB lies in layer 2
    hidden = torch.randn(64, 32)
    async with _through_relay(checksum=True) as (producer, relay, consumer):
        reader = await read_as_published(producer, consumer, tokens, key, value, hidden)
        with pytest.raises(kvrt.IntegrityError, match="layer 2"):
            async for _ in reader:
                pass
        assert relay.flips == 1 and consumer.metrics.integrity_failures == 1
        again = await consumer.open_stream(tokens)
        assert again is not None
        keys, values = await read_whole(again)
        assert torch.equal(keys, key) and torch.equal(values, value)
        assert torch.equal(await again.finished(), hidden)


def as_from_a_gpu_producer(
    monkeypatch: pytest.MonkeyPatch, key: torch.Tensor, value: torch.Tensor, hidden: torch.Tensor | None
) -> list[m.StreamEnd]:
    """Have this process read a stream of `key`, `value` and `hidden` as a producer on a GPU
    sends it: its layers leave before they are written and carry no checksum; its end carries
    each layer's and the hidden states' checksum as the GPU computed them where they were
    written (`kvrt.kernels.checksum`, computed here with the kernel's reference on the
    producer's bytes). The list returned gets each end as it went."""
    from kvrt._checksum import HIDDEN_POSITION, tensors_device_checksum, tensors_seed
    from kvrt.kernels.checksum import checksum_reference

    def as_the_gpu_wrote(tensors: tuple[torch.Tensor, ...], metas: tuple[m.TensorMeta, ...], position: int) -> int:
        seed = tensors_seed(metas, position)
        return tensors_device_checksum([checksum_reference(tensor.contiguous(), seed) for tensor in tensors], seed)

    decode, ends = m.decode, []
    metas: dict[int, tuple[m.TensorMeta, m.TensorMeta]] = {}

    def as_sent(frame: bytes | memoryview) -> m.AnyMessage:
        message = decode(frame)
        if isinstance(message, m.StreamLayer):
            metas[message.layer] = (message.key, message.value)
            return msgspec.structs.replace(message, checksum=None)
        if isinstance(message, m.StreamEnd):
            layers = [as_the_gpu_wrote((key[layer], value[layer]), metas[layer], layer) for layer in sorted(metas)]
            hidden_sum = None
            if hidden is not None and message.hidden is not None:
                hidden_sum = as_the_gpu_wrote((hidden,), (message.hidden,), HIDDEN_POSITION)
            message = msgspec.structs.replace(
                message, checksum=None, layer_checksums=layers, device_checksum=hidden_sum
            )
            ends.append(message)
            metas.clear()  # the next stream's layers
        return message

    monkeypatch.setattr(m, "decode", as_sent)
    return ends


async def test_a_flip_in_a_gpu_producers_streamed_layer_fails_the_stream_at_its_end_and_it_is_read_whole_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer on a GPU sends each layer before the prefill wrote it: its end carries the
    layers' checksums, and the consumer checks what landed against them before the stream
    ends. A damaged layer fails the stream at its end (the connector then recomputes), and
    its item goes back whole."""
    tokens, key, value = _item(5)  # 4 layers of 1 MiB: the flip at 3 MiB lies in layer 2
    hidden = torch.randn(64, 32)
    ends = as_from_a_gpu_producer(monkeypatch, key, value, hidden)
    async with _through_relay(checksum=True) as (producer, relay, consumer):
        reader = await read_as_published(producer, consumer, tokens, key, value, hidden)
        with pytest.raises(kvrt.IntegrityError, match="layer 2"):
            await reader.finished()
        assert relay.flips == 1 and consumer.metrics.integrity_failures == 1
        assert ends and ends[0].layer_checksums is not None and len(ends[0].layer_checksums) == 4
        again = await consumer.open_stream(tokens)
        assert again is not None
        keys, values = await read_whole(again)
        assert torch.equal(keys, key) and torch.equal(values, value)
        assert torch.equal(await again.finished(), hidden)
        assert await consumer.drop_select(tokens) is None  # read once
        assert consumer.metrics.integrity_failures == 1


@pytest.mark.parametrize("hidden", [False, True], ids=["kv", "kv+hidden"])
async def test_a_gpu_producers_stream_whose_end_matches_what_landed_ends_with_identical_bytes(
    monkeypatch: pytest.MonkeyPatch, hidden: bool
) -> None:
    tokens, key, value = _item(6)
    states = torch.randn(64, 32) if hidden else None
    ends = as_from_a_gpu_producer(monkeypatch, key, value, states)
    async with kvrt.Producer(checksum=True) as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        reader = await read_as_published(producer, consumer, tokens, key, value, states)
        keys, values = await read_whole(reader)
        assert torch.equal(keys, key) and torch.equal(values, value)
        assert (await reader.finished() is None) if states is None else torch.equal(await reader.finished(), states)
        assert consumer.metrics.integrity_failures == 0
        assert ends[0].device_checksum is not None if hidden else ends[0].device_checksum is None
        assert await consumer.drop_select(tokens) is None


async def test_one_producers_slow_stream_checks_never_hold_back_another_producers_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The layers of a GPU producer's streams are checked on workers of that producer's link:
    a producer whose layers take long to check (here half a second each, six of them) holds
    back no other producer's stream in the process, whose end is checked meanwhile; nothing
    is lost."""
    import threading
    import time

    from kvrt.kernels import checksum as kernel

    key, value = torch.randn(6, 16, 2, 8), torch.randn(6, 16, 2, 8)
    as_from_a_gpu_producer(monkeypatch, key, value, None)
    reference, started = kernel.checksum_reference, threading.Event()

    def slow_reference(data: torch.Tensor, seed: int = 0) -> int:
        started.set()
        time.sleep(0.25)  # a key's or a value's: a layer's check takes 0.5 s
        return reference(data, seed)

    monkeypatch.setattr(kernel, "checksum_reference", slow_reference)
    async with (
        kvrt.Producer(checksum=True) as slow,
        kvrt.Producer(checksum=True) as quick,
        kvrt.Consumer(connect=slow.endpoint) as consumer,
        kvrt.Consumer(connect=quick.endpoint) as other,
    ):
        slow_reader = await read_as_published(slow, consumer, torch.arange(16), key, value)
        assert await asyncio.to_thread(started.wait, 10)  # its layers' checks are under way
        began = time.monotonic()
        quick_reader = await read_as_published(quick, other, torch.arange(16) + 100, key[:1], value[:1])
        await asyncio.wait_for(quick_reader.finished(), 10)
        took = time.monotonic() - began
        # Behind the slow stream's checks it would take 1.5 s at least (2 s of them left, on two workers).
        assert took < 1.2, f"the quick producer's one-layer stream took {took:.2f} s to check"
        keys, values = await read_whole(slow_reader)
        assert torch.equal(keys, key) and torch.equal(values, value)
        assert consumer.metrics.integrity_failures == other.metrics.integrity_failures == 0


@pytest.mark.parametrize("without", ["layer_checksums", "device_checksum"])
async def test_a_gpu_producers_stream_end_without_the_checksums_of_what_came_unchecked_fails_the_stream(
    monkeypatch: pytest.MonkeyPatch, without: str
) -> None:
    """From a producer that checksums, bytes that came with no checksum (a GPU stream's layers,
    whose end lacks theirs; hidden states with none) are not taken as good: a damaged field name
    drops a checksum from its message unread."""
    tokens, key, value = _item(8)
    hidden = torch.randn(64, 32)
    as_from_a_gpu_producer(monkeypatch, key, value, hidden)
    gpu_sent = m.decode

    def lacking(frame: bytes | memoryview) -> m.AnyMessage:
        message = gpu_sent(frame)
        if isinstance(message, m.StreamEnd):
            return msgspec.structs.replace(message, **{without: None})
        return message

    monkeypatch.setattr(m, "decode", lacking)
    async with kvrt.Producer(checksum=True) as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        reader = await read_as_published(producer, consumer, tokens, key, value, hidden)
        with pytest.raises(kvrt.IntegrityError, match="without a checksum"):
            await reader.finished()
        assert consumer.metrics.integrity_failures == 1


async def test_a_gpu_producers_stream_end_with_another_count_of_layer_checksums_fails_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens, key, value = _item(7)
    as_from_a_gpu_producer(monkeypatch, key, value, None)
    gpu_sent = m.decode

    def one_short(frame: bytes | memoryview) -> m.AnyMessage:
        message = gpu_sent(frame)
        if isinstance(message, m.StreamEnd) and message.layer_checksums:
            return msgspec.structs.replace(message, layer_checksums=message.layer_checksums[:-1])
        return message

    monkeypatch.setattr(m, "decode", one_short)
    async with kvrt.Producer(checksum=True) as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        reader = await read_as_published(producer, consumer, tokens, key, value)
        with pytest.raises(kvrt.RemoteProtocolError, match="3 layer checksums"):
            await reader.finished()


def test_a_gpu_producers_open_stream_sends_its_layers_with_no_checksum_as_its_end_carries_them() -> None:
    """A GPU stream's item holds only its tokens, on the host; its layers, on the GPU, have
    their checksums queued (`StreamStore.layer_sums`), none on the host: a layer's header goes
    out without one, and is built without looking for one."""
    from kvrt._item import item_from_tokens
    from kvrt._producer._serve import _with_checksums
    from kvrt._protocol.outgoing import Outgoing
    from kvrt._tensors import pack

    item = item_from_tokens(pack((torch.arange(8), None), torch.device("cpu")), item_id=3, seq=0, layers=2)
    assert item.bytes.store is not None
    item.bytes.store.layer_sums.append(concurrent.futures.Future())
    meta = m.TensorMeta(dtype="bfloat16", shape=[8, 2, 4])
    layer = m.StreamLayer(item_id=3, layer=0, key=meta, value=meta)
    bytes_of = {item.record: item.bytes}.__getitem__
    assert _with_checksums(layer, Outgoing(b"reader", layer, item.record), bytes_of) == layer


@pytest.mark.parametrize("hidden", [False, True], ids=["kv", "kv+hidden"])
async def test_with_checksums_a_clean_run_hands_over_identical_bytes(hidden: bool) -> None:
    async with kvrt.Producer(checksum=True) as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        for seed, tokens_count in enumerate((1, 7, 300)):
            tokens = torch.arange(tokens_count) + 10_000 * seed
            key = torch.randn(2, tokens_count, 2, 8, dtype=torch.float16)
            value = torch.randn(2, tokens_count, 2, 8, dtype=torch.float16)
            states = torch.randn(tokens_count, 16) if hidden else None
            await producer.insert(tokens, None, key, value, states)
            item = await consumer.drop_select(tokens)
            assert item is not None
            assert torch.equal(item.input_tokens, tokens) and torch.equal(item.key, key)
            assert torch.equal(item.value, value)
            assert (item.hidden is None) if states is None else torch.equal(item.hidden, states)
        assert consumer.metrics.integrity_failures == 0


@pytest.mark.parametrize("checksum", [True, False], ids=["checked", "unchecked"])
async def test_a_header_that_says_the_value_lies_where_the_key_does_fails_the_call_like_a_flipped_byte(
    monkeypatch: pytest.MonkeyPatch, checksum: bool
) -> None:
    def value_read_from_the_keys_bytes(message: m.AnyMessage) -> m.AnyMessage | None:
        if not isinstance(message, m.Deliver):
            return None
        moved = msgspec.structs.replace(message.value, offset=message.key.offset)
        return msgspec.structs.replace(message, value=moved)

    altered = damage_the_first(monkeypatch, value_read_from_the_keys_bytes)
    tokens = torch.arange(8)
    key, value = torch.ones(1, 8, 1, 4), torch.full((1, 8, 1, 4), 1.5)
    async with kvrt.Producer(checksum=checksum) as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        await producer.insert(tokens, None, key, value)
        if checksum:
            with pytest.raises(kvrt.IntegrityError):
                await consumer.drop_select(tokens)
            item = await consumer.drop_select(tokens)
            assert item is not None and torch.equal(item.value, value)
        else:
            item = await consumer.drop_select(tokens)
            assert item is not None and torch.equal(item.value, key)  # wrong, and nobody said so
        assert altered


def test_the_environment_turns_checksums_on_and_a_bad_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CHECKSUM_ENV, raising=False)
    assert checksum_wanted(None) is False and checksum_wanted(True) is True
    monkeypatch.setenv(CHECKSUM_ENV, "1")
    assert checksum_wanted(None) is True and checksum_wanted(False) is False
    monkeypatch.setenv(CHECKSUM_ENV, "yes")
    with pytest.raises(kvrt.InvalidInputError, match=CHECKSUM_ENV):
        checksum_wanted(None)
    with pytest.raises(kvrt.InvalidInputError, match="checksum"):
        kvrt.Producer(checksum="yes")  # type: ignore[arg-type]


def test_the_checksum_is_xxh3_64_of_the_payload() -> None:
    # A reference value of XXH3-64 (seed 0), so that any two builds agree on the wire.
    assert payload_checksum(b"") == 0x2D06800538D394C2
    assert payload_checksum(memoryview(b"abc")) == payload_checksum(b"abc") != payload_checksum(b"abd")
    metas = (m.TensorMeta("int64", [1]), None, m.TensorMeta("float16", [1, 1, 1, 4], 8), None, None)
    moved = (*metas[:2], m.TensorMeta("float16", [1, 1, 1, 4], 16), None, None)
    assert item_checksum(b"x" * 24, metas) != item_checksum(b"x" * 24, moved) != payload_checksum(b"x" * 24)


@pytest.mark.parametrize("checksum", [True, False])
def test_a_producer_that_checksums_says_so_in_its_welcome(checksum: bool) -> None:
    # A consumer on a GPU compiles its check as it joins such a producer, not inside a request.
    from kvrt._protocol import ProducerCore

    core = ProducerCore(producer_id="prefill-0", heartbeat_s=1.0, checksum=checksum)
    hello = m.encode(m.Hello(version=m.PROTOCOL_VERSION))
    (welcome,) = [out.message for out in core.receive(b"decode-0", hello, 0, 0.0)]
    assert isinstance(welcome, m.Welcome)
    assert (m.Capability.CHECKSUM in welcome.capabilities) is checksum
    assert m.Capability.PROBE_MANY in welcome.capabilities


def _nixl_receiver() -> type:
    from kvrt.transports.nixl import NixlReceiver

    return NixlReceiver


needs_nixl = pytest.mark.skipif(
    __import__("kvrt.transports._nixl_agent", fromlist=["nixl_unavailable"]).nixl_unavailable() is not None,
    reason="NIXL is not installed",
)


@pytest.mark.parametrize("size", ["small", "large"])  # nixl: READ from the loop, or waited for on the session's thread
@pytest.mark.parametrize("batch", [False, True], ids=["drop_select", "drop_select_many"])
@pytest.mark.parametrize("transport", ["gloo", pytest.param("nixl", marks=needs_nixl)])
async def test_a_byte_flipped_where_an_out_of_band_delivery_landed_fails_the_call_and_the_items_come_whole_next(
    monkeypatch: pytest.MonkeyPatch, transport: str, batch: bool, size: str
) -> None:
    if size == "large":
        items = [_item(6), _item(7)] if batch else [_item(6)]
    else:
        # Of two sizes: the byte flipped, in the middle of the batch's payload, lies in the first
        # item, not in the padding between the two.
        items = [(torch.arange(n) + 100 * n, torch.randn(2, n, 2, 8), torch.randn(2, n, 2, 8)) for n in (32, 16)]
        items = items if batch else items[:1]
    async with (
        kvrt.Producer(transport=transport, checksum=True) as producer,
        kvrt.Consumer(connect=producer.endpoint, transport=transport) as consumer,
    ):
        for tokens, key, value in items:
            await producer.insert(tokens, None, key, value)
        queries = [tokens for tokens, _, _ in items]

        async def take() -> list[kvrt.KVItem | None]:
            return await consumer.drop_select_many(queries) if batch else [await consumer.drop_select(queries[0])]

        flipped = flip_one_landed_byte(monkeypatch, PairedReceiver if transport == "gloo" else _nixl_receiver())
        with pytest.raises(kvrt.IntegrityError):
            await take()
        assert flipped and consumer.metrics.integrity_failures == 1
        for item, (_, key, value) in zip(await take(), items, strict=True):
            assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)
        assert await take() == [None] * len(items)  # taken once


async def test_a_layer_said_to_be_another_fails_its_reader_like_a_flipped_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream layer's checksum covers its index: layer 1 arriving as layer 3 never reaches
    the reader as layer 3."""

    def layer_one_as_three(message: m.AnyMessage) -> m.AnyMessage | None:
        if not (isinstance(message, m.StreamLayer) and message.layer == 1):
            return None
        return msgspec.structs.replace(message, layer=3)

    altered = damage_the_first(monkeypatch, layer_one_as_three)
    tokens, key, value = torch.arange(16), torch.randn(4, 16, 2, 8), torch.randn(4, 16, 2, 8)
    async with kvrt.Producer(checksum=True) as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        reader = await read_as_published(producer, consumer, tokens, key, value)
        with pytest.raises(kvrt.IntegrityError, match="layer 3"):
            await reader.layer(3)
        assert altered and consumer.metrics.integrity_failures == 1


@pytest.mark.parametrize("field", ["lease", "item_id", "matched"])
@pytest.mark.parametrize("batch", [False, True], ids=["drop_select", "drop_select_many"])
async def test_a_delivery_whose_ids_were_damaged_is_not_taken_and_never_reaches_a_second_consumer(
    monkeypatch: pytest.MonkeyPatch, field: str, batch: bool
) -> None:
    """A flipped lease or item id would make the consumer confirm a delivery that is not the
    item's: the producer would refuse the receipt and hand the item to the next consumer as
    well. A flipped match would tell the caller a wrong length. The delivery's own fields are
    checked too: nothing is taken, the call fails, and a new session gives the item back."""

    def field_moved_by_one(message: m.AnyMessage) -> m.AnyMessage | None:
        if isinstance(message, m.Deliver):
            return msgspec.structs.replace(message, **{field: getattr(message, field) + 1})
        if not isinstance(message, m.DeliverMany):
            return None
        hits = [None if hit is None else msgspec.structs.replace(hit, **{field: getattr(hit, field) + 1})
                for hit in message.hits]  # fmt: skip
        return msgspec.structs.replace(message, hits=hits)

    tokens, key, value = torch.arange(8), torch.randn(2, 8, 2, 4), torch.randn(2, 8, 2, 4)

    async def take(consumer: kvrt.Consumer) -> kvrt.KVItem | None:
        return (await consumer.drop_select_many([tokens]))[0] if batch else await consumer.drop_select(tokens)

    async with kvrt.Producer(checksum=True) as producer:
        await producer.insert(tokens, None, key, value)
        async with kvrt.Consumer(connect=producer.endpoint) as first:
            altered = damage_the_first(monkeypatch, field_moved_by_one)
            with pytest.raises(kvrt.IntegrityError, match="ids, lease and match"):
                await take(first)
            assert altered and first.metrics.integrity_failures == 1
            await asyncio.wait_for(first.link_for_tests().connected.wait(), 10)  # its new session
            item = await take(first)
            assert item is not None and item.matched == 8 and torch.equal(item.key, key)
        async with kvrt.Consumer(connect=producer.endpoint) as second:
            assert await take(second) is None  # delivered once


@pytest.mark.parametrize("field", ["lease", "item_id", "matched", "layers", "payload_bytes", "input_tokens"])
async def test_a_stream_start_whose_fields_were_damaged_is_not_taken_and_never_reaches_a_second_consumer(
    monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    """As a delivery's: a stream's start carries the checksum of its own fields and of its
    tokens frame. A damaged one opens nothing: the call fails, and a new session gives the
    item back whole."""

    def field_moved_by_one(message: m.AnyMessage) -> m.AnyMessage | None:
        if not isinstance(message, m.StreamStart):
            return None
        if field == "input_tokens":
            shorter = m.TensorMeta(dtype=message.input_tokens.dtype, shape=(message.input_tokens.shape[0] - 1,))
            return msgspec.structs.replace(message, input_tokens=shorter)
        return msgspec.structs.replace(message, **{field: getattr(message, field) + 1})

    tokens, key, value = torch.arange(8), torch.randn(2, 8, 2, 4), torch.randn(2, 8, 2, 4)
    async with kvrt.Producer(checksum=True) as producer:
        writer = await producer.open_stream(tokens, layers=2)  # a prefill publishing layer by layer
        async with kvrt.Consumer(connect=producer.endpoint) as first:
            altered = damage_the_first(monkeypatch, field_moved_by_one)
            with pytest.raises(kvrt.IntegrityError, match="stream"):
                await first.open_stream(tokens)
            assert altered and first.metrics.integrity_failures == 1
            await asyncio.wait_for(first.link_for_tests().connected.wait(), 10)  # its new session
            stream = await first.open_stream(tokens)
            assert stream is not None and stream.matched == 8
            for layer in range(2):
                await writer.put_layer(key[layer], value[layer])
            await writer.finish()
            keys, values = await read_whole(stream)
            assert torch.equal(keys, key) and torch.equal(values, value)
        async with kvrt.Consumer(connect=producer.endpoint) as second:
            assert await second.drop_select(tokens) is None  # delivered once


async def test_a_large_item_is_checked_off_the_event_loop_which_goes_on_serving_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over TCP a large item's check runs on a thread of the receiver's: a GPU producer's
    checksum, checked on a host with the kernel's torch reference, takes milliseconds per MiB.
    Here the check is made to take a second; the loop keeps its pace meanwhile."""
    import time

    from kvrt._consumer import _consumer
    from kvrt._producer._parts import ItemKeeper
    from kvrt.kernels.checksum import checksum_reference

    prepare = ItemKeeper.prepare

    def as_a_gpu_producer_does(self: ItemKeeper, record: BufferedItem, item: ItemBytes) -> None:
        prepare(self, record, item)
        record.checksum, item.device_checksum = None, checksum_reference(item.storage, metas_seed(record.metas))

    def slowly(data: torch.Tensor, seed: int) -> int:
        time.sleep(1.0)
        return checksum_reference(data, seed)

    monkeypatch.setattr(ItemKeeper, "prepare", as_a_gpu_producer_does)
    monkeypatch.setattr(_consumer, "device_checksum", slowly)
    tokens, key, value = torch.arange(16), torch.randn(2, 16, 8, 512), torch.randn(2, 16, 8, 512)  # 2 MiB
    gaps: list[float] = []

    async def ticking() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async with kvrt.Producer(checksum=True) as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        await producer.insert(tokens, None, key, value)
        ticker = asyncio.create_task(ticking())
        try:
            item = await consumer.drop_select(tokens)
        finally:
            ticker.cancel()
        assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)
    assert sum(gaps) > 0.8 and max(gaps) < 0.5  # it ticked on through the check's second


@needs_nixl
async def test_with_checksums_an_item_taken_into_buffers_over_nixl_is_checked_before_anything_lands_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A READ straight into the caller's buffers could not be checked before the caller sees
    them: with checksums the item is read into kvrt's memory, checked, then copied."""
    tokens, key, value = _item(8)
    staging = kvrt.KVBuffers(key=torch.zeros(key.numel()), value=torch.zeros(value.numel()))
    async with (
        kvrt.Producer(transport="nixl", checksum=True) as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        await producer.insert(tokens, None, key, value)
        flipped = flip_one_landed_byte(monkeypatch, _nixl_receiver())
        with pytest.raises(kvrt.IntegrityError):
            await consumer.drop_select(tokens, into=staging)
        assert flipped and not staging.key.any() and not staging.value.any()
        item = await consumer.drop_select(tokens, into=staging)
        assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)
        assert item.key.data_ptr() == staging.key.data_ptr()


@needs_nixl
async def test_with_checksums_a_pull_over_nixl_is_checked_before_anything_lands_in_the_pools(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvrt.transports import nixl

    monkeypatch.setattr(nixl, "POOL_DESCRIPTOR_BYTES", 0)  # these pools' rows would be READ in place
    slots, heads, dim, layers = 64, 2, 8, 3
    generator = torch.Generator().manual_seed(5)
    source = PoolTable([[[torch.randn((slots, 2 * heads, dim), generator=generator) for _ in range(layers)]]],
                       Layout.TOKEN_MAJOR)  # fmt: skip
    target = PoolTable([[[torch.zeros((slots, 2 * heads, dim)) for _ in range(layers)]]], Layout.TOKEN_MAJOR)
    tokens, from_slots = torch.arange(32), torch.randperm(slots, generator=generator)[:32]
    async with (
        kvrt.Producer(transport="nixl", checksum=True) as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        producer.register_pools(source)
        await producer.publish(tokens, from_slots)
        flipped = flip_one_landed_byte(monkeypatch, _nixl_receiver())
        with pytest.raises(kvrt.IntegrityError):
            await consumer.pull(tokens, into=target, slots=torch.arange(32))
        assert flipped and all(not pool.any() for pool in target.pools[0][0])
        item = await consumer.pull(tokens, into=target, slots=torch.arange(32))
        assert item is not None
        for layer in range(layers):
            assert torch.equal(target.pools[0][0][layer][:32], source.pools[0][0][layer][from_slots])


async def test_a_large_check_does_not_wait_for_the_applications_own_thread_work() -> None:
    """kvrt's check workers are its own: an application whose default executor is busy (or
    waits in it for kvrt) does not hold its large deliveries' checks."""
    import concurrent.futures
    import threading

    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    released = threading.Event()
    busy = loop.run_in_executor(None, released.wait, 30)  # the application's one worker, taken
    tokens, key, value = _item(9)  # 4 MiB: checked off the loop
    try:
        async with kvrt.Producer(checksum=True) as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
            await producer.insert(tokens, None, key, value)
            item = await asyncio.wait_for(consumer.drop_select(tokens), 10)
            assert item is not None and torch.equal(item.key, key)
    finally:
        released.set()
        await busy
