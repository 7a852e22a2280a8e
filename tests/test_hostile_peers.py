"""A serving core no peer, stall or load can break: each test is one way a peer (or the host)
misbehaves, with real processes and sockets where the fault crosses them, and stalls made
with SIGSTOP/SIGCONT."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

import kvrt
from kvrt import _messages as m
from kvrt._protocol import HEARTBEAT_MISSES, SILENT_HOLD_LEASES, PeerState, ProducerCore
from kvrt._protocol.waiting import MAX_WAITING_PER_PEER, MAX_WAITING_QUERY_BYTES_PER_PEER
from kvrt._zmqio import RouterOutboxes
from tests._checks import collected, damage_the_first, read_as_published, reads_whole_again, unreadable
from tests._processes import (
    child_process,
    run_busy_producer,
    run_consumer_stopping_before_its_receipt,
    run_non_reader,
    run_producer,
    run_waiting_consumer,
)

HEARTBEAT_S = 0.1
LEASE_S = HEARTBEAT_S * HEARTBEAT_MISSES


def _stop(process: object) -> None:
    pid = getattr(process, "pid", None)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)


def _resume(process: object) -> None:
    pid = getattr(process, "pid", None)
    assert pid is not None
    os.kill(pid, signal.SIGCONT)


# -- 1. frames that do not decode --------------------------------------------------------------


DEEP_FRAME = b"\x92\x01" + b"\x91" * 1000 + b"\xc0"
"""1003 bytes of nested arrays: deeper than the decoder goes."""


async def _raw_reply(socket: zmq.asyncio.Socket) -> m.Message:
    async with asyncio.timeout(5):
        return m.decode((await socket.recv_multipart())[0])


@pytest.mark.parametrize("said_hello", [False, True], ids=["stranger", "after-hello"])
async def test_a_deeply_nested_frame_is_refused_alone_and_the_producer_keeps_every_item(said_hello: bool) -> None:
    async with kvrt.Producer() as producer:
        await producer.insert(torch.arange(8), None, torch.ones(1, 8, 1, 4), torch.ones(1, 8, 1, 4))
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(producer.endpoint)
            if said_hello:
                await socket.send(m.encode(m.Hello(version=m.PROTOCOL_VERSION)))
                assert isinstance(await _raw_reply(socket), m.Welcome)
            for frame in (DEEP_FRAME, b"\x92\x01\x83\xa4type\xabdrop_select\xaarequest_id\x07\xa6tokens" + DEEP_FRAME):
                await socket.send(frame)
                reply = await _raw_reply(socket)
                assert isinstance(reply, m.ErrorReply) and reply.code is kvrt.ErrorCode.PROTOCOL
                assert "nests deeper" in reply.message
        finally:
            socket.close()
            context.term()
        assert producer.refusals()["protocol"] == 2
        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            item = await consumer.drop_select(torch.arange(8))
            assert item is not None and torch.equal(item.key, torch.ones(1, 8, 1, 4))


async def test_a_deeply_nested_frame_from_the_producer_is_dropped_and_the_link_keeps_working() -> None:
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:

        async def fake_producer() -> None:
            while True:
                peer, frame = await router.recv_multipart()
                message = m.decode(frame)
                if isinstance(message, m.Hello):
                    welcome = m.Welcome(version=m.PROTOCOL_VERSION, producer_id="fake", heartbeat_s=1.0, lease_s=10.0)
                    await router.send_multipart([peer, m.encode(welcome)])
                elif isinstance(message, m.DropSelect):
                    await router.send_multipart([peer, DEEP_FRAME])  # garbage first, then the answer
                    await router.send_multipart([peer, m.encode(m.Miss(request_id=message.request_id))])

        serving = asyncio.create_task(fake_producer())
        try:
            async with kvrt.Consumer(connect=f"tcp://127.0.0.1:{port}") as consumer:
                assert await consumer.drop_select(torch.arange(4)) is None
                assert await consumer.drop_select(torch.arange(4)) is None
                assert consumer.link_for_tests().rejected_frames == 2
        finally:
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
    finally:
        router.close()
        context.term()


async def test_a_delivery_that_could_not_be_read_comes_back_once_its_call_times_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A delivery's header damaged on the way (it no longer decodes) is dropped, so its call
    times out; the producer still counts the item as this link's. The timeout then starts a
    new session, in which the producer takes the item back: the link's next lookup, or another
    consumer's, gets it, once."""
    tokens, key = torch.arange(8), torch.ones(1, 8, 1, 4)
    async with kvrt.Producer(heartbeat_s=HEARTBEAT_S) as producer:
        await producer.insert(tokens, None, key, key)
        async with kvrt.Consumer(connect=producer.endpoint, reply_timeout_s=0.5) as consumer:
            damaged = damage_the_first(
                monkeypatch, lambda message: unreadable(message) if isinstance(message, m.Deliver) else None
            )
            with pytest.raises(kvrt.KVRTTimeoutError):
                await consumer.drop_select(tokens)
            assert damaged and consumer.link_for_tests().rejected_frames == 1
            await asyncio.wait_for(consumer.link_for_tests().connected.wait(), 10)  # its new session
            item = await consumer.drop_select(tokens)
            assert item is not None and torch.equal(item.key, key)
        async with kvrt.Consumer(connect=producer.endpoint) as another:
            assert await another.drop_select(tokens) is None  # delivered once


