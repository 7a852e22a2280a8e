"""Publish from paged pools, pull into paged pools: across dp replicas, bit for bit (CPU: TCP and gloo)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import kvrt
from kvrt import Layout, PoolTable
from kvrt.kernels.paged_kv import gather_layer_reference
from tests._checks import collected, same_bits

LAYERS, HEADS, DIM, SLOTS = 3, 2, 8, 32
CPU_LAYOUTS = [Layout.TOKEN_MAJOR, Layout.BLOCK, Layout.BLOCK_HEAD_MAJOR, Layout.MLA]
"""Every layout a CPU host's pools may have (head-major blocks are CPU-only: vLLM's CPU backend)."""


def random_pools(replicas: int, layout: Layout, *, copies: int = 1, seed: int = 0) -> PoolTable:
    generator = torch.Generator().manual_seed(seed)
    shape = {
        Layout.TOKEN_MAJOR: (SLOTS, 2 * HEADS, DIM),
        Layout.BLOCK: (2, SLOTS // 4, 4, HEADS, DIM),
        Layout.BLOCK_HEAD_MAJOR: (SLOTS // 4, HEADS, 2, 4, DIM),
        Layout.MLA: (SLOTS, DIM),
    }[layout]
    return PoolTable(
        [[[torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)] for _ in range(copies)]
         for _ in range(replicas)],
        layout,
    )  # fmt: skip


def row(table: PoolTable, replica: int, copy: int, layer: int, slot: int, kv: int) -> torch.Tensor:
    pool = table.pools[replica][copy][layer]
    if table.layout is Layout.TOKEN_MAJOR:
        return pool[slot, kv * HEADS : (kv + 1) * HEADS]
    if table.layout is Layout.BLOCK:
        return pool[kv].reshape(SLOTS, HEADS, DIM)[slot]
    if table.layout is Layout.BLOCK_HEAD_MAJOR:
        block = pool[slot // 4, :, kv]
        return block.reshape(HEADS, DIM, 4)[:, :, slot % 4] if kv == 0 else block[:, slot % 4]
    return pool[slot]


@pytest.mark.parametrize("layout", CPU_LAYOUTS, ids=lambda layout: layout.value)
@pytest.mark.parametrize(
    ("transport", "chunk_bytes"),
    [("tcp", 1 << 30), ("gloo", 1 << 30), ("gloo", 1)],
    ids=["tcp", "gloo-whole", "gloo-layer-by-layer"],
)
async def test_a_request_spread_over_four_replicas_lands_in_replica_two_bit_for_bit(
    layout: Layout, transport: str, chunk_bytes: int
) -> None:
    source = random_pools(4, layout, seed=1)
    target = random_pools(3, layout, copies=2 if layout is Layout.MLA else 1, seed=2)
    tokens = torch.arange(500, 512)
    from_replica = torch.arange(12) % 4
    from_slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(3))[:12]
    into_slots = torch.arange(16, 28)
    untouched = [pool.clone() for pool in target.pools[0][0]]
    async with (
        kvrt.Producer(transport=transport) as producer,
        kvrt.Consumer(connect=producer.endpoint, transport=transport) as consumer,
    ):
        producer.register_pools(source, chunk_bytes=chunk_bytes)
        await producer.publish(tokens, from_slots, from_replica)
        item = await consumer.pull(tokens, into=target, slots=into_slots, replica=2)
    assert item is not None and item.matched == 12
    assert landed_in_replica_two(source, target, from_replica, from_slots, untouched)


def landed_in_replica_two(
    source: PoolTable, target: PoolTable, from_replica: torch.Tensor, from_slots: torch.Tensor,
    untouched: list[torch.Tensor],
) -> bool:  # fmt: skip
    """Whether token i of the request published from `from_slots[i]` of replica
    `from_replica[i]` is at slot 16 + i of replica 2 in every copy (MLA: every card of the
    group), and replica 0's pools are still `untouched`."""
    for layer in range(LAYERS):
        for token in range(from_slots.numel()):
            for kv in range(target.geometry.kv):
                want = row(source, int(from_replica[token]), 0, layer, int(from_slots[token]), kv)
                for copy in range(target.copies):
                    if not same_bits(row(target, 2, copy, layer, 16 + token, kv), want):
                        return False
    return all(torch.equal(a, b) for a, b in zip(untouched, target.pools[0][0], strict=True))


