"""The NIXL transport on CPU: UCX on loopback, over `cma` (its default between processes of one
host) and over TCP (`UCX_TLS=tcp`, as between hosts without RDMA). Skipped where NIXL is not
installed (`pip install 'kvrt[nixl]'`; `make test` installs it)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import kvrt
from kvrt import Layout
from kvrt._protocol import HEARTBEAT_MISSES, SILENT_HOLD_LEASES
from kvrt.transports import _nixl_reads, _nixl_registrations, _nixl_rendezvous, nixl, select
from kvrt.transports._nixl_agent import Agent, Registration, Transfer, TransferState, nixl_unavailable
from tests._checks import DeafLink, caught_up, lease_ends_with_the_next_delivery, same_bits
from tests._gpu_processes import kv_item, kv_tokens, run_gpu_consumer_that_dies, run_gpu_producer
from tests._processes import _wait_for_stop, child_process, killed_and_forgotten
from tests.conftest import make_kv
from tests.test_pull import CPU_LAYOUTS, DIM, LAYERS, SLOTS, landed_in_replica_two, random_pools, row

if nixl_unavailable() is not None:
    pytest.skip(f"{nixl_unavailable()}", allow_module_level=True)

HEARTBEAT_S = 0.1
LEASE_S = HEARTBEAT_S * HEARTBEAT_MISSES


@pytest.fixture(params=["cma", "tcp"])
def ucx(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """UCX's transports for the agents made in the test: its default (cma for a READ between
    two agents of one host) or TCP alone. UCX reads the variable when each agent starts."""
    if request.param == "tcp":
        monkeypatch.setenv("UCX_TLS", "tcp")
    else:
        monkeypatch.delenv("UCX_TLS", raising=False)
    return str(request.param)


def nixl_of(service: kvrt.Producer | kvrt.Consumer) -> Any:
    if isinstance(service, kvrt.Producer):
        return service._transports["nixl"]  # type: ignore[attr-defined]
    return service.link_for_tests().joining.transports["nixl"]


async def test_items_of_every_shape_arrive_equal_over_nixl(ucx: str) -> None:
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        small = torch.arange(12)
        key, value, hidden = make_kv(small, dtype=torch.bfloat16)
        await producer.insert(small, None, key, value, hidden)
        large = torch.arange(100, 1124)  # 8 MiB of KV: past the size READ from the loop
        big_key = torch.randn(4, 1024, 8, 64)
        roi = torch.ones(1024, dtype=torch.bool)
        await producer.insert(large, roi, big_key, -big_key, None)
        item = await consumer.drop_select(small[:5])
        assert item is not None and item.matched == 5
        assert torch.equal(item.key, key) and torch.equal(item.value, value) and torch.equal(item.hidden, hidden)  # type: ignore[arg-type]
        item = await consumer.drop_select(large, roi)
        assert item is not None and item.matched == 1024 and item.hidden is None
        assert torch.equal(item.key, big_key) and torch.equal(item.value, -big_key)
        assert consumer.transports == {producer.endpoint: "nixl"} and producer.stats().transports == {"nixl": 1}


@dataclass(frozen=True)
class ReadMade:
    descriptors: int
    nbytes: int


def reads_made(monkeypatch: pytest.MonkeyPatch) -> list[ReadMade]:
    """Each READ the agents make from here on: its descriptors and bytes."""
    reads: list[ReadMade] = []
    read = Agent.read

    def noted(agent: Agent, remote: str, ranges: Any, **where: Any) -> Transfer:
        transfer = read(agent, remote, ranges, **where)
        reads.append(ReadMade(len(ranges), transfer.nbytes))
        return transfer

    monkeypatch.setattr(Agent, "read", noted)
    return reads


async def test_a_large_item_of_host_memory_is_read_in_parts_that_keep_the_loop_waiting_little(
    ucx: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between host memories UCX's `cma` copies inside the call that posts a READ, holding the
    agent's lock, which every call of the loop's takes too: a large item is READ as parts of at
    most `READ_PART_BYTES`, so the loop (another producer's small READ, a registration) waits
    on the agent for one part's copy at most, not for a whole item's."""
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        tokens = torch.arange(1000)
        key = torch.randn(4, 1000, 8, 64)  # 16 MB of K and V
        await producer.insert(tokens, None, key, -key)
        await consumer.link_for_tests().joining.joined()
        reads = reads_made(monkeypatch)
        item = await consumer.drop_select(tokens)
        assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, -key)
    assert sum(read.nbytes for read in reads) >= 2 * key.nbytes
    assert len(reads) >= 2 * key.nbytes // _nixl_reads.READ_PART_BYTES
    assert max(read.nbytes for read in reads) <= _nixl_reads.READ_PART_BYTES


