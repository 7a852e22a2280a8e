"""Faults: dead peers, restarts, oversized messages, expiring items. Nothing hangs, nothing is lost."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import weakref

import pytest
import torch
import zmq
import zmq.asyncio

import kvrt
from kvrt import _messages as m
from tests._gpu_processes import run_gpu_consumer_that_dies
from tests.conftest import insert_tokens

spawn = multiprocessing.get_context("spawn")


async def test_a_consumer_killed_mid_transfer_gives_its_item_back_and_memory_returns() -> None:
    heartbeat_s = 0.2
    async with kvrt.Producer(heartbeat_s=heartbeat_s) as producer:
        tokens = torch.arange(64)
        await producer.insert(tokens, None, torch.randn(4, 64, 8, 64), torch.randn(4, 64, 8, 64), None)
        before = producer.stats().buffer_bytes
        control, child = spawn.Pipe()
        process = spawn.Process(
            target=run_gpu_consumer_that_dies,
            args=(producer.endpoint, "cpu", heartbeat_s, tokens[:8].tolist(), child),
            daemon=True,
        )
        await asyncio.to_thread(process.start)
        assert await asyncio.to_thread(control.poll, 60) and control.recv() == "asked"
        assert await asyncio.to_thread(control.poll, 60) and control.recv() == "arrived"
        assert producer.stats().in_flight == 1
        producer._serving.peer_left.clear()
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        await asyncio.to_thread(process.join)
        await asyncio.wait_for(producer._serving.peer_left.wait(), 4 * heartbeat_s + 2.0)
        stats = producer.stats()
        assert (stats.items, stats.in_flight, stats.peers) == (1, 0, 0)
        assert stats.buffer_bytes == before and stats.totals.returned_items == 1
        async with kvrt.Consumer(connect=producer.endpoint) as consumer:  # a new consumer gets it, once
            assert await consumer.drop_select(tokens[:8]) is not None
            assert await consumer.drop_select(tokens[:8]) is None


async def test_a_restarted_producer_at_the_same_address_is_reconnected_to() -> None:
    heartbeat_s = 0.1
    first = await kvrt.Producer(heartbeat_s=heartbeat_s).start()
    endpoint = first.endpoint
    async with kvrt.Consumer(connect=endpoint, heartbeat_s=heartbeat_s) as consumer:
        link = consumer.link_for_tests()
        await insert_tokens(first, torch.arange(3))
        assert await consumer.drop_select(torch.arange(3)) is not None
        await first.aclose()
        with pytest.raises(kvrt.PeerLostError):  # at once, or when the link reads the producer's bye
            await consumer.drop_select(torch.arange(3))
        assert not link.connected.is_set()
        async with kvrt.Producer(bind=endpoint, heartbeat_s=heartbeat_s) as second:
            await asyncio.wait_for(link.connected.wait(), 5)  # the link said hello again by itself
            await insert_tokens(second, torch.arange(3))
            assert await consumer.drop_select(torch.arange(3)) is not None


async def test_a_message_over_the_hard_limit_is_dropped_unread_and_others_are_still_served(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(producer.endpoint)
        await socket.send(b"\x00" * (m.MAX_INBOUND_MESSAGE_BYTES + 1))
        assert await socket.poll(500) == 0  # no reply: libzmq refused it before allocating it
    finally:
        socket.close()
        context.term()
    await insert_tokens(producer, torch.arange(5))
    assert await consumer.drop_select(torch.arange(5)) is not None


async def test_an_item_nobody_takes_expires_after_its_time_to_live_and_is_counted() -> None:
    async with kvrt.Producer(item_ttl_s=0.2) as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        await insert_tokens(producer, torch.arange(4))
        # A waiting lookup that ends after the TTL is the clock: the producer's timers run in order.
        assert await consumer.drop_select(torch.tensor([-1]), None, timeout=0.4) is None
        stats = producer.stats()
        assert (stats.items, stats.buffer_bytes, stats.totals.expired_items) == (0, 0, 1)
        assert await consumer.drop_select(torch.arange(4)) is None


async def test_an_item_taken_well_within_its_time_to_live_holds_none_of_the_producers_memory() -> None:
    # A served prefill publishes a request's KV every few milliseconds with a time to live of
    # minutes: the bytes of each item a decode took must go with the take, not with the TTL.
    async with kvrt.Producer(item_ttl_s=600) as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        tokens = torch.arange(64)
        await producer.insert(tokens, None, torch.randn(2, 64, 2, 8), torch.randn(2, 64, 2, 8), None)
        (item_bytes,) = producer._bytes._bytes.values()
        storage = weakref.ref(item_bytes.storage)
        del item_bytes
        assert await consumer.drop_select(tokens) is not None
        # Served in order after the take's confirmation: the producer has retired the item.
        assert await consumer.drop_select(torch.tensor([-1]), None) is None
        assert (producer.stats().items, producer.stats().in_flight) == (0, 0)
        gc.collect()
        assert storage() is None


def test_a_time_to_live_must_be_positive() -> None:
    with pytest.raises(kvrt.InvalidInputError, match="item_ttl_s"):
        kvrt.Producer(item_ttl_s=0)


async def test_an_unexpected_error_handling_a_reply_fails_its_call_and_a_new_session_loses_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvrt.transports.tcp import TcpReceiver

    def broken(*_: object) -> None:
        raise RuntimeError("a bug in the transport")

    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        with monkeypatch.context() as patch:
            patch.setattr(TcpReceiver, "receive", broken)
            waiting = asyncio.create_task(consumer.drop_select(torch.arange(4), None, timeout=None))
            await insert_tokens(producer, torch.arange(4))
            with pytest.raises(kvrt.KVRTError, match="RuntimeError: a bug in the transport"):
                async with asyncio.timeout(10):
                    await waiting
        async with asyncio.timeout(10):  # the new session gets the item the old one was sent
            while not consumer.link_for_tests().connected.is_set():
                await consumer.link_for_tests().connected.wait()
            item = await consumer.drop_select(torch.arange(4), None, timeout=5.0)
        assert item is not None and producer.stats().totals.returned_items == 1