async def test_a_miss_writes_nothing() -> None:
    target = random_pools(1, Layout.TOKEN_MAJOR)
    before = [pool.clone() for pool in target.pools[0][0]]
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        assert await consumer.pull(torch.arange(4), into=target, slots=torch.arange(4)) is None
    assert all(torch.equal(a, b) for a, b in zip(before, target.pools[0][0], strict=True))


async def test_fewer_slots_than_tokens_write_that_many_tokens() -> None:
    source, target = random_pools(1, Layout.TOKEN_MAJOR, seed=4), random_pools(1, Layout.TOKEN_MAJOR, seed=5)
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        producer.register_pools(source)
        await producer.publish(torch.arange(8), torch.arange(8))
        item = await consumer.pull(torch.arange(8), into=target, slots=torch.tensor([30, 31]))
    assert item is not None
    assert same_bits(target.pools[0][0][0][30], source.pools[0][0][0][0])
    assert same_bits(target.pools[0][0][0][31], source.pools[0][0][0][1])


async def test_publish_needs_registered_pools_and_one_slot_per_token(producer: kvrt.Producer) -> None:
    with pytest.raises(kvrt.InvalidInputError, match="register_pools"):
        await producer.publish(torch.arange(4), torch.arange(4))
    producer.register_pools(random_pools(1, Layout.TOKEN_MAJOR))
    with pytest.raises(kvrt.InvalidInputError, match="3 slots for 4 tokens"):
        await producer.publish(torch.arange(4), torch.arange(3))
    with pytest.raises(kvrt.InvalidInputError, match="slot index 99 is out of range"):
        await producer.publish(torch.arange(1), torch.tensor([99]))


async def test_slots_out_of_range_are_refused_before_the_item_is_taken() -> None:
    source, target = random_pools(1, Layout.TOKEN_MAJOR, seed=6), random_pools(1, Layout.TOKEN_MAJOR, seed=7)
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        producer.register_pools(source)
        await producer.publish(torch.arange(4), torch.arange(4))
        with pytest.raises(kvrt.InvalidInputError, match="slot index 32 is out of range"):
            await consumer.pull(torch.arange(4), into=target, slots=torch.tensor([0, 1, 2, SLOTS]))
        assert producer.stats().items == 1  # still buffered: nothing lost
        assert await consumer.pull(torch.arange(4), into=target, slots=torch.arange(4)) is not None


@pytest.mark.parametrize("with_roi", [False, True], ids=["tokens", "roi"])
def test_the_lookup_key_and_the_index_ranges_come_back_in_one_read(with_roi: bool) -> None:
    from kvrt._item import masked_tokens
    from kvrt._producer import _lookup_key_and

    tokens = torch.arange(10, dtype=torch.int64) * 7
    roi = (torch.arange(10) % 3 == 0) if with_roi else None
    ranges = torch.tensor([0, 3, -1, 40])
    key, values = _lookup_key_and(tokens, roi, ranges)()
    assert key.tolist() == masked_tokens(tokens, roi).tolist()
    assert values == [0, 3, -1, 40]
    key, values = _lookup_key_and(tokens, roi, None)()  # indexes checked on the host: the key alone
    assert key.tolist() == masked_tokens(tokens, roi).tolist()
    assert values == []


class _Launch:
    """Stands for a prepared gather: notes when it is launched."""

    def __init__(self, log: list[str], name: str, *, compiled: bool = True, fails: bool = False) -> None:
        self.log, self.name, self.compiled, self.fails = log, name, compiled, fails

    def launch(self) -> None:
        if self.fails:
            raise RuntimeError(f"{self.name} failed to launch")
        self.log.append(self.name)

    def record(self, stream: object) -> None:  # stands for the chunk's event
        self.log.append(f"{self.name} ready")


async def test_compiled_gathers_are_queued_chunk_by_chunk_as_their_sends_need_them() -> None:
    import concurrent.futures

    from kvrt._producer import _Gathers

    log: list[str] = []
    launches = [_Launch(log, f"chunk {index}") for index in range(3)]

    def plan() -> list[_Launch]:
        log.append("planned")
        return launches

    gathers = _Gathers(plan, launches, None, lambda: concurrent.futures.ThreadPoolExecutor(1))  # type: ignore[arg-type]
    assert log == []  # planned when the first send needs it, after its header left
    assert gathers.prepare() is None  # all compiled: the loop queues them itself
    assert log == ["planned"]
    log.clear()
    gathers.queue_through(0)
    assert log == ["chunk 0", "chunk 0 ready"]
    gathers.queue_through(0)  # queued once
    gathers.queue_through(None)
    assert log == ["chunk 0", "chunk 0 ready", "chunk 1", "chunk 1 ready", "chunk 2", "chunk 2 ready"]