@pytest.mark.parametrize(
    "sizes",
    [[10], [25], [3, 4, 5, 6, 7], [1, 30, 2, 9, 1, 1, 10], [10, 10, 10]],
    ids=lambda sizes: "+".join(map(str, sizes)),
)
def test_the_parts_of_a_read_cover_its_bytes_in_order_and_none_passes_the_limit(sizes: list[int]) -> None:
    starts = np.cumsum([0, *sizes[:-1]])
    ranges = [(1000 + start, 5000 + 2 * start, size) for start, size in zip(starts, sizes, strict=True)]
    parts = _nixl_reads.parts(ranges, 10)
    rows = [tuple(int(value) for value in row) for part in parts for row in part]
    assert all(sum(int(row[2]) for row in part) <= 10 for part in parts)
    assert len(parts) <= 2 * -(-sum(sizes) // 10)  # two parts in a row hold more than the limit
    local = [(address + offset) for address, _, size in rows for offset in range(size)]
    remote = [(address + offset) for _, address, size in rows for offset in range(size)]
    assert local == [address + offset for address, _, size in ranges for offset in range(size)]
    assert remote == [address + offset for _, address, size in ranges for offset in range(size)]


async def test_many_items_in_flight_and_a_batch_arrive_in_the_right_calls(ucx: str) -> None:
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        for index in range(24):
            tokens = torch.tensor([index, 7])
            await producer.insert(tokens, None, *make_kv(tokens, seed=index))
        items = await asyncio.gather(*(consumer.drop_select(torch.tensor([index, 7])) for index in range(16)))
        for index, item in enumerate(items):
            assert item is not None and torch.equal(item.key, make_kv(item.input_tokens, seed=index)[0])
        batch = await consumer.drop_select_many([torch.tensor([index, 7]) for index in range(16, 24)])
        for index, item in zip(range(16, 24), batch, strict=True):
            assert item is not None and torch.equal(item.value, make_kv(item.input_tokens, seed=index)[1])


async def test_registered_memory_is_reused_once_items_are_confirmed_and_dropped() -> None:
    """The producer's items and the consumer's receive buffers are regions of slabs registered
    once: a region comes back when the item is confirmed (producer) or dropped by the caller
    (consumer), and the next item takes it, with no new registration."""
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        sender, receiver = nixl_of(producer), nixl_of(consumer)
        addresses = set()
        for round_ in range(3):
            tokens = torch.arange(64)
            key, value, hidden = make_kv(tokens, layers=4, heads=8, head_dim=64, seed=round_)
            await producer.insert(tokens, None, key, value, hidden)
            item = await consumer.drop_select(tokens)
            assert item is not None and torch.equal(item.key, key)
            addresses.add(item.key.untyped_storage().data_ptr())
            del item
            await caught_up(consumer)  # the receipt went: the producer dropped the item
        assert len(addresses) == 1  # the consumer's one region, each time
        assert len(sender._arena.slabs) == 1 and len(receiver._arena.slabs) == 1
        sender._arena.collect(), receiver._arena.collect()  # what allocating does first
        assert sender._arena.used_bytes == 0 and receiver._arena.used_bytes == 0


async def test_a_delivery_read_after_the_lease_ended_reads_nothing_and_the_item_comes_next_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer woken from a stall reads nothing of a delivery outside its lease (the
    producer may have reused that memory): no READ is made; the region it describes is
    still loaded, so the next delivery out of it is read."""
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        tokens = torch.arange(8)
        await producer.insert(tokens, None, torch.ones(1, 8, 1, 4), torch.ones(1, 8, 1, 4))
        link = consumer.link_for_tests()
        receiver = nixl_of(consumer)
        reads: list[object] = []
        lease_ends_with_the_next_delivery(link, monkeypatch)
        read = receiver._post
        monkeypatch.setattr(receiver, "_post", lambda *args: reads.append(args) or read(*args))
        with pytest.raises(kvrt.LeaseExpiredError):
            await consumer.drop_select(tokens)
        assert reads == []
        monkeypatch.undo()
        item = await consumer.drop_select(tokens)
        assert item is not None and torch.equal(item.key, torch.ones(1, 8, 1, 4))


async def test_a_frame_naming_memory_the_producer_never_registered_fails_its_call_typed_and_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer (broken or hostile) that points a READ at memory it did not register for
    this consumer: NIXL refuses the READ before anything moves, the call fails with
    `RemoteProtocolError`, and the item, given back, arrives on the next call."""
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        tokens = torch.arange(6)
        await producer.insert(tokens, None, *make_kv(tokens, seed=4))
        sender = nixl_of(producer)
        frame = sender._frame
        lied: list[bool] = []

        def elsewhere_once(peer: bytes, item: Any) -> memoryview:
            honest = _nixl_rendezvous.read_decoder.decode(frame(peer, item))
            if lied:
                return memoryview(_nixl_rendezvous.encode_read(honest))
            lied.append(True)
            beyond = nixl.NixlRead(honest.address + (1 << 40), honest.metadata)
            return memoryview(_nixl_rendezvous.encode_read(beyond))

        monkeypatch.setattr(sender, "_frame", elsewhere_once)
        with pytest.raises(kvrt.RemoteProtocolError, match="nixl"):
            await consumer.drop_select(tokens)
        item = await consumer.drop_select(tokens, timeout=10)
        assert item is not None and torch.equal(item.key, make_kv(tokens, seed=4)[0])


@pytest.mark.parametrize(
    "rendezvous",
    [
        {},
        {"nixl": "1", "probe": "4096", "device": "cpu"},  # no metadata
        {"nixl": "1", "agent.0": "not base64!", "probe": "4096", "device": "cpu"},
        {"nixl": "1", "agent.0": "AAAA", "probe": "-1", "device": "cpu"},
        {"nixl": "1", "agent.0": "AAAA", "probe": str(2**64), "device": "cpu"},
        {"nixl": "1", "agent.0": "AAAA", "probe": "4096", "device": "tpu"},
        {"nixl": "1", "agent.0": "AAAA", "probe": "4096", "device": "cpu", **{f"agent.{i}": "AAAA" for i in range(13)}},
    ],
    ids=["empty", "no-metadata", "bad-base64", "negative-probe", "huge-probe", "strange-device", "too-many-pieces"],
)
def test_a_rendezvous_that_does_not_parse_is_a_typed_error_of_the_producers(rendezvous: dict[str, str]) -> None:
    expected = kvrt.TransportUnavailableError if "nixl" not in rendezvous else kvrt.RemoteProtocolError
    with pytest.raises(expected):
        _nixl_rendezvous.parse_rendezvous(rendezvous)


def test_the_rendezvous_of_a_newer_layout_is_not_joined_but_fallen_back_from() -> None:
    with pytest.raises(kvrt.TransportUnavailableError, match="version"):
        _nixl_rendezvous.parse_rendezvous({"nixl": "2", "agent.0": "AAAA", "probe": "4096", "device": "cpu"})


def offering(service: Any, names: tuple[str, ...]) -> Any:
    """`service` (not started) offering `names`, preferred first."""
    service._transport_names = names
    if isinstance(service, kvrt.Producer):
        service._core.transports = names
    return service


@pytest.mark.parametrize("spoiled", ["probe", "metadata"])
async def test_a_producer_whose_nixl_cannot_be_joined_gives_way_to_tcp_and_says_so(
    spoiled: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """At join the consumer loads the producer agent's metadata and READs its probe: metadata
    its NIXL refuses, or a probe it cannot read, is `TransportUnavailableError` there, and
    the items travel over the next transport both offered."""
    offer = nixl.NixlSender.offer

    def spoiled_offer(self: nixl.NixlSender, peer: bytes) -> dict[str, str]:
        rendezvous = offer(self, peer)
        if spoiled == "probe":
            return {**rendezvous, "probe": str(int(rendezvous["probe"]) + (1 << 40))}
        return {key: value for key, value in rendezvous.items() if not key.startswith("agent.")} | {
            "agent.0": "AAAAAAAA"
        }

    monkeypatch.setattr(nixl.NixlSender, "offer", spoiled_offer)
    tokens = torch.arange(12)
    key, value, hidden = make_kv(tokens)
    async with offering(kvrt.Producer(transport="nixl"), ("nixl", "tcp")) as producer:
        producer._transports.update(select.make_senders(("tcp",), producer.device, store_host="127.0.0.1"))
        await producer.insert(tokens, None, key, value, hidden)
        with caplog.at_level(logging.WARNING, logger="kvrt"):
            consumer = offering(kvrt.Consumer(connect=producer.endpoint, transport="nixl"), ("nixl", "tcp"))
            async with consumer:
                assert consumer.transports == {producer.endpoint: "tcp"}
                item = await consumer.drop_select(tokens)
                assert item is not None and torch.equal(item.key, key)
    said = [record.getMessage() for record in caplog.records]
    assert any("nixl" in text and "over tcp instead" in text for text in said), said


async def test_a_producer_forced_to_nixl_answers_clients_and_consumers_that_speak_tcp() -> None:
    """A router's probes and a decode's lookups (clients, which take no items) speak TCP."""
    tokens = torch.arange(12)
    key, value, hidden = make_kv(tokens)
    async with kvrt.Producer(transport="nixl") as producer:
        await producer.insert(tokens, None, key, value, hidden)
        async with kvrt.Client(producer.endpoint) as client:
            assert (await client.stats()).items == 1
        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            assert consumer.transports == {producer.endpoint: "tcp"}
            item = await consumer.drop_select(tokens)
            assert item is not None and torch.equal(item.key, key)


def test_forcing_nixl_where_it_is_not_installed_is_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(select, "nixl_unavailable", lambda: "NIXL is not installed (simulated)")
    with pytest.raises(kvrt.InvalidInputError, match=r"transport='nixl' cannot run here.*simulated"):
        kvrt.Producer(transport="nixl")
    assert "nixl" not in select.transport_preference(None, torch.device("cpu"))  # never chosen unasked on CPU


async def test_a_link_that_went_silent_joins_the_producers_agent_anew_and_reads_on() -> None:
    """The link gives the producer up (nothing heard), then says hello again: its old session's
    READs end, the producer's agent is dropped and loaded anew from the new welcome, and
    items are read over the new session."""
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl", heartbeat_s=0.05) as consumer,
    ):
        await producer.insert(torch.arange(3), None, *make_kv(torch.arange(3)))
        assert await consumer.drop_select(torch.arange(3)) is not None
        link = consumer.link_for_tests()
        receiver = nixl_of(consumer)
        first_session = receiver._session
        deafened = DeafLink(link)
        await asyncio.wait_for(deafened.lost.wait(), 10)
        assert first_session.abandoned
        deafened.deaf = False
        await asyncio.wait_for(link.connected.wait(), 10)
        await link.joining.joined()
        assert receiver._session is not None and receiver._session is not first_session
        await producer.insert(torch.arange(3), None, *make_kv(torch.arange(3), seed=5))
        item = await asyncio.wait_for(consumer.drop_select(torch.arange(3), timeout=10), 20)
        assert item is not None and torch.equal(item.key, make_kv(torch.arange(3), seed=5)[0])


async def test_a_consumer_killed_holding_an_item_it_read_gives_it_back_and_a_new_one_reads_it(ucx: str) -> None:
    """`kill -9` after the bytes were READ, before the receipt: the producer forgets the consumer
    at its heartbeat timeout, the item goes back whole (its registered region untouched), and
    a new consumer READs it."""
    async with kvrt.Producer(transport="nixl", heartbeat_s=HEARTBEAT_S) as producer:
        tokens = torch.arange(64)
        key = torch.randn(4, 64, 8, 64)
        await producer.insert(tokens, None, key, -key, None)
        args = (producer.endpoint, "cpu", HEARTBEAT_S, tokens[:8].tolist())
        control, child = multiprocessing.get_context("spawn").Pipe()
        process = multiprocessing.get_context("spawn").Process(
            target=run_gpu_consumer_that_dies, args=(*args, child, "nixl"), daemon=True
        )
        await asyncio.to_thread(process.start)
        try:
            assert await asyncio.to_thread(control.poll, 60) and control.recv() == "asked"
            assert await asyncio.to_thread(control.poll, 60) and control.recv() == "arrived"
            assert producer.stats().in_flight == 1
            await killed_and_forgotten(process, producer, HEARTBEAT_S)
        finally:
            if process.is_alive():
                process.kill()
        stats = producer.stats()
        assert (stats.items, stats.in_flight, stats.peers) == (1, 0, 0) and stats.totals.returned_items == 1
        async with kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer:
            item = await consumer.drop_select(tokens[:8])
            assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, -key)
            assert await consumer.drop_select(tokens[:8]) is None


