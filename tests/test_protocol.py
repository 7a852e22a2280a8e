"""The protocol cores, wired together in memory: no sockets, no clock but the one we pass."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvrt import _messages as m
from kvrt._errors import ErrorCode, InvalidInputError, PeerLostError, RemoteProtocolError
from kvrt._item import query_bytes
from kvrt._protocol import (
    HEARTBEAT_MISSES,
    ConsumerCore,
    ConsumerEvent,
    Departure,
    Failed,
    LinkState,
    Lost,
    Outgoing,
    ProducerCore,
    Replied,
    Stray,
    Welcomed,
)
from kvrt._protocol.commands import ProducerCounters
from kvrt._protocol.lookup_buffer import BufferedItem
from tests._records import item_record

HEARTBEAT_S = 1.0
PEER = b"consumer-1"


class Pair:
    """A producer core and one consumer core, with the wire between them in memory."""

    def __init__(self) -> None:
        self.now = 0.0
        self.producer = ProducerCore(producer_id="producer-A", heartbeat_s=HEARTBEAT_S)
        self.consumer = ConsumerCore(endpoint="mem://producer", name="decode", heartbeat_s=HEARTBEAT_S)

    def send(self, message: m.Message, peer: bytes = PEER) -> list[Outgoing]:
        return self.producer.receive(peer, m.encode(message), 0, self.now)

    def deliver(self, outgoing: list[Outgoing]) -> list[ConsumerEvent]:
        events = [self.consumer.receive(m.encode(out.message), self.now) for out in outgoing if out.peer == PEER]
        return [event for event in events if event is not None]

    def connect(self) -> None:
        events = self.deliver(self.send(self.consumer.connect(self.now)))
        assert events == [Welcomed(events[0].welcome)]  # type: ignore[union-attr]
        assert self.consumer.state is LinkState.READY

    def drop_select(self, tokens: list[int] | None, timeout_s: float | None = 0.0) -> tuple[int, list[Outgoing]]:
        wire = None if tokens is None else m.tokens_to_bytes(np.array(tokens))
        request_id, message = self.consumer.start_request(
            lambda request_id: m.DropSelect(request_id=request_id, tokens=wire, timeout_s=timeout_s), self.now
        )
        return request_id, self.send(message)

    def insert(self, tokens: list[int]) -> tuple[BufferedItem, list[Outgoing]]:
        item = make_item(self.producer, tokens)
        return item, self.producer.insert(item, self.now)


def make_item(core: ProducerCore, tokens: list[int]) -> BufferedItem:
    return item_record(core.new_item_id(), core.buffer.next_seq(), tokens)


@pytest.fixture
def pair() -> Pair:
    pair = Pair()
    pair.connect()
    return pair


def only(outgoing: list[Outgoing]) -> m.Message:
    assert len(outgoing) == 1, outgoing
    return outgoing[0].message


def test_hello_is_answered_with_welcome_naming_producer_and_heartbeat(pair: Pair) -> None:
    assert pair.consumer.producer_id == "producer-A"
    assert pair.consumer.transport == "tcp"
    assert pair.producer.peer_count == 1


def test_a_match_is_delivered_and_its_bytes_count_until_received(pair: Pair) -> None:
    item, _ = pair.insert([1, 2, 3, 4])
    request_id, outgoing = pair.drop_select([1, 2])
    deliver = only(outgoing)
    assert isinstance(deliver, m.Deliver)
    assert (deliver.request_id, deliver.item_id, deliver.matched) == (request_id, item.item_id, 2)
    assert outgoing[0].item is item
    assert pair.deliver(outgoing) == [Replied(request_id, deliver)]
    assert pair.producer.buffer.nbytes == item.nbytes
    assert pair.send(m.Received(item_ids=[item.item_id])) == []
    assert pair.producer.buffer.nbytes == 0
    assert pair.producer.counters.delivered_items == 1


def test_no_match_with_timeout_zero_is_a_miss_at_once(pair: Pair) -> None:
    pair.insert([1, 2])
    request_id, outgoing = pair.drop_select([9])
    assert only(outgoing) == m.Miss(request_id=request_id)
    assert pair.deliver(outgoing) == [Replied(request_id, m.Miss(request_id=request_id))]


def test_a_waiting_request_is_served_by_a_later_matching_insert(pair: Pair) -> None:
    request_id, outgoing = pair.drop_select([7, 8], timeout_s=5.0)
    assert outgoing == []
    _, outgoing = pair.insert([1])
    assert outgoing == []
    _item, outgoing = pair.insert([7, 8, 9])
    deliver = only(outgoing)
    assert isinstance(deliver, m.Deliver) and deliver.request_id == request_id and deliver.matched == 2
    assert pair.producer.waiting_count == 0


def test_a_waiting_request_misses_when_its_timeout_passes(pair: Pair) -> None:
    request_id, _ = pair.drop_select([7], timeout_s=2.5)
    assert pair.producer.next_deadline() == 2.5
    assert pair.producer.expire(2.4) == []
    assert [out.message for out in pair.producer.expire(2.5)] == [m.Miss(request_id=request_id)]
    assert pair.producer.waiting_count == 0


def test_a_waiting_request_with_no_timeout_has_no_deadline(pair: Pair) -> None:
    pair.drop_select([7], timeout_s=None)
    assert pair.producer.expire(1e6) == []  # the peer is forgotten (silent), not the request answered
    assert pair.producer.waiting_count == 0 and pair.producer.peer_count == 0


def test_cancel_forgets_a_waiting_request(pair: Pair) -> None:
    request_id, _ = pair.drop_select([7], timeout_s=None)
    assert pair.send(m.Cancel(request_id=request_id)) == []
    _, outgoing = pair.insert([7])
    assert outgoing == [] and len(pair.producer.buffer) == 1


def test_release_puts_the_item_back_with_its_age(pair: Pair) -> None:
    old, _ = pair.insert([4, 4])
    pair.insert([4, 4])
    _, outgoing = pair.drop_select([4, 4])
    assert outgoing[0].item is old
    pair.send(m.Release(item_id=old.item_id))
    _, outgoing = pair.drop_select([4, 4])
    assert outgoing[0].item is old


def test_a_silent_consumer_is_forgotten_and_its_items_return(pair: Pair) -> None:
    _item, _ = pair.insert([1, 2])
    pair.drop_select([1, 2])
    assert len(pair.producer.buffer) == 0
    silence = HEARTBEAT_S * HEARTBEAT_MISSES
    assert pair.producer.expire(silence - 0.01) == []
    pair.producer.expire(silence)
    assert pair.producer.peer_count == 0
    assert len(pair.producer.buffer) == 1 and pair.producer.counters.returned_items == 1


def test_pings_keep_a_consumer_known(pair: Pair) -> None:
    for second in range(1, 20):
        pair.now = float(second)
        assert only(pair.send(m.Ping(nonce=second))) == m.Pong(nonce=second)
        pair.producer.expire(pair.now)
    assert pair.producer.peer_count == 1


def pair_and_a_second_consumer() -> tuple[Pair, bytes]:
    """A connected pair, and the peer id of a second consumer that said hello too."""
    pair = Pair()
    pair.connect()
    other = b"consumer-2"
    pair.send(m.Hello(version=m.PROTOCOL_VERSION), peer=other)
    return pair, other


def test_an_item_returned_by_a_lost_consumer_goes_to_a_waiting_one() -> None:
    pair, other = pair_and_a_second_consumer()
    item, _ = pair.insert([3])
    pair.drop_select([3])
    pair.send(m.DropSelect(request_id=1, tokens=m.tokens_to_bytes(np.array([3])), timeout_s=None), peer=other)
    outgoing = pair.send(m.Bye(reason="bye"))
    assert [(out.peer, type(out.message)) for out in outgoing] == [(other, m.Deliver)]
    assert outgoing[0].item is item


def test_a_discarded_item_is_gone_whether_buffered_or_in_flight_and_never_returns() -> None:
    pair, other = pair_and_a_second_consumer()
    buffered, _ = pair.insert([5])
    pair.producer.discard(buffered)
    assert len(pair.producer.buffer) == 0 and pair.producer.buffer.nbytes == 0
    in_flight, _ = pair.insert([3])
    pair.drop_select([3])
    pair.send(m.DropSelect(request_id=1, tokens=m.tokens_to_bytes(np.array([3])), timeout_s=None), peer=other)
    pair.producer.discard(in_flight)  # say its gathers failed: its bytes never existed
    assert pair.producer.peer_unreachable(PEER, pair.now) == []  # not handed to the other waiter
    assert len(pair.producer.buffer) == 0 and pair.producer.buffer.nbytes == 0
    assert pair.producer.buffer.held == 0


def test_a_second_hello_starts_over_and_returns_what_the_first_session_held(pair: Pair) -> None:
    pair.insert([1])
    pair.drop_select([1])
    outgoing = pair.send(m.Hello(version=m.PROTOCOL_VERSION))
    assert [type(out.message) for out in outgoing] == [m.Welcome]
    assert len(pair.producer.buffer) == 1


def test_a_request_before_hello_is_refused_as_unknown_peer() -> None:
    pair = Pair()
    error = only(pair.send(m.DropSelect(request_id=5, tokens=m.tokens_to_bytes(np.array([1])))))
    assert isinstance(error, m.ErrorReply)
    assert (error.request_id, error.code) == (5, ErrorCode.UNKNOWN_PEER)


def test_a_message_only_producers_send_is_refused_with_its_request_id(pair: Pair) -> None:
    error = only(pair.send(m.Miss(request_id=9)))
    assert isinstance(error, m.ErrorReply) and (error.request_id, error.code) == (9, ErrorCode.PROTOCOL)


def test_garbage_gets_a_protocol_error_and_the_peer_stays_connected(pair: Pair) -> None:
    error = only(pair.producer.receive(PEER, b"\x93garbage", 0, pair.now))
    assert isinstance(error, m.ErrorReply) and error.code is ErrorCode.PROTOCOL
    assert pair.producer.peer_count == 1
    pair.insert([1])
    _, outgoing = pair.drop_select([1])
    assert isinstance(only(outgoing), m.Deliver)


def test_payload_frames_on_a_control_message_are_refused(pair: Pair) -> None:
    error = only(pair.producer.receive(PEER, m.encode(m.Ping()), 2, pair.now))
    assert isinstance(error, m.ErrorReply) and "payload" in error.message


def test_a_hello_for_another_version_is_refused() -> None:
    pair = Pair()
    error = only(pair.send(m.Hello(version=m.PROTOCOL_VERSION + 1)))
    assert isinstance(error, m.ErrorReply) and error.code is ErrorCode.VERSION


def test_too_many_waiting_requests_is_a_capacity_error() -> None:
    pair = Pair()
    pair.producer = ProducerCore(producer_id="p", heartbeat_s=HEARTBEAT_S, max_waiting=2)
    pair.connect()
    pair.drop_select([1], timeout_s=None)
    pair.drop_select([2], timeout_s=None)
    request_id, outgoing = pair.drop_select([3], timeout_s=None)
    events = pair.deliver(outgoing)
    assert len(events) == 1 and isinstance(events[0], Failed) and events[0].request_id == request_id
    assert "already wait" in str(events[0].error)


def test_receipt_for_an_item_not_in_flight_is_refused(pair: Pair) -> None:
    error = only(pair.send(m.Received(item_ids=[12345])))
    assert isinstance(error, m.ErrorReply) and error.code is ErrorCode.NOT_FOUND


def test_the_consumer_pings_every_heartbeat_and_loses_a_producer_that_answers_nothing_for_its_lease(
    pair: Pair,
) -> None:
    assert pair.consumer.next_deadline() == HEARTBEAT_S
    due, lost = pair.consumer.expire(HEARTBEAT_S)
    assert due == [m.Ping(nonce=1)] and lost is None
    request_id, _ = pair.consumer.start_request(
        lambda rid: m.DropSelect(request_id=rid, tokens=None, timeout_s=None), pair.now
    )
    lease_ends = pair.consumer.lease_ends  # from the hello, the last message answered
    assert lease_ends < HEARTBEAT_S * HEARTBEAT_MISSES == pair.producer.lease_s
    assert pair.consumer.expire(lease_ends - 0.01)[1] is None
    due, lost = pair.consumer.expire(lease_ends)
    assert isinstance(lost, Lost) and lost.request_ids == (request_id,)
    assert isinstance(lost.error, PeerLostError) and "answered nothing" in str(lost.error)
    assert pair.consumer.state is LinkState.LOST


def test_an_answered_ping_renews_the_lease_from_when_it_was_sent(pair: Pair) -> None:
    pair.now = 3.0
    due, _ = pair.consumer.expire(pair.now)
    (ping,) = due
    pair.now = 3.5  # the pong comes later: the lease still counts from the ping's send time
    pair.deliver(pair.send(ping))
    assert pair.consumer.lease_ends == pytest.approx(3.0 + 0.9 * pair.consumer.lease_s)
    assert pair.consumer.lease_holds(pair.consumer.lease_ends - 0.01)
    assert not pair.consumer.lease_holds(pair.consumer.lease_ends)


def test_a_lost_link_says_hello_again_and_recovers(pair: Pair) -> None:
    pair.consumer.expire(HEARTBEAT_S * HEARTBEAT_MISSES)
    assert pair.consumer.state is LinkState.LOST
    with pytest.raises(PeerLostError, match="not connected"):
        pair.consumer.start_request(lambda rid: m.Ping(), pair.now)
    pair.now = HEARTBEAT_S * (HEARTBEAT_MISSES + 1)
    due, _ = pair.consumer.expire(pair.now)
    assert [type(message) for message in due] == [m.Hello]
    pair.deliver(pair.send(due[0]))
    assert pair.consumer.state is LinkState.READY


def test_a_link_that_starts_afresh_fails_its_calls_and_its_hello_returns_what_the_producer_sent(pair: Pair) -> None:
    item, _ = pair.insert([1, 2])
    request_id, outgoing = pair.drop_select([1, 2])
    waiting_id, _ = pair.drop_select([7], timeout_s=None)
    assert pair.deliver(outgoing) == [Replied(request_id, only(outgoing))]
    lost, hello = pair.consumer.start_afresh(RemoteProtocolError("a transfer it could not take"), pair.now)
    assert lost.request_ids == (waiting_id,) and isinstance(lost.error, RemoteProtocolError)
    assert pair.consumer.state is LinkState.CONNECTING
    events = pair.deliver(pair.send(hello))  # the same identity: a new session
    assert [type(event) for event in events] == [Welcomed] and pair.consumer.state is LinkState.READY
    assert pair.producer.buffer.nbytes == item.nbytes and pair.producer.counters.returned_items == 1
    assert pair.producer.waiting_count == 0
    _, outgoing = pair.drop_select([1, 2])
    assert isinstance(only(outgoing), m.Deliver)  # the item is back, for whoever asks


def test_a_restarted_producer_fails_pending_calls_and_the_link_reconnects(pair: Pair) -> None:
    request_id, _ = pair.consumer.start_request(
        lambda rid: m.DropSelect(request_id=rid, tokens=None, timeout_s=None), pair.now
    )
    restarted = ProducerCore(producer_id="producer-B", heartbeat_s=HEARTBEAT_S)
    refusal = restarted.receive(PEER, m.encode(m.Ping()), 0, pair.now)
    events = pair.deliver(refusal)
    assert isinstance(events[0], Lost) and events[0].request_ids == (request_id,)
    due, _ = pair.consumer.expire(HEARTBEAT_S)
    assert [type(message) for message in due] == [m.Hello]
    events = pair.deliver(restarted.receive(PEER, m.encode(due[0]), 0, pair.now))
    assert isinstance(events[0], Welcomed) and pair.consumer.producer_id == "producer-B"


def test_bye_from_the_producer_fails_pending_calls(pair: Pair) -> None:
    request_id, _ = pair.consumer.start_request(
        lambda rid: m.DropSelect(request_id=rid, tokens=None, timeout_s=None), pair.now
    )
    events = pair.deliver(pair.producer.close("shutting down"))
    assert isinstance(events[0], Lost) and events[0].request_ids == (request_id,)
    assert "shutting down" in str(events[0].error)


def test_a_deliver_for_an_abandoned_request_is_a_stray_to_release(pair: Pair) -> None:
    pair.insert([5])
    request_id, outgoing = pair.drop_select([5])
    assert pair.consumer.abandon(request_id) == m.Cancel(request_id=request_id)
    events = pair.deliver(outgoing)
    assert len(events) == 1 and isinstance(events[0], Stray)


def test_a_miss_for_an_abandoned_request_is_read_quietly_and_one_for_no_request_is_a_protocol_error(
    pair: Pair,
) -> None:
    request_id, outgoing = pair.drop_select([5])
    assert pair.consumer.abandon(request_id) == m.Cancel(request_id=request_id)
    assert pair.deliver(outgoing) == []  # its miss was already on its way: nothing to report
    with pytest.raises(RemoteProtocolError, match="unexpected Miss"):
        pair.consumer.receive(m.encode(m.Miss(request_id=request_id)), pair.now)  # once only


def test_replies_may_arrive_in_any_order(pair: Pair) -> None:
    first, _ = pair.drop_select([1], timeout_s=None)
    second, _ = pair.drop_select([2], timeout_s=None)
    _, to_second = pair.insert([2])
    _, to_first = pair.insert([1])
    events = pair.deliver(to_second + to_first)
    assert [event.request_id for event in events] == [second, first]  # type: ignore[union-attr]


def test_the_producer_picks_its_preferred_transport_among_those_the_consumer_offers() -> None:
    core = ProducerCore(producer_id="p", heartbeat_s=1.0, transports=("nccl", "tcp"))
    welcome = only(
        core.receive(PEER, m.encode(m.Hello(version=m.PROTOCOL_VERSION, capabilities=["gloo", "tcp"])), 0, 0.0)
    )
    assert isinstance(welcome, m.Welcome) and welcome.transport == "tcp" and core.transport_of(PEER) == "tcp"
    welcome = only(core.receive(b"gpu", m.encode(m.Hello(version=m.PROTOCOL_VERSION, capabilities=["nccl"])), 0, 0.0))
    assert isinstance(welcome, m.Welcome) and welcome.transport == "nccl"


def test_a_same_host_transport_is_chosen_only_for_a_consumer_whose_hello_names_the_producers_machine() -> None:
    core = ProducerCore(
        producer_id="p", heartbeat_s=1.0, transports=("cuda_ipc", "nccl", "tcp"),
        host="boot:here", same_host_only=frozenset({"cuda_ipc"}),
    )  # fmt: skip
    offered = ["cuda_ipc", "nccl", "tcp"]
    for peer, host, chosen in [(b"a", "boot:here", "cuda_ipc"), (b"b", "boot:there", "nccl"), (b"c", "", "nccl")]:
        hello = m.Hello(version=m.PROTOCOL_VERSION, capabilities=offered, host=host)
        welcome = only(core.receive(peer, m.encode(hello), 0, 0.0))
        assert isinstance(welcome, m.Welcome) and welcome.transport == chosen, host
    hostless = ProducerCore(
        producer_id="p", heartbeat_s=1.0, transports=("cuda_ipc", "tcp"), same_host_only=frozenset({"cuda_ipc"})
    )
    welcome = only(
        hostless.receive(PEER, m.encode(m.Hello(version=m.PROTOCOL_VERSION, capabilities=offered, host="")), 0, 0.0)
    )
    assert isinstance(welcome, m.Welcome) and welcome.transport == "tcp"  # two unknown machines are not one


def test_no_common_transport_is_refused_saying_what_each_side_has() -> None:
    core = ProducerCore(producer_id="p", heartbeat_s=1.0, transports=("nccl",))
    error = only(core.receive(PEER, m.encode(m.Hello(version=m.PROTOCOL_VERSION, capabilities=["tcp"])), 0, 0.0))
    assert (
        isinstance(error, m.ErrorReply) and error.code is ErrorCode.INVALID and "no common transport" in error.message
    )


def test_departed_peers_are_reported_once_with_their_transport(pair: Pair) -> None:
    pair.send(m.Bye())
    assert pair.producer.take_departed() == [Departure(PEER, "tcp", ())]
    assert pair.producer.take_departed() == []


def test_a_departed_peer_is_reported_with_the_items_it_never_confirmed(pair: Pair) -> None:
    # Its transport may hold something for each on its behalf (cuda_ipc: a share's count).
    confirmed, _ = pair.insert([1, 2])
    unconfirmed, _ = pair.insert([3, 4])
    pair.drop_select([1, 2])
    pair.drop_select([3, 4])
    pair.send(m.Received(item_ids=[confirmed.item_id]))
    pair.send(m.Bye())
    assert pair.producer.take_departed() == [Departure(PEER, "tcp", (unconfirmed,))]
    assert len(pair.producer.buffer) == 1  # the unconfirmed item is back


def test_tokens_that_are_not_whole_int64s_are_refused(pair: Pair) -> None:
    error = only(pair.send(m.DropSelect(request_id=4, tokens=b"\x01\x02\x03")))
    assert isinstance(error, m.ErrorReply) and error.request_id == 4 and "whole number" in error.message


def test_query_arrays_match_what_the_buffer_indexes() -> None:
    core = ProducerCore(producer_id="p", heartbeat_s=1.0)
    item = make_item(core, [2**62, -5])
    core.buffer.add(item)
    found = core.buffer.best_match(np.array([2**62], dtype=np.int64))
    assert found is not None and found.item is item


@pytest.mark.parametrize(
    "tokens",
    [torch.tensor([2**62, -5, 7]), torch.arange(10)[::3], torch.tensor([1, 2], dtype=torch.int32), torch.tensor([])],
    ids=["int64", "strided int64", "int32", "empty float"],
)
def test_a_query_travels_as_little_endian_int64_whatever_its_tensor(tokens: torch.Tensor) -> None:
    if tokens.dtype.is_floating_point:
        with pytest.raises(InvalidInputError, match="integer tensor"):
            query_bytes(tokens, None, what="drop_select")
        return
    wire = query_bytes(tokens, None, what="drop_select")
    assert wire == np.array(tokens.tolist(), dtype="<i8").tobytes()
    assert m.tokens_from_bytes(wire).tolist() == tokens.tolist()


def test_a_producers_totals_name_every_counter_with_its_value() -> None:
    counters = ProducerCounters(inserted_items=3, delivered_bytes=7, errors=2)
    assert counters.totals() == dataclasses.asdict(counters)
