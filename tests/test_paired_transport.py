"""The paired (process-group) transport, run on CPU with gloo: the machinery NCCL uses on GPUs."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import pytest
import torch

import kvrt
import kvrt.transports
from kvrt import _messages as m
from kvrt.transports import Post, Transfer
from tests._checks import DeafLink, caught_up
from tests.conftest import give_up_when_its_reply_comes, make_kv


async def test_items_move_over_a_pair_built_on_demand_and_arrive_equal() -> None:
    async with kvrt.Producer(transport="gloo") as producer:
        tokens = torch.arange(12)
        key, value, hidden = make_kv(tokens, dtype=torch.bfloat16)
        await producer.insert(tokens, None, key, value, hidden)
        async with kvrt.Consumer(connect=producer.endpoint, transport="gloo") as consumer:
            item = await consumer.drop_select(tokens[:5])
            assert item is not None and item.matched == 5
            assert torch.equal(item.key, key) and torch.equal(item.value, value) and torch.equal(item.hidden, hidden)  # type: ignore[arg-type]


async def test_many_items_in_flight_arrive_in_the_right_calls() -> None:
    async with (
        kvrt.Producer(transport="gloo") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="gloo") as consumer,
    ):
        for index in range(32):
            await producer.insert(torch.tensor([index, 7]), None, *make_kv(torch.tensor([index, 7]), seed=index))
        items = await asyncio.gather(*(consumer.drop_select(torch.tensor([index, 7])) for index in range(32)))
        for index, item in enumerate(items):
            assert item is not None and torch.equal(item.key, make_kv(item.input_tokens, seed=index)[0])


async def test_a_producer_serves_several_consumers_each_with_its_own_pair() -> None:
    async with kvrt.Producer(transport="gloo") as producer:
        consumers = [await kvrt.Consumer(connect=producer.endpoint, transport="gloo").start() for _ in range(3)]
        try:
            for index in range(3):
                await producer.insert(torch.tensor([index]), None, *make_kv(torch.tensor([index]), seed=index))
            for index, consumer in enumerate(consumers):
                item = await consumer.drop_select(torch.tensor([index]))
                assert item is not None and torch.equal(item.key, make_kv(torch.tensor([index]), seed=index)[0])
            assert len(producer._transports["gloo"]._pairs) == 3  # type: ignore[attr-defined]
        finally:
            for consumer in consumers:
                await consumer.aclose()


async def test_a_consumer_that_leaves_has_its_pair_released_and_a_new_one_gets_a_fresh_pair() -> None:
    async with kvrt.Producer(transport="gloo") as producer:
        pairs = producer._transports["gloo"]._pairs  # type: ignore[attr-defined]
        async with kvrt.Consumer(connect=producer.endpoint, transport="gloo") as consumer:
            await producer.insert(torch.arange(3), None, *make_kv(torch.arange(3)))
            assert await consumer.drop_select(torch.arange(3)) is not None
            (first_pair,) = [pair.pair_id for pair in pairs.values()]
        async with kvrt.Consumer(connect=producer.endpoint, transport="gloo") as consumer:
            await producer.insert(torch.arange(3), None, *make_kv(torch.arange(3)))
            assert await consumer.drop_select(torch.arange(3)) is not None
            assert [pair.pair_id for pair in pairs.values()] == [pair.pair_id for pair in pairs.values()]
            assert first_pair not in [pair.pair_id for pair in pairs.values()]
            assert len(pairs) == 1  # the first consumer's pair was released when it said bye


async def test_a_consumer_offering_only_tcp_gets_tcp_from_a_producer_that_prefers_a_pair() -> None:
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint, transport="tcp") as consumer:
        await producer.insert(torch.arange(3), None, *make_kv(torch.arange(3)))
        assert await consumer.drop_select(torch.arange(3)) is not None


async def test_no_common_transport_fails_the_connect_with_a_clear_error() -> None:
    async with kvrt.Producer(transport="gloo") as producer:
        with pytest.raises(kvrt.KVRTError, match="no common transport"):
            await kvrt.Consumer(connect=producer.endpoint, transport="tcp", connect_timeout_s=5).start()


def test_transport_names_are_checked_against_the_device() -> None:
    with pytest.raises(kvrt.InvalidInputError, match="transport must be one of"):
        kvrt.Producer(transport="carrier-pigeon")
    with pytest.raises(kvrt.InvalidInputError, match="needs a CUDA device"):
        kvrt.Consumer(connect="tcp://127.0.0.1:1", transport="nccl")
    with pytest.raises(kvrt.InvalidInputError, match=r"cuda_ipc.*cannot run here.*GPU tensors"):
        kvrt.Producer(transport="cuda_ipc")
    assert kvrt.Consumer(connect="tcp://127.0.0.1:1")._transport_names == ("tcp",)  # a CPU consumer


async def test_a_deliver_that_crosses_a_cancel_is_still_received_so_the_next_item_arrives_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The producer has sent the bytes by the time the consumer reads a Deliver it no longer
    waits for: the consumer must still take them off the pair (then give the item back), or
    its next receive would match the stray send and get another item's bytes."""
    async with (
        kvrt.Producer(transport="gloo") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="gloo") as consumer,
    ):
        first, second = torch.tensor([1, 7]), torch.tensor([2, 7])
        waiting = asyncio.create_task(consumer.drop_select(first, timeout=None))
        # A miss answered on the same link: the producer holds the waiting request now.
        await caught_up(consumer)
        give_up_when_its_reply_comes(monkeypatch, consumer, waiting, m.Deliver)
        await producer.insert(first, None, *make_kv(first, seed=1))
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await producer.insert(second, None, *make_kv(second, seed=2))
        item = await consumer.drop_select(second, timeout=10)
        assert item is not None and torch.equal(item.key, make_kv(second, seed=2)[0])
        given_back = await consumer.drop_select(first, timeout=10)  # the crossed item was given back
        assert given_back is not None and torch.equal(given_back.key, make_kv(first, seed=1)[0])