def run_stalling_nixl_consumer(
    endpoint: str, tokens: list[int], control: multiprocessing.connection.Connection
) -> None:
    """A nixl consumer with a waiting lookup; told ("hold", s), it holds its loop that long (the
    item reaches its process meanwhile) and is then stopped by the parent; it reports how the
    call ended and how many READs it made."""
    import time

    async def main() -> None:
        async with kvrt.Consumer(connect=endpoint, transport="nixl", heartbeat_s=HEARTBEAT_S) as consumer:
            receiver = nixl_of(consumer)
            reads: list[object] = []
            post = receiver._post
            receiver._post = lambda *args: reads.append(args) or post(*args)
            call = asyncio.create_task(consumer.drop_select(torch.tensor(tokens), None, timeout=None))
            await asyncio.sleep(0)
            assert await consumer.drop_select(torch.tensor([-1]), None, timeout=0.0) is None
            control.send("asked")
            command = await asyncio.to_thread(control.recv)
            control.send("holding")
            until = time.monotonic() + command[1]
            while time.monotonic() < until:  # the loop and the GIL held: nothing is read
                pass
            try:
                item = await asyncio.wait_for(call, 60)
            except kvrt.KVRTError as exc:
                control.send(("error", type(exc).__name__, len(reads)))
            else:
                control.send(("item", float(item.key.float().sum()) if item is not None else None, len(reads)))
            await asyncio.to_thread(_wait_for_stop, control)

    asyncio.run(main())