async def test_gathers_that_must_compile_are_queued_in_a_worker_thread() -> None:
    import asyncio
    import concurrent.futures
    import threading

    from kvrt._producer import _Gathers

    threads: list[str] = []
    log: list[str] = []
    launches = [_Launch(log, "chunk 0"), _Launch(log, "chunk 1", compiled=False)]
    launches[1].launch = lambda: threads.append(threading.current_thread().name)  # type: ignore[method-assign]
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gather") as pool:
        gathers = _Gathers(lambda: launches, launches, None, lambda: pool)  # type: ignore[arg-type]
        in_thread = gathers.prepare()
        assert in_thread is not None
        await asyncio.wrap_future(in_thread)
        gathers.queue_through(None)  # nothing left: it checks the thread's outcome
    assert threads[0].startswith("gather")


@pytest.mark.parametrize(
    ("compiled", "planned"), [(True, True), (False, True), (True, False)],
    ids=["on-the-loop", "in-a-thread", "not-planned"],
)  # fmt: skip
async def test_a_gather_that_fails_to_queue_fails_every_send_and_publish(compiled: bool, planned: bool) -> None:
    import concurrent.futures

    from kvrt._item_bytes import GathersFailed, gathers_prepared
    from kvrt._producer import _Gathers

    log: list[str] = []
    launches = [_Launch(log, "chunk 0", compiled=compiled, fails=True)]

    def plan() -> list[_Launch]:
        if not planned:
            raise RuntimeError("chunk 0 failed to launch: no plan")
        return launches

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        gathers = _Gathers(plan, launches, None, lambda: pool)  # type: ignore[arg-type]
        item = type("Item", (), {"gathers": gathers})()

        async def send() -> None:  # what the producer's send path does before each chunk
            await gathers_prepared(item)  # type: ignore[arg-type]
            gathers.queue_through(0)

        for _ in range(2):  # the first send and publish itself both learn of it
            with pytest.raises(GathersFailed, match="chunk 0 failed to launch"):
                await send()


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
async def test_the_producer_lets_go_of_a_pulled_request_once_it_is_received(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import weakref

    import kvrt._producer._publish

    published: list[weakref.ref[torch.Tensor]] = []
    build = kvrt._producer._publish.item_from_packed

    def noting(*args: object, **kwargs: object) -> object:
        item = build(*args, **kwargs)  # type: ignore[arg-type]
        published.append(weakref.ref(item.bytes.storage))
        return item

    monkeypatch.setattr(kvrt._producer._publish, "item_from_packed", noting)
    source, target = random_pools(2, Layout.TOKEN_MAJOR, seed=1), random_pools(1, Layout.TOKEN_MAJOR, seed=2)
    async with (
        kvrt.Producer(transport=transport) as producer,
        kvrt.Consumer(connect=producer.endpoint, transport=transport) as consumer,
    ):
        producer.register_pools(source, chunk_bytes=1)
        for round_ in range(4):
            tokens = torch.arange(8) + 100 * round_
            await producer.publish(tokens, torch.arange(8), 1)
            assert await consumer.pull(tokens, into=target, slots=torch.arange(8)) is not None
        await asyncio.sleep(0)  # the receipt leaves
        assert await consumer.drop_select(torch.tensor([-1]), timeout=0) is None  # and has arrived
        for _ in range(100):  # a finished send is let go of when the next item is made, or at once
            producer._serving.reclaim()
            await collected()
            if sum(ref() is not None for ref in published) == 0:
                break
            await asyncio.sleep(0.01)
    assert [ref() is None for ref in published] == [True] * 4


def test_a_head_major_block_pool_reads_a_slots_key_as_a_column_of_its_block_and_its_value_as_a_row() -> None:
    # vLLM's CPU backend (vec and vec16 kernels): per block and head, keys as [head_dim, block_size],
    # then values as [block_size, head_dim].
    pool = torch.zeros((SLOTS // 4, HEADS, 2, 4, DIM))
    keys = pool[2, 1, 0].view(DIM, 4)
    keys[:, 3] = torch.arange(DIM, dtype=pool.dtype)  # block 2, head 1, offset 3: slot 11
    pool[2, 1, 1, 3] = -torch.arange(DIM, dtype=pool.dtype)  # its value row
    table = PoolTable([[[pool]]], Layout.BLOCK_HEAD_MAJOR)
    key, value = gather_layer_reference(table, torch.zeros(1, dtype=torch.int64), torch.tensor([11]), 0)
    assert key[0, 1].tolist() == list(range(DIM)) and value[0, 1].tolist() == [-d for d in range(DIM)]
    assert key[0, 0].eq(0.0).all() and value[0, 0].eq(0.0).all()


def test_a_head_major_block_pool_of_another_shape_is_refused() -> None:
    with pytest.raises(kvrt.InvalidInputError, match=r"\[blocks, heads, 2, block_size, head_dim\]"):
        PoolTable([[[torch.zeros((SLOTS // 4, HEADS, 4, 2 * DIM))]]], Layout.BLOCK_HEAD_MAJOR)


def landed_by_descriptors(
    table: PoolTable, key: torch.Tensor, value: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor
) -> int:
    """Write an item's K and V into `table` as a transport following `landing_ranges` would:
    one copy of bytes per row, from the item's packed payload. Returns the number of rows."""
    from kvrt._pools import landing_ranges

    payload = torch.cat([key.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)])
    rows = landing_ranges(
        table, replica.numpy(), slots.numpy(), item_tokens=key.shape[1], key_offset=0, value_offset=key.nbytes
    )
    assert rows is not None
    for pool_address, offset, nbytes in rows.tolist():
        assert offset >= 0 and offset + nbytes <= payload.numel()  # inside the item, always
        ctypes.memmove(pool_address, payload.data_ptr() + offset, nbytes)
    return len(rows)


@pytest.mark.parametrize("layout", [Layout.TOKEN_MAJOR, Layout.BLOCK, Layout.MLA], ids=lambda layout: layout.value)
@pytest.mark.parametrize("slots_given", ["scattered", "in-pages", "fewer-than-tokens"])
def test_a_pulls_descriptors_write_the_pools_exactly_as_the_scatter_does(layout: Layout, slots_given: str) -> None:
    from kvrt.kernels.paged_kv import scatter_from_any

    source = random_pools(2, layout, seed=11)
    tokens = 12
    key, value = gather_layer_reference(source, torch.arange(tokens) % 2, torch.arange(tokens), 0)
    key = torch.stack([key * (layer + 1) for layer in range(LAYERS)])  # every layer its own bytes
    value = torch.stack([value * (layer + 1) for layer in range(LAYERS)])
    generator = torch.Generator().manual_seed(12)
    if slots_given == "scattered":
        replica = torch.randint(0, 3, (tokens,), generator=generator)
        slots = torch.randperm(SLOTS, generator=generator)[:tokens]
    elif slots_given == "in-pages":  # two pages of one replica, then the rest of the request in another
        replica = torch.tensor([1] * 8 + [2] * 4)
        slots = torch.cat([torch.arange(4, 12), torch.arange(20, 24)])
    else:
        replica, slots = torch.full((5,), 2), torch.arange(8, 13)
    copies = 2 if layout is Layout.MLA else 1
    by_scatter = random_pools(3, layout, copies=copies, seed=13)
    by_descriptors = random_pools(3, layout, copies=copies, seed=13)
    scatter_from_any(by_scatter, key, value, replica, slots)
    rows = landed_by_descriptors(by_descriptors, key, value, replica, slots)
    for want, got in zip(by_scatter.pools, by_descriptors.pools, strict=True):
        for want_copy, got_copy in zip(want, got, strict=True):
            assert all(same_bits(a, b) for a, b in zip(want_copy, got_copy, strict=True))
    # Consecutive slots of one replica are one descriptor a layer, part and copy, where a
    # slot's rows follow the previous slot's (not token-major: its K and V interleave).
    pages = layout is not Layout.TOKEN_MAJOR
    runs = 1 + sum(
        not (pages and slots[i] == slots[i - 1] + 1 and replica[i] == replica[i - 1]) for i in range(1, slots.numel())
    )
    if slots_given == "in-pages":
        assert runs == (2 if pages else 12)
    assert rows == runs * LAYERS * by_scatter.geometry.kv * copies


def test_head_major_blocks_have_no_descriptors_and_are_scattered() -> None:
    from kvrt._pools import landing_ranges

    table = random_pools(1, Layout.BLOCK_HEAD_MAJOR)
    empty = np.zeros(4, dtype=np.int64)
    assert landing_ranges(table, empty, np.arange(4), item_tokens=4, key_offset=0, value_offset=0) is None