@pytest.mark.parametrize("call", ["drop_select", "open_stream"])
async def test_a_reply_that_could_not_be_read_to_a_call_with_no_timeout_fails_it_and_the_item_comes_back(
    monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """A call that waits with no timeout has no reply timeout either: a damaged answer to it
    starts a new session at once (else it would wait for ever, the item kept for it)."""
    tokens, key = torch.arange(8), torch.ones(2, 8, 1, 4)
    async with kvrt.Producer(heartbeat_s=HEARTBEAT_S) as producer:
        writer = await producer.open_stream(tokens, layers=2) if call == "open_stream" else None
        if writer is None:
            await producer.insert(tokens, None, key, key)
        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            answers = (m.Deliver, m.StreamStart)
            damaged = damage_the_first(
                monkeypatch, lambda message: unreadable(message) if isinstance(message, answers) else None
            )
            take = consumer.open_stream if call == "open_stream" else consumer.drop_select
            with pytest.raises(kvrt.RemoteProtocolError, match="new session"):
                await asyncio.wait_for(take(tokens, timeout=None), 10)
            assert damaged
            await asyncio.wait_for(consumer.link_for_tests().connected.wait(), 10)  # its new session
            taken = await asyncio.wait_for(take(tokens, timeout=None), 10)
            assert taken is not None
            if writer is not None:
                assert isinstance(taken, kvrt.ConsumerStream)
                for layer in range(2):
                    await writer.put_layer(key[layer], key[layer])
                await writer.finish()
                assert len([layer async for layer in taken]) == 2
        async with kvrt.Consumer(connect=producer.endpoint) as another:
            assert await another.drop_select(tokens) is None  # delivered once


@pytest.mark.parametrize("unread", [m.StreamLayer, m.StreamEnd], ids=["a layer", "the end"])
async def test_a_stream_message_that_could_not_be_read_fails_its_reader_at_once_and_the_stream_comes_back(
    monkeypatch: pytest.MonkeyPatch, unread: type
) -> None:
    """A stream's reader waits for its end with no timeout: a stream message damaged past
    reading (it names no request) starts a new session at once, in which the producer takes
    the stream back; the reader fails instead of waiting for ever, and reads it again whole."""
    tokens, key, value = torch.arange(16), torch.randn(3, 16, 2, 8), torch.randn(3, 16, 2, 8)
    async with kvrt.Producer(heartbeat_s=HEARTBEAT_S) as producer:
        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            damaged = damage_the_first(
                monkeypatch, lambda message: unreadable(message) if isinstance(message, unread) else None
            )
            reader = await read_as_published(producer, consumer, tokens, key, value)
            with pytest.raises(kvrt.RemoteProtocolError, match="new session"):
                await asyncio.wait_for(reader.finished(), 10)
            assert damaged
            await asyncio.wait_for(consumer.link_for_tests().connected.wait(), 10)  # its new session
            await reads_whole_again(consumer, tokens, key, value)
        async with kvrt.Consumer(connect=producer.endpoint) as another:
            assert await another.drop_select(tokens) is None  # delivered once


async def test_a_layer_that_comes_twice_fails_the_stream_and_it_comes_back_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second copy of a layer (a peer's bug, a replayed message) is refused, never taken in
    place of the first: the reader may hold the first already, and with a GPU producer's
    checksums in its end, the second copy's checksum would stand for what the reader has."""
    from kvrt._consumer._stream_layers import StreamLayers

    on_streamed, repeated = StreamLayers.on_streamed, []

    def layer_one_twice(self: StreamLayers, message: m.AnyMessage, payload: Any) -> None:
        if isinstance(message, m.StreamLayer) and message.layer == 1 and not repeated:
            repeated.append(message)
            on_streamed(self, message, [zmq.Frame(bytes(frame.buffer)) for frame in payload])
        on_streamed(self, message, payload)

    monkeypatch.setattr(StreamLayers, "on_streamed", layer_one_twice)
    tokens, key, value = torch.arange(16), torch.randn(3, 16, 2, 8), torch.randn(3, 16, 2, 8)
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        reader = await read_as_published(producer, consumer, tokens, key, value)
        with pytest.raises(kvrt.RemoteProtocolError, match="layer 1 of the stream came twice"):
            await reader.finished()
        assert repeated
        await reads_whole_again(consumer, tokens, key, value)


async def test_a_stream_whose_layer_went_astray_is_given_back_whole_not_confirmed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layer message whose stream id was damaged on the way reaches no stream: at the end
    the reader fails, and the stream goes back whole instead of being confirmed (the producer
    would free it), so it can be read again."""

    def layer_zero_misdirected(message: m.AnyMessage) -> m.AnyMessage | None:
        if not isinstance(message, m.StreamLayer):
            return None
        return msgspec.structs.replace(message, item_id=message.item_id + 1000)

    tokens, key, value = torch.arange(16), torch.randn(3, 16, 2, 8), torch.randn(3, 16, 2, 8)
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        damaged = damage_the_first(monkeypatch, layer_zero_misdirected)
        reader = await read_as_published(producer, consumer, tokens, key, value)
        with pytest.raises(kvrt.RemoteProtocolError, match="without layer 0"):
            await reader.finished()
        assert damaged
        await reads_whole_again(consumer, tokens, key, value)


# -- 2. exactly once across a stall -----------------------------------------------------------


@pytest.mark.parametrize("size", [4 << 10, 256 << 10], ids=["4KiB", "256KiB"])
@pytest.mark.parametrize("then", ["taken-by-another", "evicted"])
async def test_a_consumer_stalled_past_its_lease_never_hands_over_what_was_sent_to_it(size: int, then: str) -> None:
    tokens = torch.arange(16)
    key = torch.randn(1, 16, 1, size // 2 // 16 // 4)
    async with kvrt.Producer(heartbeat_s=HEARTBEAT_S) as producer:
        args = (producer.endpoint, HEARTBEAT_S, tokens.tolist())
        async with child_process(run_waiting_consumer, args, "a waiting consumer") as (asked, stalled, control):
            assert asked == "asked" and producer.stats().waiting_requests == 1
            # Its loop is held while the item reaches its process (libzmq's thread queues it),
            # then the whole process stops: when it wakes, the item is the first thing it reads.
            control.send(("hold", 0.5))
            assert await asyncio.to_thread(control.recv) == "holding"
            producer._serving.peer_left.clear()
            await producer.insert(tokens, None, key, key)
            assert producer.stats().in_flight == 1  # sent to the consumer whose loop is held
            _stop(stalled)  # and now stopped for longer than its lease (a GC pause, SIGSTOP)
            try:
                # Its lease ends, its connection is still up: the item comes back once the
                # producer stops holding it for a stopped process.
                async with asyncio.timeout(LEASE_S * SILENT_HOLD_LEASES + 5):
                    await producer._serving.peer_left.wait()
                assert producer.stats().items == 1
                if then == "taken-by-another":
                    async with kvrt.Consumer(connect=producer.endpoint) as other:
                        item = await other.drop_select(tokens)
                        assert item is not None and torch.equal(item.key, key)
                else:
                    async with kvrt.Client(producer.endpoint) as client:
                        (listed,) = (await client.list_items()).items
                        await client.evict(listed.item_id)
                assert producer.stats().items == 0
            finally:
                _resume(stalled)
            outcome = await asyncio.to_thread(control.recv)
            assert outcome[0] == "error" and outcome[1] in ("LeaseExpiredError", "PeerLostError"), outcome
        stats = producer.stats()
        assert stats.totals.delivered_items == (1 if then == "taken-by-another" else 0)
        assert (stats.items, stats.in_flight) == (0, 0)


async def test_a_consumer_stopped_between_its_hand_over_and_its_receipt_keeps_the_item_no_one_else_gets_it() -> None:
    # The hand-over happened inside the lease; the receipt had not left the process when it
    # stopped (SIGSTOP stops libzmq's threads too). Its connection is still up, so the
    # producer keeps the item for it instead of giving it to the next consumer.
    tokens = torch.arange(16)
    key = torch.randn(1, 16, 1, 64)
    async with kvrt.Producer(heartbeat_s=HEARTBEAT_S) as producer:
        args = (producer.endpoint, HEARTBEAT_S, tokens.tolist())
        async with child_process(run_consumer_stopping_before_its_receipt, args, "a consumer") as (
            asked, stopping, control,
        ):  # fmt: skip
            assert asked == "asked" and producer.stats().waiting_requests == 1 and stopping.pid is not None
            await producer.insert(tokens, None, key, key)
            _, status = await asyncio.wait_for(asyncio.to_thread(os.waitpid, stopping.pid, os.WUNTRACED), 30)
            assert os.WIFSTOPPED(status)  # it stopped itself having handed the item over
            try:
                await asyncio.sleep(2.5 * LEASE_S)  # its lease ended long ago
                async with kvrt.Consumer(connect=producer.endpoint, heartbeat_s=HEARTBEAT_S) as other:
                    assert await other.drop_select(tokens, timeout=LEASE_S) is None
                assert producer.stats().in_flight == 1
            finally:
                os.kill(stopping.pid, signal.SIGCONT)
            outcome = await asyncio.wait_for(asyncio.to_thread(control.recv), 30)
            assert outcome == ("item", float(key.sum())), outcome  # and the producer read its receipt
        stats = producer.stats()
        assert (stats.items, stats.in_flight, stats.totals.delivered_items) == (0, 0, 1)


async def test_a_killed_consumer_s_items_come_back_when_its_lease_ends_not_after_the_hold() -> None:
    tokens = torch.arange(16)
    key = torch.randn(1, 16, 1, 64)
    async with kvrt.Producer(heartbeat_s=HEARTBEAT_S) as producer:
        args = (producer.endpoint, HEARTBEAT_S, tokens.tolist())
        async with child_process(run_waiting_consumer, args, "a waiting consumer") as (asked, killed, control):
            assert asked == "asked" and killed.pid is not None
            control.send(("hold", 30.0))  # its loop never reads the item
            assert await asyncio.to_thread(control.recv) == "holding"
            producer._serving.peer_left.clear()
            await producer.insert(tokens, None, key, key)
            assert producer.stats().in_flight == 1
            os.kill(killed.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            async with asyncio.timeout(LEASE_S * SILENT_HOLD_LEASES):
                await producer._serving.peer_left.wait()
            assert time.monotonic() - killed_at < 2 * LEASE_S  # its connection closed: no hold
            assert producer.stats().items == 1


def test_a_silent_consumer_still_connected_keeps_its_items_for_the_hold_and_may_still_confirm_them() -> None:
    core = ProducerCore(producer_id="p", heartbeat_s=HEARTBEAT_S)
    from tests.test_protocol import make_item

    leases = {}
    for peer, tokens in ((b"up", [1, 2, 3]), (b"closed", [4, 5, 6]), (b"stopped", [7, 8, 9])):
        core.receive(peer, m.encode(m.Hello(version=m.PROTOCOL_VERSION)), 0, 0.0)
        core.insert(make_item(core, tokens), 0.0)
        (sent,) = core.receive(peer, m.encode(m.DropSelect(request_id=1, tokens=None)), 0, 0.0)
        assert isinstance(sent.message, m.Deliver)
        leases[peer] = (sent.message.item_id, sent.message.lease)

    def connected(peer: bytes) -> bool:
        return peer != b"closed"

    clock = [0.0]

    def run_until(until: float) -> None:  # the serve loop's ticks, a quarter heartbeat apart
        while clock[0] < until:
            clock[0] = min(until, clock[0] + HEARTBEAT_S / 4)
            core.expire(clock[0], connected)

    run_until(core.lease_s)  # all three silent for a lease: only the closed one's item is back
    assert (len(core.buffer), sum(len(h.items) for h in core.lifecycle.holdings.values())) == (1, 2)
    assert core.sessions.state(b"up") is PeerState.GONE  # served no more meanwhile
    item_id, lease = leases[b"up"]
    assert core.receive(b"up", m.encode(m.Received(item_ids=[item_id], leases=[lease])), 0, 2 * core.lease_s) == []
    assert core.counters.delivered_items == 1  # its receipt, late but inside the hold, counts
    run_until(core.lease_s * SILENT_HOLD_LEASES - HEARTBEAT_S / 2)
    assert len(core.buffer) == 1  # the stopped one still holds its item
    run_until(core.lease_s * SILENT_HOLD_LEASES)
    assert len(core.buffer) == 2 and core.sessions.state(b"stopped") is PeerState.UNKNOWN


def test_a_receipt_after_the_lease_ended_is_refused_and_the_item_stays_with_its_new_holder() -> None:
    core = ProducerCore(producer_id="p", heartbeat_s=HEARTBEAT_S)
    for peer in (b"a", b"b"):
        core.receive(peer, m.encode(m.Hello(version=m.PROTOCOL_VERSION)), 0, 0.0)
    from tests.test_protocol import make_item

    item = make_item(core, [1, 2, 3])
    core.insert(item, 0.0)
    (sent,) = core.receive(b"a", m.encode(m.DropSelect(request_id=1, tokens=None)), 0, 0.0)
    assert isinstance(sent.message, m.Deliver)
    first_lease = sent.message.lease
    core.receive(b"b", m.encode(m.Ping()), 0, core.lease_s)  # b stays; a said nothing since 0.0
    core.expire(core.lease_s)  # a's lease ended: the item is back
    (again,) = core.receive(b"b", m.encode(m.DropSelect(request_id=1, tokens=None)), 0, core.lease_s)
    assert isinstance(again.message, m.Deliver) and again.message.lease != first_lease
    late = core.receive(b"a", m.encode(m.Received(item_ids=[item.item_id], leases=[first_lease])), 0, core.lease_s)
    assert isinstance(late[0].message, m.ErrorReply)  # a is forgotten: it must say hello again
    core.receive(b"a", m.encode(m.Hello(version=m.PROTOCOL_VERSION)), 0, core.lease_s)
    stale = core.receive(b"a", m.encode(m.Received(item_ids=[item.item_id], leases=[first_lease])), 0, core.lease_s)
    assert isinstance(stale[0].message, m.ErrorReply) and stale[0].message.code is kvrt.ErrorCode.NOT_FOUND
    assert core.receive(b"b", m.encode(m.Received(item_ids=[item.item_id], leases=[again.message.lease])), 0, 1.0) == []
    assert core.counters.delivered_items == 1


def test_a_receipt_for_a_stream_before_its_end_is_refused_and_the_stream_goes_on_to_its_reader() -> None:
    # Confirmed before its end, an open stream left the producer's count while its prefill
    # kept publishing into it (the count grew for what was freed, then went below zero), and
    # its end handed the whole item out again to a reader that had said it was done.
    from tests._records import layer_meta, stream_record, whole_of

    core = ProducerCore(producer_id="p", heartbeat_s=HEARTBEAT_S)
    core.receive(b"a", m.encode(m.Hello(version=m.PROTOCOL_VERSION)), 0, 0.0)
    item = stream_record(core.new_item_id(), 0, [1, 2, 3], layers=2)
    core.open_stream(item, 0.0)
    asked = m.DropSelect(request_id=1, tokens=m.tokens_to_bytes(item.masked_tokens), stream=True)
    (start,) = core.receive(b"a", m.encode(asked), 0, 0.0)
    assert isinstance(start.message, m.StreamStart)
    early = m.Received(item_ids=[item.item_id], leases=[start.message.lease])
    (refused,) = core.receive(b"a", m.encode(early), 0, 0.0)
    assert isinstance(refused.message, m.ErrorReply) and refused.message.code is kvrt.ErrorCode.PROTOCOL
    layer = layer_meta(item, heads=2, head_dim=4, dtype="float32")
    for _ in range(2):  # as the producer's driver does: the core records it (the driver keeps its bytes)
        (sent,) = core.stream_layer(item, layer, layer)
        assert sent.peer == b"a" and isinstance(sent.message, m.StreamLayer)
    assert core.streams.nbytes == item.nbytes
    whole = whole_of(item, layer)
    (end,) = core.finish_stream(item, whole, 0.0)
    assert isinstance(end.message, m.StreamEnd) and core.streams.nbytes == 0
    assert core.receive(b"a", m.encode(early), 0, 0.0) == []  # after its end: confirmed, under the same lease
    assert (core.buffer.nbytes, core.buffer.held, core.counters.delivered_items) == (0, 0, 1)


@pytest.mark.parametrize("batched", [False, True], ids=["drop_select", "drop_select_many"])
async def test_a_delivery_read_after_the_lease_ended_is_given_back_without_reading_its_bytes(
    monkeypatch: pytest.MonkeyPatch, batched: bool
) -> None:
    # A consumer that wakes from a stall reads the deliveries queued meanwhile: by then the
    # producer may have given those items to others and reused their memory, which a GPU
    # transport would read from. So nothing is received for a delivery outside the lease.
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        await producer.insert(torch.arange(8), None, torch.ones(1, 8, 1, 4), torch.ones(1, 8, 1, 4))
        link = consumer.link_for_tests()
        transport = link.receiver
        core_receive = link.core.receive
        received: list[object] = []

        def stalled_until_the_lease_ended(frame: bytes, now: float) -> object:
            event = core_receive(frame, now)
            if isinstance(m.decode(frame), m.Deliver | m.DeliverMany):
                monkeypatch.setattr(link.session, "lease_holds", lambda: False)
            return event

        monkeypatch.setattr(link.core, "receive", stalled_until_the_lease_ended)
        for name in ("receive", "receive_many"):
            original = getattr(transport, name)
            monkeypatch.setattr(transport, name, lambda *args, _was=original: received.append(args) or _was(*args))
        lookup = consumer.drop_select_many([torch.arange(8)]) if batched else consumer.drop_select(torch.arange(8))
        with pytest.raises(kvrt.LeaseExpiredError):
            await lookup
        assert received == []
        monkeypatch.undo()
        item = await consumer.drop_select(torch.arange(8))
        assert item is not None and torch.equal(item.key, torch.ones(1, 8, 1, 4))


# -- 3. a peer that stops reading --------------------------------------------------------------


def non_reader(producer: kvrt.Producer) -> bytes | None:
    """The non-reader's identity while the producer serves it."""
    return next(
        (peer.identity for peer in producer._core.sessions.served() if peer.name == "non-reader"),
        None,
    )


class NonReaderReplies:
    """Watches `producer`'s replies: `answered` counts those posted to the non-reader (its
    hello's too); once `watch_outbox` was called, `formed` is set when one waits in an outbox
    (its peer's queue was full)."""

    def __init__(self, producer: kvrt.Producer, monkeypatch: pytest.MonkeyPatch) -> None:
        outboxes = producer._serving.outboxes
        assert outboxes is not None
        self.producer, self.formed, self.answered = producer, asyncio.Event(), 0
        self._watching, self._changed = False, asyncio.Event()
        post = RouterOutboxes.post

        def noting(outbox_set: RouterOutboxes, peer: bytes, frames: Any, now: float) -> Any:
            dropped = post(outbox_set, peer, frames, now)
            if outbox_set is outboxes:
                if self._watching and outboxes.next_retry() is not None:
                    self.formed.set()
                if peer == non_reader(producer):
                    self.answered += 1
                    self._changed.set()
            return dropped

        monkeypatch.setattr(RouterOutboxes, "post", noting)

    def watch_outbox(self) -> None:
        assert self.producer._serving.outboxes is not None
        self._watching = True
        if self.producer._serving.outboxes.next_retry() is not None:
            self.formed.set()

    async def wait_formed(self, within_s: float = 0.5) -> bool:
        """Whether replies wait in an outbox within `within_s` (the producer reads on meanwhile)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.formed.wait(), within_s)
        return self.formed.is_set()

    async def all_answered(self, requests: int) -> None:
        """Until the producer has answered `requests` of the non-reader's, or dropped it: what
        it was sent is read, so what it does next is only waiting for room."""
        async with asyncio.timeout(30):
            while self.answered < requests and non_reader(self.producer) is not None:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):  # (it may be dropped without a reply posted)
                    await asyncio.wait_for(self._changed.wait(), 0.1)


@pytest.mark.parametrize("requests", [15_000, 300_000], ids=["stalls", "floods"])
async def test_a_peer_that_stops_reading_is_dropped_and_nobody_else_waits_for_it(
    requests: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with kvrt.Producer(heartbeat_s=HEARTBEAT_S) as producer:
        assert producer._serving.outboxes is not None
        replies = NonReaderReplies(producer, monkeypatch)
        async with (
            kvrt.Consumer(connect=producer.endpoint) as consumer,
            child_process(run_non_reader, (producer.endpoint, requests), "a non-reader") as (sent, _, control),
        ):
            assert sent == requests
            latencies = []
            for index in range(200):
                await producer.insert(torch.tensor([index, 1]), None, torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2))
                started = time.monotonic()
                assert await consumer.drop_select(torch.tensor([index, 1])) is not None
                latencies.append(time.monotonic() - started)
            assert max(latencies) < 0.5, f"a call waited {max(latencies):.3f} s behind the non-reader"
            async with kvrt.Client(producer.endpoint) as newcomer:  # new peers still get in
                assert (await newcomer.health()).producer_id
            if requests < 100_000:  # its replies wait in its outbox: the producer waits for room idly
                # The sockets' buffers take a share of its replies that varies from run to run (the
                # kernel's grow with the connection, to megabytes): it sends more, fewer at a time
                # than an outbox holds, until some of its replies wait for room or it is gone.
                replies.watch_outbox()
                sent_in_all = sent
                for _ in range(20):
                    if non_reader(producer) is None or await replies.wait_formed():
                        break
                    control.send(("more", 2000))
                    sent_in_all += await asyncio.to_thread(control.recv)
                # The producer reads on behind what the sockets hold: the window below starts once
                # it answered all (a backlog read in the window is work, not a spin).
                await replies.all_answered(sent_in_all)
                # (it may be gone: its lease, 1 s after its last message, may have ended already on
                # a slow host, or its outbox stalled that long; with it went its outbox)
                present = non_reader(producer) is not None
                stuck = producer._serving.outboxes.next_retry() is not None
                # The CPU time of this thread, where the producer's loop runs (the process's other
                # threads, libzmq's and the consumer's, are not the producer spinning), once the heap
                # of a whole test run was collected first (a full collection in the window took it
                # past the bound).
                # The least of three windows: a spin takes every one, work that came once (the
                # non-reader dropped as its lease ends, its queues freed) only one.
                await collected()
                shares = []
                for _ in range(3):
                    cpu_before, wall_before = time.thread_time(), time.monotonic()
                    await asyncio.sleep(0.2)
                    shares.append((time.thread_time() - cpu_before) / (time.monotonic() - wall_before))
                cpu_share = min(shares)
                assert cpu_share < 0.2, f"the producer spun on a full queue ({cpu_share:.0%} CPU at least)"
                assert stuck or not present, "the replies it never read left its outbox while it stayed"
            async with asyncio.timeout(LEASE_S + 30):
                while producer.stats().peers > 1:  # the non-reader is dropped: stalled for its lease, or overflowing
                    producer._serving.peer_left.clear()
                    await producer._serving.peer_left.wait()
            assert await consumer.drop_select(torch.tensor([-1])) is None


# -- 4. bounds per peer ------------------------------------------------------------------------


def _hello(core: ProducerCore, peer: bytes) -> None:
    core.receive(peer, m.encode(m.Hello(version=m.PROTOCOL_VERSION)), 0, 0.0)


def _wait(core: ProducerCore, peer: bytes, request_id: int, tokens: np.ndarray) -> list[object]:
    request = m.DropSelect(request_id=request_id, tokens=m.tokens_to_bytes(tokens), timeout_s=None)
    return [out.message for out in core.receive(peer, m.encode(request), 0, 0.0)]


def test_one_peer_cannot_park_more_than_its_share_of_waiting_requests() -> None:
    core = ProducerCore(producer_id="p", heartbeat_s=1.0)
    _hello(core, b"greedy")
    _hello(core, b"other")
    for request_id in range(1, MAX_WAITING_PER_PEER + 1):
        assert _wait(core, b"greedy", request_id, np.array([request_id])) == []
    (refused,) = _wait(core, b"greedy", MAX_WAITING_PER_PEER + 1, np.array([0]))
    assert isinstance(refused, m.ErrorReply) and refused.code is kvrt.ErrorCode.CAPACITY
    assert _wait(core, b"other", 1, np.array([7])) == []  # not locked out


def test_one_peer_cannot_hold_more_than_its_share_of_query_bytes() -> None:
    core = ProducerCore(producer_id="p", heartbeat_s=1.0)
    _hello(core, b"greedy")
    _hello(core, b"other")
    big = m.MAX_TOKENS  # 8 MiB of tokens each
    fits = MAX_WAITING_QUERY_BYTES_PER_PEER // (big * m.TOKEN_BYTES)
    for request_id in range(1, fits + 1):
        assert _wait(core, b"greedy", request_id, np.full(big, request_id)) == []
    (refused,) = _wait(core, b"greedy", fits + 1, np.full(big, 0))
    assert isinstance(refused, m.ErrorReply) and refused.code is kvrt.ErrorCode.CAPACITY
    assert _wait(core, b"other", 1, np.full(big, -1)) == []


def _lookups_of_an_insert(waiters: int) -> int:
    """Dict lookups the waiter index makes while an insert finds (none of) its waiters."""
    from tests.test_protocol import make_item

    core = ProducerCore(producer_id="p", heartbeat_s=1.0)
    _hello(core, b"peer")
    for request_id in range(1, waiters + 1):
        _wait(core, b"peer", request_id, np.array([request_id, request_id + 1, request_id + 2]))
    lookups = 0

    class Counting(dict):  # type: ignore[type-arg]
        def get(self, key: object, default: object = None) -> object:
            nonlocal lookups
            lookups += 1
            return super().get(key, default)

    def instrument(node: object) -> None:
        children = node.children  # type: ignore[attr-defined]
        node.children = Counting(children)  # type: ignore[attr-defined]
        for child in children.values():
            instrument(child)

    instrument(core.waiting._plain.by_query._root)
    core.insert(make_item(core, [-5, -6, -7]), 0.0)
    return lookups


def test_an_insert_finds_its_waiter_without_looking_at_the_others() -> None:
    assert _lookups_of_an_insert(10) == _lookups_of_an_insert(4000) <= 3


# -- 5. values the wire cannot carry -----------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"buffer_bytes": 2**64}, "buffer_bytes"),
        ({"buffer_bytes": True}, "buffer_bytes"),
        ({"buffer_bytes": 0}, "buffer_bytes"),
        ({"heartbeat_s": float("inf")}, "heartbeat_s"),
        ({"heartbeat_s": True}, "heartbeat_s"),
        ({"heartbeat_s": float("nan")}, "heartbeat_s"),
        ({"heartbeat_s": 1e12}, "heartbeat_s"),
        ({"item_ttl_s": float("inf")}, "item_ttl_s"),
        ({"item_ttl_s": True}, "item_ttl_s"),
        ({"bind": "tcp://127.0.0.1:70000"}, "70000"),
        ({"bind": "tcp://127.0.0.1:-1"}, "-1"),
        ({"bind": 5555}, "bind"),
    ],
)
async def test_producer_arguments_the_protocol_cannot_carry_are_refused(
    arguments: dict[str, object], named: str
) -> None:
    with pytest.raises(kvrt.InvalidInputError, match=named):
        await kvrt.Producer(**arguments).start()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"heartbeat_s": float("inf")}, "heartbeat_s"),
        ({"heartbeat_s": True}, "heartbeat_s"),
        ({"connect_timeout_s": float("inf")}, "connect_timeout_s"),
        ({"connect_timeout_s": -1}, "connect_timeout_s"),
        ({"transfer_timeout_s": float("inf")}, "transfer_timeout_s"),
        ({"reply_timeout_s": 0}, "reply_timeout_s"),
        ({"connect": "tcp://127.0.0.1:99999"}, "99999"),
    ],
)
async def test_consumer_arguments_the_protocol_cannot_carry_are_refused(
    arguments: dict[str, object], named: str
) -> None:
    fields = {"connect": "tcp://127.0.0.1:5555", **arguments}
    with pytest.raises(kvrt.InvalidInputError, match=named):
        await kvrt.Consumer(**fields).start()  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), True, -1.0, 1e12])
async def test_a_call_timeout_the_protocol_cannot_carry_is_refused(
    producer: kvrt.Producer, consumer: kvrt.Consumer, timeout: float
) -> None:
    with pytest.raises(kvrt.InvalidInputError, match="timeout"):
        await consumer.drop_select(torch.arange(3), None, timeout=timeout)
    with pytest.raises(kvrt.InvalidInputError, match="timeout"):
        await producer.insert(torch.arange(3), None, torch.ones(1, 3, 1, 1), torch.ones(1, 3, 1, 1), timeout=timeout)


async def test_a_reply_that_cannot_be_built_fails_that_request_alone(producer: kvrt.Producer) -> None:
    producer._core.buffer_limit_bytes = 2**64  # what validation keeps out, as if it got in
    async with kvrt.Client(producer.endpoint) as client:
        with pytest.raises(kvrt.KVRTError, match="could not be built"):
            await client.stats()
        assert (await client.health()).producer_id  # still serving
    await producer.insert(torch.arange(3), None, torch.ones(1, 3, 1, 1), torch.ones(1, 3, 1, 1))
    async with kvrt.Consumer(connect=producer.endpoint) as consumer:
        assert await consumer.drop_select(torch.arange(3)) is not None


# -- 7. the caller's timeout bounds the call ---------------------------------------------------


async def test_a_call_against_a_stalled_producer_ends_within_its_own_timeout_plus_the_reply_timeout() -> None:
    async with child_process(run_producer, (0, 1.0), "a producer") as (endpoint, stalled, _):
        async with kvrt.Consumer(connect=endpoint, reply_timeout_s=0.3) as consumer:
            assert await consumer.drop_select(torch.arange(4)) is None
            _stop(stalled)
            try:
                started = time.monotonic()
                with pytest.raises(kvrt.KVRTTimeoutError) as raised:
                    await consumer.drop_select(torch.arange(4), None, timeout=0.5)
                took = time.monotonic() - started
            finally:
                _resume(stalled)
            assert raised.value.phase == "reply" and 0.5 <= took < 0.5 + 0.3 + 0.4, took
            assert await consumer.drop_select(torch.arange(4), None, timeout=0.5) is None  # and it goes on


# -- 9. bad values at the call that got them ---------------------------------------------------


@pytest.fixture(scope="module")
def meta_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """A meta KV block and meta tokens (made off the event loop: torch's first meta tensor is slow)."""
    return torch.empty(1, 4, 1, 2, device="meta"), torch.arange(4, device="meta")


async def test_meta_tensors_are_refused_with_a_typed_error(
    producer: kvrt.Producer, meta_tensors: tuple[torch.Tensor, torch.Tensor]
) -> None:
    meta, meta_tokens = meta_tensors
    with pytest.raises(kvrt.InvalidInputError, match="meta"):
        await producer.insert(torch.arange(4), None, meta, meta)
    with pytest.raises(kvrt.InvalidInputError, match="meta"):
        await producer.insert(meta_tokens, None, torch.ones(1, 4, 1, 2), torch.ones(1, 4, 1, 2))


def test_evicting_an_item_id_the_protocol_cannot_carry_is_a_clear_cli_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvrt", "evict", "tcp://127.0.0.1:9", str(2**70)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "item" in result.stderr and str(2**70) in result.stderr


async def test_a_large_item_answers_with_its_header_first_and_its_bytes_in_a_payload_message_behind(
    producer: kvrt.Producer,
) -> None:
    key = torch.randn(2, 64, 8, m.SPLIT_PAYLOAD_BYTES // (2 * 64 * 8 * 4) + 1)
    await producer.insert(torch.arange(64), None, key, key)
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(producer.endpoint)
        await socket.send(m.encode(m.Hello(version=m.PROTOCOL_VERSION)))
        assert isinstance(await _raw_reply(socket), m.Welcome)
        await socket.send(m.encode(m.DropSelect(request_id=5, tokens=None)))
        async with asyncio.timeout(10):
            header = await socket.recv_multipart()
            payload = await socket.recv_multipart()
        deliver = m.decode(header[0])
        assert isinstance(deliver, m.Deliver) and len(header) == 1
        assert m.decode(payload[0]) == m.Payload(request_id=5) and len(payload[1]) == deliver.payload_bytes
        await socket.send(m.encode(m.Received(item_ids=[deliver.item_id], leases=[deliver.lease])))
        await socket.send(m.encode(m.Stats(request_id=6)))
        stats = await _raw_reply(socket)
        assert isinstance(stats, m.StatsReply) and stats.totals["delivered_items"] == 1
    finally:
        socket.close()
        context.term()


async def test_a_large_item_arrives_whole_through_the_consumer_with_its_header_first(producer: kvrt.Producer) -> None:
    key = torch.randn(4, 256, 8, 128)  # 4 MiB each for key and value
    await producer.insert(torch.arange(256), None, key, -key)
    async with kvrt.Consumer(connect=producer.endpoint) as consumer:
        item = await consumer.drop_select(torch.arange(256))
        assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, -key)
        items = await consumer.drop_select_many([torch.arange(256)])
        assert items == [None]
    # That consumer's bye handled first: its departure must not stand for the next one's.
    await asyncio.wait_for(producer._serving.peer_left.wait(), 5)
    producer._serving.peer_left.clear()
    await producer.insert(torch.arange(256), None, key, -key)
    await producer.insert(torch.arange(1000, 1256), None, -key, key)
    async with kvrt.Consumer(connect=producer.endpoint) as consumer:
        first, second = await consumer.drop_select_many([torch.arange(256), torch.arange(1000, 1256)])
        assert first is not None and second is not None and torch.equal(second.key, -key)
    await asyncio.wait_for(producer._serving.peer_left.wait(), 5)  # its receipts, then its bye, were handled
    assert (producer.stats().items, producer.stats().in_flight, producer.stats().totals.delivered_items) == (0, 0, 3)


# -- 6. liveness under load ---------------------------------------------------------------------


async def test_a_producer_whose_loop_is_held_for_seconds_is_not_taken_for_dead() -> None:
    heartbeat_s = 0.2  # its lease: 2 s; the loop is held 1.5 s, past 4 heartbeats of silence
    async with child_process(run_busy_producer, (heartbeat_s,), "a busy producer") as (endpoint, _, control):
        async with kvrt.Consumer(connect=endpoint, heartbeat_s=heartbeat_s) as consumer:
            waiting = asyncio.create_task(consumer.drop_select(torch.arange(8), None, timeout=None))
            assert await consumer.drop_select(torch.arange(9, 12)) is None  # the wait is posted
            control.send(("busy", 1.5, list(range(8))))
            assert await asyncio.to_thread(control.recv) == "inserted"
            item = await asyncio.wait_for(waiting, 10)
            assert item is not None and item.matched == 8


async def test_a_delivery_whose_frames_only_name_its_bytes_travels_in_one_message(
    producer: kvrt.Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cuda_ipc's frame is a share of a few hundred bytes naming an item of any size: it rides
    # with its header; only the bytes themselves (TCP) follow in a payload message.
    posted: list[list[object]] = []
    serving = producer._serving
    monkeypatch.setattr(serving, "_post", lambda peer, frames, dropped: posted.append(list(frames)))
    meta = m.TensorMeta("float16", [1, 1 << 20, 1, 1])
    deliver = m.Deliver(1, 2, 1, meta, None, meta, meta, None, payload_bytes=4 << 20)
    header = m.encode(deliver)
    serving._post_delivery(b"peer", deliver, header, [b"a share of 300 bytes".ljust(300)], [])
    assert [len(frames) for frames in posted] == [2]
    posted.clear()
    serving._post_delivery(b"peer", deliver, header, [memoryview(bytearray(4 << 20))], [])
    assert [len(frames) for frames in posted] == [1, 2]


def _ticked(core: ProducerCore, until: float) -> list[object]:
    """`expire` every tenth of a heartbeat up to `until`, as a running serve loop calls it."""
    out: list[object] = []
    now = 0.0
    while now < until:
        now = min(until, now + core.heartbeat_s / 10)
        out += core.expire(now)
    return out


def test_a_producer_woken_from_a_stall_reads_what_was_sent_meanwhile_before_any_lease_ends() -> None:
    from tests.test_protocol import make_item

    def delivered_core() -> tuple[ProducerCore, m.Deliver, int]:
        core = ProducerCore(producer_id="p", heartbeat_s=HEARTBEAT_S)
        core.receive(b"a", m.encode(m.Hello(version=m.PROTOCOL_VERSION)), 0, 0.0)
        item = make_item(core, [1, 2, 3])
        core.insert(item, 0.0)
        (sent,) = core.receive(b"a", m.encode(m.DropSelect(request_id=1, tokens=None)), 0, 0.0)
        assert isinstance(sent.message, m.Deliver)
        return core, sent.message, item.item_id

    # Running all along: the lease ends on time and the item goes back.
    core, _, _ = delivered_core()
    _ticked(core, core.lease_s + HEARTBEAT_S)
    assert core.peer_count == 0 and len(core.buffer) == 1
    # Stopped from before the lease's end to well after it: the consumer's receipt (sent inside
    # its lease) waits unread; woken, the producer holds the lease a heartbeat more, reads it.
    core, deliver, item_id = delivered_core()
    _ticked(core, core.lease_s * 0.8)
    woken = core.lease_s * 3
    assert core.expire(woken) == [] and core.peer_count == 1  # not forgotten at once
    receipt = m.Received(item_ids=[item_id], leases=[deliver.lease])
    assert core.receive(b"a", m.encode(receipt), 0, woken + 0.001) == []
    assert core.counters.delivered_items == 1 and len(core.buffer) == 0


def test_a_live_peer_that_never_confirms_cannot_hold_more_than_its_share_of_the_buffer() -> None:
    from tests.test_protocol import make_item

    core = ProducerCore(producer_id="p", heartbeat_s=1.0, buffer_limit_bytes=10_000)
    for peer in (b"hoarder", b"legit"):
        _hello(core, peer)
    for request_id in range(1, 9):  # the hoarder parks 8 lookups for anything
        request = m.DropSelect(request_id=request_id, tokens=None, timeout_s=None)
        assert core.receive(b"hoarder", m.encode(request), 0, 0.0) == []
    sent: list[m.Deliver] = []
    while not core.waiting.suspended(b"hoarder"):
        (out,) = core.insert(make_item(core, [len(sent) + 1] * 100), 0.0)
        assert out.peer == b"hoarder" and isinstance(out.message, m.Deliver)
        sent.append(out.message)
    held = core.lifecycle.holdings[b"hoarder"].nbytes
    assert held > 5_000 and len(sent) < 8  # past half the buffer: suspended with lookups still parked
    assert core.insert(make_item(core, [77] * 100), 0.0) == []  # not served to the hoarder: buffered
    (refused,) = core.receive(b"hoarder", m.encode(m.DropSelect(request_id=99, tokens=None)), 0, 0.0)
    assert isinstance(refused.message, m.ErrorReply) and refused.message.code is kvrt.ErrorCode.CAPACITY
    (taken,) = core.receive(b"legit", m.encode(m.DropSelect(request_id=1, tokens=None)), 0, 0.0)
    assert isinstance(taken.message, m.Deliver)  # the others are served
    confirm = m.Received(item_ids=[d.item_id for d in sent], leases=[d.lease for d in sent])
    assert core.receive(b"hoarder", m.encode(confirm), 0, 0.0) == []  # it confirms (nothing buffered now)
    assert not core.waiting.suspended(b"hoarder")
    (again,) = core.insert(make_item(core, [78] * 100), 0.0)  # its parked lookups are served again
    assert again.peer == b"hoarder" and isinstance(again.message, m.Deliver)


def test_a_peer_served_again_after_its_suspension_keeps_its_lookups_place_in_the_queue() -> None:
    # Waiting lookups are served oldest first: those of a peer that was over its share, once it
    # confirmed, come before lookups other peers made meanwhile.
    from tests.test_protocol import make_item

    core = ProducerCore(producer_id="p", heartbeat_s=1.0, buffer_limit_bytes=10_000)
    for peer in (b"hoarder", b"other"):
        _hello(core, peer)
    for request_id in range(1, 9):
        assert (
            core.receive(b"hoarder", m.encode(m.DropSelect(request_id=request_id, tokens=None, timeout_s=None)), 0, 0.0)
            == []
        )
    sent: list[m.Deliver] = []
    while not core.waiting.suspended(b"hoarder"):
        (out,) = core.insert(make_item(core, [len(sent) + 1] * 100), 0.0)
        assert isinstance(out.message, m.Deliver)
        sent.append(out.message)
    assert (
        core.receive(b"other", m.encode(m.DropSelect(request_id=1, tokens=None, timeout_s=None)), 0, 0.0) == []
    )  # parked after
    confirm = m.Received(item_ids=[d.item_id for d in sent], leases=[d.lease for d in sent])
    assert core.receive(b"hoarder", m.encode(confirm), 0, 0.0) == []
    (served,) = core.insert(make_item(core, [90] * 100), 0.0)
    assert served.peer == b"hoarder" and served.message.request_id == len(sent) + 1


def test_a_hello_that_starts_a_new_session_repeats_the_receipts_of_the_one_it_ends() -> None:
    from kvrt._protocol import ConsumerCore
    from tests.test_protocol import make_item

    core = ProducerCore(producer_id="p", heartbeat_s=HEARTBEAT_S)
    link = ConsumerCore(endpoint="mem://p", name="c", heartbeat_s=HEARTBEAT_S)
    for out in core.receive(b"c", m.encode(link.connect(0.0)), 0, 0.0):
        link.receive(m.encode(out.message), 0.0)
    item = make_item(core, [1, 2])
    core.insert(item, 0.0)
    (sent,) = core.receive(b"c", m.encode(m.DropSelect(request_id=1, tokens=None)), 0, 0.0)
    assert isinstance(sent.message, m.Deliver)
    link.receipts_sent([(item.item_id, sent.message.lease)])  # sent, and lost with its connection
    hello = link.connect(0.2 + 3 * link.lease_s)  # the new session's hello, after a reconnect
    assert hello.received == [item.item_id] and hello.received_leases == [sent.message.lease]
    (welcome,) = core.receive(b"c", m.encode(hello), 0, 0.2)
    assert core.counters.delivered_items == 1 and len(core.buffer) == 0  # confirmed, not given back
    link.receive(m.encode(welcome.message), 0.3)
    assert link.connect(0.4).received == []  # the new session settled them: not repeated again