async def test_a_consumer_stopped_past_its_lease_reads_nothing_of_the_memory_its_item_left() -> None:
    """A consumer whose item reaches its process while its loop is held, then is stopped
    (SIGSTOP) past its lease and the producer's hold for a stopped process: the item goes back,
    another consumer takes it, and the producer
    puts a new item in the same registered region. Woken, the stopped consumer READs nothing
    (its lease ended) and its call fails with `LeaseExpiredError`."""
    tokens = torch.arange(16)
    key = torch.randn(1, 16, 4, 64)
    async with kvrt.Producer(transport="nixl", heartbeat_s=HEARTBEAT_S) as producer:
        sender = nixl_of(producer)
        sent: list[int] = []
        frame = sender._frame
        sender._frame = lambda peer, item: sent.append(item.storage.data_ptr()) or frame(peer, item)
        async with child_process(run_stalling_nixl_consumer, (producer.endpoint, tokens.tolist()), "a consumer") as (
            asked, stalled, control,
        ):  # fmt: skip
            assert asked == "asked"
            control.send(("hold", 0.5))
            assert await asyncio.to_thread(control.recv) == "holding"
            producer._serving.peer_left.clear()
            await producer.insert(tokens, None, key, key)
            assert producer.stats().in_flight == 1
            (sent_at,) = sent
            assert stalled.pid is not None
            os.kill(stalled.pid, signal.SIGSTOP)
            try:
                await asyncio.wait_for(producer._serving.peer_left.wait(), LEASE_S * SILENT_HOLD_LEASES + 5)
                async with kvrt.Consumer(connect=producer.endpoint, transport="nixl") as other:
                    item = await other.drop_select(tokens)
                    assert item is not None and torch.equal(item.key, key)
                    await caught_up(other)
                sender._arena.collect()
                assert sender._arena.used_bytes == 0  # the region is free: the next item takes it
                reused = torch.full_like(key, 7.0)
                await producer.insert(tokens + 100, None, reused, reused)
                (reusing,) = producer._core.buffer.items()
                assert producer._bytes[reusing].storage.data_ptr() == sent_at  # the stopped consumer's item's region
                del reusing
            finally:
                os.kill(stalled.pid, signal.SIGCONT)
            outcome = await asyncio.to_thread(control.recv)
            assert outcome[0] == "error" and outcome[1] in ("LeaseExpiredError", "PeerLostError"), outcome
            assert outcome[2] == 0  # no READ of the region, now another item's


@pytest.mark.parametrize("signal_sent", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
async def test_a_producer_killed_or_stopped_mid_read_fails_the_call_in_time_and_loses_nothing(
    monkeypatch: pytest.MonkeyPatch, signal_sent: signal.Signals
) -> None:
    """Over UCX's TCP (a READ of 256 MiB takes a while there, and needs the producer's process
    to serve it) the producer is killed, or stopped, while the consumer's READ is in flight:
    the call fails with `PeerLostError` within the heartbeat timeout, the READ is given up
    (the session's thread is free again). A stopped producer, woken, has the item back and
    the same consumer takes it whole."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # the producer's process inherits it
    tokens = 16384  # 256 MiB of float32 K and V
    async with child_process(
        run_gpu_producer, ("cpu", "nixl", HEARTBEAT_S, [(3, tokens, "float32")]), "a nixl producer"
    ) as (endpoint, producer, _):
        async with kvrt.Consumer(connect=endpoint, transport="nixl", heartbeat_s=HEARTBEAT_S) as consumer:
            receiver = nixl_of(consumer)
            posted = asyncio.Event()
            loop = asyncio.get_running_loop()
            post = Transfer.post

            def noting_the_post(transfer: Transfer) -> TransferState:
                if transfer.nbytes > 1 << 20:
                    loop.call_soon_threadsafe(posted.set)
                return post(transfer)

            monkeypatch.setattr(Transfer, "post", noting_the_post)
            call = asyncio.create_task(consumer.drop_select(kv_tokens(3, tokens), timeout=10))
            await asyncio.wait_for(posted.wait(), 30)
            assert producer.pid is not None
            os.kill(producer.pid, signal_sent)
            sent_at = asyncio.get_running_loop().time()
            try:
                with pytest.raises(kvrt.PeerLostError):
                    await asyncio.wait_for(call, 30)
                assert asyncio.get_running_loop().time() - sent_at < 4 * LEASE_S + 2.0
                # The READ was given up: the session's thread took the next one (the new
                # session's, once the producer answers again) rather than waiting on it.
                assert receiver._session is None or receiver._session.queued == 0
            finally:
                if signal_sent is signal.SIGSTOP:
                    os.kill(producer.pid, signal.SIGCONT)
            if signal_sent is signal.SIGSTOP:
                link = consumer.link_for_tests()
                await asyncio.wait_for(link.connected.wait(), 20)
                await link.joining.joined()
                item = await asyncio.wait_for(consumer.drop_select(kv_tokens(3, tokens), timeout=20), 40)
                assert item is not None and await asyncio.to_thread(whole, item, tokens)  # 256 MiB: not on the loop
                assert await consumer.drop_select(kv_tokens(3, tokens)) is None


def whole(item: kvrt.KVItem, tokens: int) -> bool:
    _, key, value, _ = kv_item(3, tokens, torch.float32, "cpu")
    return torch.equal(item.key, key) and torch.equal(item.value, value)


async def test_a_read_that_never_ends_fails_its_call_at_the_transfer_timeout_and_the_item_is_read_next_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A READ NIXL keeps in progress for good (a wedged fabric) while the producer answers
    everything else: the call fails with `KVRTTimeoutError` at `transfer_timeout_s`, the READ
    is released, and once the link is welcomed again the item is read whole."""
    wedged = False
    post, state = Transfer.post, Transfer.state
    monkeypatch.setattr(Transfer, "post", lambda t: TransferState.PENDING if wedged else post(t))
    monkeypatch.setattr(Transfer, "state", lambda t: TransferState.PENDING if wedged else state(t))
    released = asyncio.Event()
    loop = asyncio.get_running_loop()
    release = Transfer.release

    def noting_the_release(transfer: Transfer) -> bool:
        done = release(transfer)
        loop.call_soon_threadsafe(released.set)
        return done

    monkeypatch.setattr(Transfer, "release", noting_the_release)
    tokens = torch.arange(40)
    key, value, hidden = make_kv(tokens)
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl", transfer_timeout_s=0.5) as consumer,
    ):
        await producer.insert(tokens, None, key, value, hidden)
        wedged = True
        started = asyncio.get_running_loop().time()
        with pytest.raises(kvrt.KVRTTimeoutError) as failed:
            await asyncio.wait_for(consumer.drop_select(tokens), 10)
        assert failed.value.phase == "transfer" and asyncio.get_running_loop().time() - started < 3.0
        wedged = False
        await asyncio.wait_for(released.wait(), 5)  # on the session's thread
        link = consumer.link_for_tests()
        await asyncio.wait_for(link.connected.wait(), 10)
        await link.joining.joined()
        item = await asyncio.wait_for(consumer.drop_select(tokens, timeout=5), 10)
        assert item is not None and torch.equal(item.key, key) and torch.equal(item.hidden, hidden)  # type: ignore[arg-type]
        assert producer.stats().totals.returned_items == 1