async def test_a_deliver_the_consumer_refuses_fails_its_call_and_the_pair_starts_afresh_losing_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Deliver whose metas do not fit its payload (a broken producer) is refused with a typed
    error; its bytes were sent all the same, so the pair is out of step: the link says hello
    again, the producer takes back what it had sent and pairs anew, and the items arrive intact."""
    from kvrt._protocol import outgoing

    deliver_message = outgoing.deliver_message
    lies: list[int] = []

    def lying_once(request_id: int, item: Any, matched: int) -> m.Deliver:
        deliver = deliver_message(request_id, item, matched)
        if lies:
            return deliver
        lies.append(item.item_id)
        beyond = m.TensorMeta(deliver.key.dtype, deliver.key.shape, deliver.payload_bytes)
        return msgspec.structs.replace(deliver, key=beyond)

    monkeypatch.setattr(outgoing, "deliver_message", lying_once)
    async with (
        kvrt.Producer(transport="gloo") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="gloo", heartbeat_s=0.2) as consumer,
    ):
        first, second = torch.tensor([1, 7]), torch.tensor([2, 7])
        await producer.insert(first, None, *make_kv(first, seed=1))
        await producer.insert(second, None, *make_kv(second, seed=2))
        with pytest.raises(kvrt.RemoteProtocolError, match=r"needs \d+ bytes"):
            await consumer.drop_select(first)
        link = consumer.link_for_tests()
        await asyncio.wait_for(link.connected.wait(), 10)  # welcomed again, on a new pair
        for tokens, seed in ((second, 2), (first, 1)):  # the refused item is back in the buffer
            item = await consumer.drop_select(tokens, timeout=10)
            assert item is not None and torch.equal(item.key, make_kv(tokens, seed=seed)[0])


async def test_bytes_that_never_come_fail_their_call_in_time_and_a_new_session_delivers_the_item() -> None:
    """A producer that answers heartbeats but never sends an item's bytes (on a GPU: its
    stream hangs) would hold the call for ever: past `transfer_timeout_s` the call fails with
    a typed timeout, the link starts a new session, and the item, back in the buffer, arrives
    intact over the new pair."""
    async with (
        kvrt.Producer(transport="gloo") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="gloo", transfer_timeout_s=0.5) as consumer,
    ):
        tokens = torch.arange(5)
        await producer.insert(tokens, None, *make_kv(tokens, seed=3))
        transport = producer._transports["gloo"]  # type: ignore[attr-defined]
        send = transport.send
        withheld: list[int] = []

        async def withholding_once(peer: bytes, transfer: Transfer, post: Post) -> None:
            if withheld:
                return await send(peer, transfer, post)
            withheld.append(transfer.items[0].item_id)
            post([])  # the header alone: its bytes never come

        transport.send = withholding_once
        link = consumer.link_for_tests()
        started = asyncio.get_running_loop().time()
        with pytest.raises(kvrt.KVRTTimeoutError, match="did not finish a transfer") as raised:
            await consumer.drop_select(tokens)
        assert raised.value.phase == "transfer" and withheld
        assert asyncio.get_running_loop().time() - started < 5.0
        await asyncio.wait_for(link.connected.wait(), 10)  # welcomed again, on a new pair
        item = await consumer.drop_select(tokens, timeout=10)
        assert item is not None and torch.equal(item.key, make_kv(tokens, seed=3)[0])
        await caught_up(consumer)  # the receipt went before it
        assert producer.stats().totals.delivered_items == 1


async def test_a_link_that_went_silent_says_hello_again_and_its_new_pair_carries_items() -> None:
    """The producer still knows the consumer when its second hello comes: the old session's
    pair is released, and the pair offered in the new welcome is the one that stays."""
    async with (
        kvrt.Producer(transport="gloo") as producer,
        kvrt.Consumer(connect=producer.endpoint, transport="gloo", heartbeat_s=0.05) as consumer,
    ):
        await producer.insert(torch.arange(3), None, *make_kv(torch.arange(3)))
        assert await consumer.drop_select(torch.arange(3)) is not None
        link = consumer.link_for_tests()
        deafened = DeafLink(link)
        await asyncio.wait_for(deafened.lost.wait(), 10)  # nothing heard for its timeout
        deafened.deaf = False
        await asyncio.wait_for(link.connected.wait(), 10)  # welcomed again (same identity)
        assert producer.stats().peers == 1
        await producer.insert(torch.arange(3), None, *make_kv(torch.arange(3), seed=5))
        item = await asyncio.wait_for(consumer.drop_select(torch.arange(3), timeout=10), 20)
        assert item is not None and torch.equal(item.key, make_kv(torch.arange(3), seed=5)[0])


async def cannot_join(self: Any, rendezvous: dict[str, str], timeout_s: float) -> None:
    raise kvrt.TransportUnavailableError("gloo: cannot work between these two (simulated)")


def offering(service: Any, names: tuple[str, ...]) -> Any:
    """`service` (not started) offering `names`, preferred first, as an auto choice on a GPU
    offers cuda_ipc, then nccl, then tcp."""
    service._transport_names = names
    if isinstance(service, kvrt.Producer):
        service._core.transports = names
    return service


async def test_a_transport_that_cannot_work_between_the_pair_gives_way_to_the_next_offered_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kvrt.transports.PairedReceiver, "join", cannot_join)
    tokens = torch.arange(12)
    key, value, hidden = make_kv(tokens)
    async with offering(kvrt.Producer(), ("gloo", "tcp")) as producer:
        await producer.insert(tokens, None, key, value, hidden)
        with caplog.at_level(logging.WARNING, logger="kvrt"):
            async with offering(kvrt.Consumer(connect=producer.endpoint), ("gloo", "tcp")) as consumer:
                assert consumer.transports == {producer.endpoint: "tcp"}
                item = await consumer.drop_select(tokens)
                assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)
                assert producer.stats().transports == {"tcp": 1}
    said = [record.getMessage() for record in caplog.records]
    assert any("simulated" in text and "over tcp instead" in text for text in said), said


async def test_a_transport_that_cannot_work_and_has_no_next_fails_the_start_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvrt.transports.PairedReceiver, "join", cannot_join)
    async with offering(kvrt.Producer(), ("gloo", "tcp")) as producer:
        with pytest.raises(kvrt.PeerLostError, match="simulated"):
            async with offering(kvrt.Consumer(connect=producer.endpoint, connect_timeout_s=5), ("gloo",)):
                pass


async def test_pairs_whose_consumers_never_join_hold_up_neither_other_pairs_nor_the_process_exit() -> None:
    """A producer offers a pair at each welcome; a consumer that never joins it (it fell back
    to another transport, or died) leaves that pair's set-up waiting for the store's timeout.
    Such set-ups wait on threads of their own: a consumer that does join pairs at once, and
    none of those threads holds the interpreter's exit."""
    import threading

    from transports.paired import PairedReceiver, PairedSender

    sender = PairedSender("gloo", torch.device("cpu"))
    receiver = PairedReceiver("gloo", torch.device("cpu"))
    try:
        for index in range(6):  # more than any fixed pool of set-up threads
            sender.offer(f"never-joins-{index}".encode())
        rendezvous = sender.offer(b"joins")
        await receiver.join(rendezvous, timeout_s=10.0)  # well inside the store's 60 s
        stuck = [thread for thread in threading.enumerate() if thread.name.startswith("kvrt-pair")]
        assert len(stuck) >= 6 and all(thread.daemon for thread in stuck)
    finally:
        await receiver.aclose()
        await sender.aclose()