async def test_a_small_item_is_not_held_up_behind_a_large_read_of_the_same_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large READ under way (here: one that does not end) from a producer: a small item of
    the same producer is READ meanwhile, not after it; the large one fails at the transfer
    timeout and its item is read whole next time."""
    wedged = True
    post, state = Transfer.post, Transfer.state

    def large(transfer: Transfer) -> bool:
        return wedged and transfer.nbytes > _nixl_reads.POST_ON_LOOP_BYTES

    monkeypatch.setattr(Transfer, "post", lambda t: TransferState.PENDING if large(t) else post(t))
    monkeypatch.setattr(Transfer, "state", lambda t: TransferState.PENDING if large(t) else state(t))
    small_tokens, large_tokens = torch.arange(16), torch.arange(100, 1124)
    small_kv, large_kv = make_kv(small_tokens), make_kv(large_tokens, layers=4, heads=8, head_dim=64)
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl", transfer_timeout_s=3.0) as consumer,
    ):
        await producer.insert(small_tokens, None, *small_kv)
        await producer.insert(large_tokens, None, *large_kv)
        await consumer.link_for_tests().joining.joined()
        stuck = asyncio.create_task(consumer.drop_select(large_tokens))
        await asyncio.sleep(0.2)
        item = await asyncio.wait_for(consumer.drop_select(small_tokens), 2.0)
        assert item is not None and torch.equal(item.key, small_kv[0]) and not stuck.done()
        with pytest.raises(kvrt.KVRTTimeoutError):
            await asyncio.wait_for(stuck, 10)
        wedged = False
        link = consumer.link_for_tests()
        await asyncio.wait_for(link.connected.wait(), 10)
        await link.joining.joined()
        item = await asyncio.wait_for(consumer.drop_select(large_tokens, timeout=5), 10)
        assert item is not None and torch.equal(item.key, large_kv[0]) and torch.equal(item.value, large_kv[1])


async def test_an_idle_producer_and_consumer_burn_no_core() -> None:
    """NIXL's progress thread waits for UCX's events: a producer and a consumer with nothing
    to move take a small part of a core (NIXL's own setting, a thread that never sleeps,
    took all of one)."""
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl"),
    ):
        started_cpu, started = time.process_time(), time.monotonic()
        await asyncio.sleep(1.0)
        used = (time.process_time() - started_cpu) / (time.monotonic() - started)
    assert used < 0.2, f"{used:.0%} of a core while idle"


def test_the_nixl_benchmark_runs_on_the_host_and_reports_each_ratio_beside_its_reference(tmp_path: Any) -> None:
    """`kvrt bench nixl --quick` on the CPU (a smoke run: it keeps the benchmark working, its
    figures are not a record)."""
    report = tmp_path / "nixl.json"
    result = subprocess.run(
        [sys.executable, "-m", "kvrt", "bench", "nixl", "--quick", "--json", str(report)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "kvrt over nixl on cpu, one request at a time, beside raw NIXL READs" in result.stdout
    rows = json.loads(report.read_text())
    assert [(entry["case"]["kind"], entry["case"]["layout"]) for entry in rows] == [
        ("item", "token_major"), ("pull", "block")
    ]
    for entry in rows:
        assert entry["raw_p50_ms"] > 0 and entry["kvrt_p50_ms"] > 0
        assert entry["ratio"] == pytest.approx(entry["raw_p50_ms"] / entry["kvrt_p50_ms"])


async def test_a_probe_written_over_by_a_peer_is_whole_again_for_the_next_consumer_that_joins() -> None:
    """A peer that drives NIXL by hand can WRITE into what the welcome names (outside kvrt's
    guarantees, see the guide): one write over the join probe must not keep every later
    consumer from joining. Each offer writes the probe anew."""
    from kvrt.transports._nixl_agent import Agent

    async with kvrt.Producer(transport="nixl") as producer:
        await producer.insert(torch.arange(8), None, *make_kv(torch.arange(8)))
        rendezvous = _nixl_rendezvous.parse_rendezvous(nixl_of(producer).offer(b"hostile"))
        hostile = await asyncio.to_thread(Agent, "hostile", progress_thread=False)
        remote = hostile.load(rendezvous.metadata)
        zeros = torch.zeros(4096, dtype=torch.uint8)
        hostile.register(zeros.data_ptr(), zeros.numel(), zeros.device)
        api = hostile._agent
        handle = api.initialize_xfer(
            "WRITE",
            api.get_xfer_descs([(zeros.data_ptr(), 4096, 0)], "DRAM"),
            api.get_xfer_descs([(rendezvous.probe_address, 4096, 0)], "DRAM"),
            remote,
        )
        state = api.transfer(handle)
        while state == "PROC":
            state = api.check_xfer_state(handle)
        api.release_xfer_handle(handle)
        assert state == "DONE"
        async with kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer:
            assert consumer.transports == {producer.endpoint: "nixl"}
            assert await consumer.drop_select(torch.arange(8)) is not None


# -- pulls: K and V READ straight into the caller's pools ----------------------------------


@pytest.mark.parametrize("layout", CPU_LAYOUTS, ids=lambda layout: layout.value)
async def test_a_pull_lands_in_the_slots_with_one_read_and_no_scatter(
    ucx: str, layout: Layout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over nixl a pull's K and V are READ into the pools themselves, one descriptor per run of
    slots, in the item's one READ; the returned item's K and V hold no bytes (meta tensors).
    Head-major blocks have no contiguous rows: their item lands in kvrt's memory and is
    scattered, as over every transport. (These pools' rows are tiny: descriptors of any size
    are taken here, see the next test.)"""
    from kvrt.kernels import paged_kv

    monkeypatch.setattr(nixl, "POOL_DESCRIPTOR_BYTES", 0)

    source = random_pools(4, layout, seed=1)
    target = random_pools(3, layout, copies=2 if layout is Layout.MLA else 1, seed=2)
    tokens = torch.arange(500, 512)
    from_replica = torch.arange(12) % 4
    from_slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(3))[:12]
    into_slots = torch.arange(16, 28)
    untouched = [pool.clone() for pool in target.pools[0][0]]
    scatters: list[object] = []
    scatter = paged_kv.scatter_from_any
    monkeypatch.setattr(paged_kv, "scatter_from_any", lambda *given: scatters.append(given) or scatter(*given))
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        await consumer.link_for_tests().joining.joined()
        reads = reads_made(monkeypatch)
        producer.register_pools(source)
        await producer.publish(tokens, from_slots, from_replica)
        item = await consumer.pull(tokens, into=target, slots=into_slots, replica=2)
    assert item is not None and item.matched == 12 and torch.equal(item.input_tokens, tokens)
    assert landed_in_replica_two(source, target, from_replica, from_slots, untouched)
    assert len(reads) == 1
    if layout is Layout.BLOCK_HEAD_MAJOR:
        assert item.key.device.type == "cpu" and len(scatters) == 1
    else:
        assert item.key.device.type == "meta" and item.key.shape == (LAYERS, 12, target.geometry.heads, DIM)
        assert not scatters and reads[0].descriptors > 1


@pytest.mark.parametrize(("page_tokens", "in_place"), [(1, False), (64, True)], ids=["token-rows", "pages"])
async def test_a_pull_lands_in_place_only_where_its_runs_of_slots_are_long(
    page_tokens: int, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UCX pays for every descriptor: runs of slots shorter than `POOL_DESCRIPTOR_BYTES` on
    average (here a slot's 2 KiB row each) are READ whole into kvrt's memory and scattered;
    pages of 64 slots (128 KiB a run) are READ in place."""
    from kvrt.kernels import paged_kv

    tokens, heads, dim = 256, 4, 128  # 1 KiB of K and 1 KiB of V a token and layer, bf16

    def pools() -> kvrt.PoolTable:
        layers = [torch.randn(2, 8, 64, heads, dim).to(torch.bfloat16) for _ in range(2)]
        return kvrt.PoolTable([[layers]], Layout.BLOCK)

    source, target = pools(), pools()
    pages = torch.randperm(512 // page_tokens, generator=torch.Generator().manual_seed(9))[: tokens // page_tokens]
    into_slots = (pages[:, None] * page_tokens + torch.arange(page_tokens)).flatten()
    scatters: list[object] = []
    scatter = paged_kv.scatter_from_any
    monkeypatch.setattr(paged_kv, "scatter_from_any", lambda *given: scatters.append(given) or scatter(*given))
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        producer.register_pools(source)
        await producer.publish(torch.arange(tokens), torch.arange(tokens))
        item = await consumer.pull(torch.arange(tokens), into=target, slots=into_slots)
    assert item is not None and (item.key.device.type == "meta") == in_place and len(scatters) == (0 if in_place else 1)
    for layer in range(2):
        for kv in range(2):
            landed = target.pools[0][0][layer][kv].reshape(512, heads, dim)[into_slots]
            assert same_bits(landed, source.pools[0][0][layer][kv].reshape(512, heads, dim)[:tokens])


class Wedge:
    """NIXL made to keep every READ posted while `on` in progress (never posted for real),
    as a wedged fabric would: `posted` is set at such a post, `released` at each release of
    one, and `refuse` makes releases fail (NIXL refusing the cancel) while `on`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on = False
        self.refuse = False
        self.posted, self.released = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        post, state, release = Transfer.post, Transfer.state, Transfer.release

        def wedged_post(transfer: Transfer) -> TransferState:
            if not self.on:
                return post(transfer)
            loop.call_soon_threadsafe(self.posted.set)
            return TransferState.PENDING

        def noting_the_release(transfer: Transfer) -> bool:
            if self.on:
                loop.call_soon_threadsafe(self.released.set)
                if self.refuse:
                    return False
            return release(transfer)

        monkeypatch.setattr(Transfer, "post", wedged_post)
        monkeypatch.setattr(Transfer, "state", lambda t: TransferState.PENDING if self.on else state(t))
        monkeypatch.setattr(Transfer, "release", noting_the_release)


async def test_a_pull_cancelled_mid_read_returns_only_once_nothing_writes_its_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pull whose READ into the pools is still in flight when the caller cancels it: the
    READ is released before the cancellation returns (the engine may reuse the slots at
    once), the item goes back to the producer, and the next pull lands it whole."""
    wedge = Wedge(monkeypatch)
    monkeypatch.setattr(nixl, "POOL_DESCRIPTOR_BYTES", 0)
    source, target = random_pools(1, Layout.BLOCK, seed=4), random_pools(1, Layout.BLOCK, seed=5)
    tokens = torch.arange(8)
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        producer.register_pools(source)
        await producer.publish(tokens, torch.arange(8))
        await consumer.link_for_tests().joining.joined()
        wedge.on = True
        pull = asyncio.create_task(consumer.pull(tokens, into=target, slots=torch.arange(8, 16), timeout=5))
        await asyncio.wait_for(wedge.posted.wait(), 10)
        pull.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(pull, 5)
        assert wedge.released.is_set()  # before the pull returned, not after
        wedge.on = False
        item = await asyncio.wait_for(consumer.pull(tokens, into=target, slots=torch.arange(16, 24), timeout=5), 10)
    assert item is not None
    for slot in range(8):
        assert same_bits(row(target, 0, 0, 1, 16 + slot, 1), row(source, 0, 0, 1, slot, 1))


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """The ids of the registrations this process's agents hold, from here on."""
    held: set[int] = set()
    register, deregister = Agent.register, Agent.deregister

    def noting_register(agent: Agent, address: int, nbytes: int, device: torch.device) -> Registration:
        registration = register(agent, address, nbytes, device)
        held.add(registration.registration_id)
        return registration

    def noting_deregister(agent: Agent, registration: Registration) -> None:
        deregister(agent, registration)
        held.discard(registration.registration_id)

    monkeypatch.setattr(Agent, "register", noting_register)
    monkeypatch.setattr(Agent, "deregister", noting_deregister)
    return held


async def test_the_pools_stay_registered_while_their_table_lives_and_no_longer(
    registered: set[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pools are registered with the consumer's agent at their first pull, once; a table
    that was dropped loses its registrations at the next pull, and closing drops the rest."""
    monkeypatch.setattr(nixl, "POOL_DESCRIPTOR_BYTES", 0)
    source = random_pools(1, Layout.BLOCK, seed=6)
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        producer.register_pools(source)
        await consumer.link_for_tests().joining.joined()
        receiver = nixl_of(consumer)
        first = random_pools(1, Layout.BLOCK, seed=7)
        for request in range(2):
            await producer.publish(torch.arange(4) + 10 * request, torch.arange(4))
            assert await consumer.pull(torch.arange(4) + 10 * request, into=first, slots=torch.arange(4)) is not None
        held = list(receiver._registrations._pools[first])
        assert len(held) == LAYERS and {r.registration_id for r in held} <= registered
        del first
        gc.collect()
        await producer.publish(torch.arange(4) + 100, torch.arange(4))
        second = random_pools(1, Layout.BLOCK, seed=8)
        assert await consumer.pull(torch.arange(4) + 100, into=second, slots=torch.arange(4)) is not None
        assert not {r.registration_id for r in held} & registered
        assert len(receiver._registrations._pools[second]) == LAYERS
    assert not registered  # every registration of both sides, pools and slabs


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("host_indexes", [False, True], ids=["indexes-on-the-device", "indexes-on-the-host"])
async def test_a_gpu_pull_reads_its_pages_in_place_after_the_callers_work_on_them(host_indexes: bool) -> None:
    """On a GPU a pull into 16-slot pages of VRAM READs them in place (both processes on
    cuda:0), and only after the work the caller queued on its stream before the pull: pages
    cleared by a kernel still queued behind 100 ms of GPU work hold the request afterwards,
    not the clearing (a READ landed first would be written over)."""
    from tests._gpu_processes import PULL_DIM, PULL_HEADS, PULL_LAYERS, PULL_SLOTS, pull_request, run_gpu_publisher

    torch.cuda.set_device("cuda:0")
    publisher = ("cuda:0", 5, 16 << 20, False, host_indexes, "nixl")
    pools, tokens, replica, slots = await asyncio.to_thread(pull_request, 5)  # 512 MiB of pools: no work for the loop
    page = 16
    pages = torch.randperm(PULL_SLOTS // page, generator=torch.Generator().manual_seed(1))[: tokens.numel() // page]
    into_slots = (pages[:, None] * page + torch.arange(page)).flatten()
    shape = (2, PULL_SLOTS // page, page, PULL_HEADS, PULL_DIM)
    target = kvrt.PoolTable(
        [[[torch.zeros(shape, dtype=torch.bfloat16, device="cuda:0") for _ in range(PULL_LAYERS)]]], Layout.BLOCK
    )
    async with (
        child_process(run_gpu_publisher, publisher, "GPU publisher") as (endpoint, _, _),
        kvrt.Consumer(connect=endpoint, device="cuda:0", transport="nixl") as consumer,
    ):
        await consumer.link_for_tests().joining.joined()
        torch.cuda._sleep(200_000_000)  # ~100 ms of the caller's GPU work, then the clearing
        for pool in target.pools[0][0]:
            pool.fill_(7.0)
        item = await consumer.pull(
            tokens, into=target, slots=into_slots if host_indexes else into_slots.cuda(), timeout=30
        )
    assert item is not None and item.key.device.type == "meta"

    def check() -> None:  # in a thread: reading back and comparing 64 MiB is no work for the loop
        torch.cuda.set_device("cuda:0")  # read on the caller's stream: the pull's end orders it
        for layer in range(PULL_LAYERS):
            for kv in range(2):
                landed = target.pools[0][0][layer][kv].reshape(PULL_SLOTS, PULL_HEADS, PULL_DIM)[into_slots.cuda()]
                want = torch.empty(landed.shape, dtype=landed.dtype)
                for r in range(len(pools)):
                    chosen = (replica == r).nonzero().flatten()
                    rows = pools[r][0][layer][slots[chosen]]  # token-major: K heads, then V heads
                    want[chosen] = rows[:, kv * PULL_HEADS : (kv + 1) * PULL_HEADS]
                assert same_bits(landed.cpu(), want)

    await asyncio.to_thread(check)


# -- into= buffers: K and V READ straight into them ----------------------------------------


@pytest.mark.parametrize("with_hidden", [False, True], ids=["kv", "kv-and-hidden"])
async def test_an_item_taken_into_buffers_is_read_into_them_with_no_copy(
    ucx: str, with_hidden: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`drop_select(into=)` over nixl: the item's K and V (and hidden states, where a buffer
    for them is given) are READ into the caller's buffers in the item's one READ; nothing is
    copied after it, and the returned tensors are views of the buffers."""
    from kvrt._consumer import _arrivals

    copies: list[object] = []
    land_in = _arrivals.land_in
    monkeypatch.setattr(_arrivals, "land_in", lambda *given: copies.append(given) or land_in(*given))
    tokens = torch.arange(64)
    key, value, hidden = make_kv(tokens, dtype=torch.bfloat16)
    staging = kvrt.KVBuffers(
        key=torch.zeros(key.numel() + 100, dtype=key.dtype),
        value=torch.zeros(value.numel() + 100, dtype=value.dtype),
        hidden=torch.zeros(hidden.numel(), dtype=hidden.dtype) if with_hidden else None,  # type: ignore[union-attr]
    )
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        await consumer.link_for_tests().joining.joined()
        reads = reads_made(monkeypatch)
        for _ in range(2):  # the second with the buffers registered already
            await producer.insert(tokens, None, key, value, hidden)
            item = await consumer.drop_select(tokens, into=staging)
            assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)
            assert torch.equal(item.hidden, hidden)  # type: ignore[arg-type]
            assert item.key.data_ptr() == staging.key.data_ptr() and item.value.data_ptr() == staging.value.data_ptr()
            assert (item.hidden.data_ptr() == staging.hidden.data_ptr()) if staging.hidden is not None else True  # type: ignore[union-attr]
            assert not staging.key[key.numel() :].any()  # past the item: untouched
    assert len(reads) == 2 and not copies


async def test_an_item_that_does_not_fit_the_buffers_writes_nothing_there_and_goes_back() -> None:
    tokens = torch.arange(32)
    key, value, hidden = make_kv(tokens)
    small = kvrt.KVBuffers(  # one element short for the key
        key=torch.full((key.numel() - 1,), 5.0, dtype=key.dtype),
        value=torch.full((value.numel(),), 5.0, dtype=key.dtype),
    )
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        await producer.insert(tokens, None, key, value, hidden)
        await consumer.link_for_tests().joining.joined()
        with pytest.raises(kvrt.InvalidInputError, match="goes back to the producer"):
            await consumer.drop_select(tokens, into=small)
        assert bool((small.key == 5.0).all()) and bool((small.value == 5.0).all())
        item = await consumer.drop_select(tokens)
        assert item is not None and torch.equal(item.key, key)


async def test_a_lookup_into_buffers_cancelled_mid_read_returns_only_once_nothing_writes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wedge = Wedge(monkeypatch)
    tokens = torch.arange(16)
    key, value, hidden = make_kv(tokens)
    staging = kvrt.KVBuffers(key=torch.zeros_like(key).flatten(), value=torch.zeros_like(value).flatten())
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        await producer.insert(tokens, None, key, value, hidden)
        await consumer.link_for_tests().joining.joined()
        wedge.on = True
        lookup = asyncio.create_task(consumer.drop_select(tokens, into=staging, timeout=5))
        await asyncio.wait_for(wedge.posted.wait(), 10)
        lookup.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(lookup, 5)
        assert wedge.released.is_set()  # before the lookup returned, not after
        wedge.on = False
        item = await asyncio.wait_for(consumer.drop_select(tokens, into=staging, timeout=5), 10)
        assert item is not None and torch.equal(item.key, key) and item.key.data_ptr() == staging.key.data_ptr()


async def test_only_the_last_few_buffers_stay_registered_and_none_past_the_close(registered: set[int]) -> None:
    tokens = torch.arange(8)
    key, value, hidden = make_kv(tokens)
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        await consumer.link_for_tests().joining.joined()
        receiver = nixl_of(consumer)
        for request in range(_nixl_registrations.REGISTERED_BUFFERS + 4):
            await producer.insert(tokens + 100 * request, None, key, value, hidden)
            staging = kvrt.KVBuffers(key=torch.zeros_like(key).flatten(), value=torch.zeros_like(value).flatten())
            item = await consumer.drop_select(tokens + 100 * request, into=staging)
            assert item is not None and item.key.data_ptr() == staging.key.data_ptr()
        buffers = receiver._registrations.buffers
        assert len(buffers) == _nixl_registrations.REGISTERED_BUFFERS
        assert {registration.registration_id for registration, _ in buffers.values()} <= registered
    assert not registered


async def test_a_lookup_into_buffers_cancelled_while_its_read_waits_its_turn_returns_at_once_and_never_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A READ into `into=` buffers queued behind another that does not end: cancelling its
    call returns at once (not after the transfer timeout), and the READ never starts, so the
    buffers stay as they were; its item goes back to the producer."""
    wedge = Wedge(monkeypatch)
    first, second = torch.arange(16), torch.arange(100, 116)
    key, value, hidden = make_kv(first)
    staging = kvrt.KVBuffers(key=torch.full_like(key, 3.0).flatten(), value=torch.zeros_like(value).flatten())
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        for tokens in (first, second):
            await producer.insert(tokens, None, key, value, hidden)
        await consumer.link_for_tests().joining.joined()
        wedge.on = True
        stuck = asyncio.create_task(consumer.drop_select(first, timeout=5))
        await asyncio.sleep(0.2)
        queued = asyncio.create_task(consumer.drop_select(second, into=staging, timeout=5))
        await asyncio.sleep(0.2)
        started = loop_time()
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(queued, 5)
        assert loop_time() - started < 0.5
        wedge.on = False  # the READ ahead ends (failed: the wedge never posted it), its item goes back
        with pytest.raises(kvrt.PeerLostError):
            await asyncio.wait_for(stuck, 10)
        await asyncio.sleep(0.2)  # the waiter reaches the cancelled READ's turn, and skips it
        assert bool((staging.key == 3.0).all())
        for tokens in (second, first):
            item = await asyncio.wait_for(consumer.drop_select(tokens, timeout=5), 10)
            assert item is not None and torch.equal(item.key, key)


def loop_time() -> float:
    return asyncio.get_running_loop().time()


async def test_a_read_nixl_will_not_cancel_is_waited_for_before_the_cancelled_call_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NIXL may refuse to cancel a READ in flight (it then keeps writing): a lookup into
    `into=` buffers cancelled then returns only once that READ ended, never while it could
    still write the buffers."""
    wedge = Wedge(monkeypatch)
    wedge.refuse = True
    loop = asyncio.get_running_loop()

    def unwedge_soon() -> None:  # once the cancel was refused: the READ then ends 0.5 s on
        loop.call_later(0.5, setattr, wedge, "on", False)

    tokens = torch.arange(16)
    key, value, hidden = make_kv(tokens)
    staging = kvrt.KVBuffers(key=torch.zeros_like(key).flatten(), value=torch.zeros_like(value).flatten())
    async with (
        kvrt.Producer(transport="nixl") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="nixl") as consumer,
    ):
        await producer.insert(tokens, None, key, value, hidden)
        await consumer.link_for_tests().joining.joined()
        wedge.on = True
        lookup = asyncio.create_task(consumer.drop_select(tokens, into=staging, timeout=5))
        await asyncio.wait_for(wedge.posted.wait(), 10)
        started = loop_time()
        lookup.cancel()
        await asyncio.wait_for(wedge.released.wait(), 5)  # the cancel NIXL refused
        unwedge_soon()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(lookup, 5)
        assert not wedge.on and loop_time() - started >= 0.4
