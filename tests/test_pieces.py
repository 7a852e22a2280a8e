"""Pieces of items (head ranges), in the producer's protocol core: several consumers each take
one piece of an item, exactly once, and the item stays until every reader confirmed its own."""

from __future__ import annotations

import weakref

import msgspec
import numpy as np
import pytest
import torch

from kvrt import _messages as m
from kvrt._errors import ErrorCode
from kvrt._heads import fill_piece, first_head, piece_of
from kvrt._item import NewItem
from kvrt._item_bytes import ItemBytes
from kvrt._producer._serve import buffered_item
from kvrt._protocol import Outgoing, ProducerCore
from kvrt._protocol.lookup_buffer import BufferedItem
from kvrt._protocol.waiting import PieceAsked

HEADS = 8
READERS = [b"rank-0", b"rank-1", b"rank-2", b"rank-3"]


BYTES: weakref.WeakKeyDictionary[BufferedItem, ItemBytes] = weakref.WeakKeyDictionary()
"""Each item's bytes beside its record, as the producer's driver keeps them."""


def kept(new: NewItem) -> BufferedItem:
    BYTES[new.record] = new.bytes
    return new.record


def kv(item: BufferedItem) -> ItemBytes:
    """An item's tensors (its bytes, kept beside its record)."""
    return BYTES[item]


def cut(item: BufferedItem, asked: PieceAsked, item_id: int) -> BufferedItem:
    piece = piece_of(item, kv(item), asked.heads, asked.hidden, item_id=item_id, allocate=None)
    fill_piece(piece.bytes, kv(item), first_head(kv(item), asked.heads))
    return kept(piece)


class Producer:
    """A producer core with four consumers connected, and a clock we move."""

    def __init__(self, item_ttl_s: float | None = None) -> None:
        self.now = 0.0
        self.core = ProducerCore(producer_id="prefill-0", heartbeat_s=1.0, cut=cut, item_ttl_s=item_ttl_s)
        self.request_ids = iter(range(1, 1 << 20))
        for peer in READERS:
            (welcome,) = self.send(peer, m.Hello(version=m.PROTOCOL_VERSION, name=peer.decode()))
            assert isinstance(welcome.message, m.Welcome)

    def send(self, peer: bytes, message: m.Message) -> list[Outgoing]:
        return self.core.receive(peer, m.encode(message), 0, self.now)

    def insert(self, tokens: list[int], seed: int = 0) -> BufferedItem:
        generator = torch.Generator().manual_seed(seed)
        key = torch.randn((2, len(tokens), HEADS, 4), generator=generator)
        value = torch.randn((2, len(tokens), HEADS, 4), generator=generator)
        item = kept(buffered_item(
            (torch.tensor(tokens), None, key, value, torch.ones(len(tokens), 3)), torch.device("cpu"),
            item_id=self.core.new_item_id(), seq=self.core.buffer.next_seq(),
        ))  # fmt: skip
        assert self.core.insert(item, self.now) == []
        return item

    def item(self, tokens: list[int]) -> BufferedItem:
        """An item of zeros for the core, not inserted yet (its insert's messages are the test's)."""
        zeros = torch.zeros(1, len(tokens), HEADS, 2)
        return kept(buffered_item(
            (torch.tensor(tokens), None, zeros, zeros.clone(), None), torch.device("cpu"),
            item_id=self.core.new_item_id(), seq=self.core.buffer.next_seq(),
        ))  # fmt: skip

    def ask(
        self, peer: bytes, tokens: list[int] | None, first: int, end: int, *, readers: int = 2,
        timeout_s: float | None = 0.0,
    ) -> list[Outgoing]:  # fmt: skip
        query = None if tokens is None else m.tokens_to_bytes(np.array(tokens))
        request = m.DropSelect(
            request_id=next(self.request_ids), tokens=query, timeout_s=timeout_s,
            heads=m.HeadRange(first, end), readers=readers,
        )  # fmt: skip
        return self.send(peer, request)

    def confirm(self, peer: bytes, deliver: m.Deliver) -> list[Outgoing]:
        return self.send(peer, m.Received(item_ids=[deliver.item_id], leases=[deliver.lease]))


def piece(out: list[Outgoing]) -> tuple[m.Deliver, BufferedItem]:
    (sent,) = out
    assert isinstance(sent.message, m.Deliver) and sent.item is not None
    return sent.message, sent.item


def test_each_reader_gets_its_heads_and_the_item_leaves_once_every_piece_is_confirmed() -> None:
    producer = Producer()
    item = producer.insert([1, 2, 3])
    first, first_piece = piece(producer.ask(READERS[0], [1, 2, 3], 0, 4))
    second, second_piece = piece(producer.ask(READERS[1], [1, 2, 3], 4, 8))
    assert torch.equal(kv(first_piece).key, kv(item).key[:, :, 0:4])
    assert torch.equal(kv(second_piece).value, kv(item).value[:, :, 4:8])
    assert first.payload_bytes < item.nbytes  # only those heads travel
    producer.confirm(READERS[0], first)
    assert producer.core.buffer.nbytes == item.nbytes + second_piece.nbytes  # the item waits for its second reader
    producer.confirm(READERS[1], second)
    assert producer.core.buffer.nbytes == 0 and producer.core.buffer.held == 0 and len(producer.core.buffer) == 0


def test_a_reader_takes_one_piece_of_an_item_and_a_third_reader_finds_none() -> None:
    producer = Producer()
    producer.insert([1, 2, 3])
    piece(producer.ask(READERS[0], [1, 2, 3], 0, 4))
    (again,) = producer.ask(READERS[0], [1, 2, 3], 4, 8)
    assert isinstance(again.message, m.Miss)  # its piece is out already
    piece(producer.ask(READERS[1], [1, 2, 3], 4, 8))
    (third,) = producer.ask(READERS[2], [1, 2, 3], 0, 4)
    assert isinstance(third.message, m.Miss)  # both readers have theirs


def test_a_whole_take_never_sees_an_item_whose_pieces_are_out() -> None:
    producer = Producer()
    producer.insert([1, 2, 3])
    piece(producer.ask(READERS[0], [1, 2, 3], 0, 4))
    (whole,) = producer.send(READERS[2], m.DropSelect(request_id=99, tokens=None))
    assert isinstance(whole.message, m.Miss)


def test_pieces_given_back_make_the_item_whole_again() -> None:
    producer = Producer()
    item = producer.insert([1, 2, 3])
    deliver, _ = piece(producer.ask(READERS[0], [1, 2, 3], 0, 4))
    producer.send(READERS[0], m.Release(item_id=deliver.item_id, lease=deliver.lease))
    assert producer.core.buffer.nbytes == item.nbytes and producer.core.buffer.held == 0
    (whole,) = producer.send(READERS[2], m.DropSelect(request_id=99, tokens=None))
    assert isinstance(whole.message, m.Deliver) and whole.message.item_id == item.item_id


def test_a_reader_that_leaves_frees_its_place_for_a_new_one_and_nothing_is_lost() -> None:
    producer = Producer()
    item = producer.insert([1, 2, 3])
    piece(producer.ask(READERS[0], [1, 2, 3], 0, 4))
    second, _ = piece(producer.ask(READERS[1], [1, 2, 3], 4, 8))
    producer.confirm(READERS[1], second)
    producer.send(READERS[0], m.Bye())  # rank 0 died before it confirmed
    again, again_piece = piece(producer.ask(READERS[2], [1, 2, 3], 0, 4))  # its replacement takes heads 0-4
    assert torch.equal(kv(again_piece).key, kv(item).key[:, :, 0:4])
    producer.confirm(READERS[2], again)
    assert producer.core.buffer.nbytes == 0 and len(producer.core.buffer) == 0


def test_replicated_heads_go_to_every_reader_that_names_them() -> None:
    producer = Producer()
    item = producer.insert([5, 6])
    delivered = [piece(producer.ask(peer, [5, 6], 3, 4, readers=4)) for peer in READERS]  # decode TP > KV heads
    assert all(torch.equal(kv(piece_item).key, kv(item).key[:, :, 3:4]) for _, piece_item in delivered)
    for peer, (deliver, _) in zip(READERS, delivered, strict=True):
        producer.confirm(peer, deliver)
    assert producer.core.buffer.nbytes == 0


def test_waiting_readers_are_each_served_a_piece_by_one_insert() -> None:
    producer = Producer()
    assert producer.ask(READERS[0], [7, 8], 0, 4, timeout_s=None) == []
    assert producer.ask(READERS[1], [7, 8], 4, 8, timeout_s=None) == []
    item = producer.item([7, 8])
    out = producer.core.insert(item, producer.now)
    assert sorted(sent.peer for sent in out) == READERS[:2]
    assert all(isinstance(sent.message, m.Deliver) for sent in out)


def test_heads_the_item_lacks_are_refused_and_the_item_stays_whole() -> None:
    producer = Producer()
    item = producer.insert([1, 2])
    (refused,) = producer.ask(READERS[0], [1, 2], 6, 10)
    assert isinstance(refused.message, m.ErrorReply) and refused.message.code is ErrorCode.INVALID
    assert "8 KV heads" in refused.message.message
    (whole,) = producer.send(READERS[1], m.DropSelect(request_id=99, tokens=None))
    assert isinstance(whole.message, m.Deliver) and whole.message.item_id == item.item_id


def test_readers_of_another_number_take_another_item_and_never_a_piece_of_this_one() -> None:
    producer = Producer()
    first = producer.insert([1, 2], seed=1)
    second = producer.insert([1, 2], seed=2)
    piece(producer.ask(READERS[0], [1, 2], 0, 4, readers=2))  # `first` is split for 2 readers
    (other,) = producer.ask(READERS[1], [1, 2], 4, 8, readers=3)  # another group's reader
    assert isinstance(other.message, m.Deliver) and other.item is not None
    assert torch.equal(kv(other.item).key, kv(second).key[:, :, 4:8])
    (third,) = producer.ask(READERS[2], [1, 2], 4, 8, readers=4)
    assert isinstance(third.message, m.Miss)  # no item left that it could start
    _, mine = piece(producer.ask(READERS[1], [1, 2], 4, 8, readers=2))
    assert torch.equal(kv(mine).key, kv(first).key[:, :, 4:8])


def test_a_batch_takes_a_piece_of_each_item_and_one_bad_range_sends_every_piece_back() -> None:
    producer = Producer()
    items = [producer.insert([index, 1], seed=index) for index in range(3)]
    queries = [m.tokens_to_bytes(np.array([index, 1])) for index in range(3)]
    (batch,) = producer.send(
        READERS[0], m.DropSelectMany(request_id=5, queries=queries, heads=m.HeadRange(2, 4), readers=2)
    )
    assert isinstance(batch.message, m.DeliverMany) and len(batch.items) == 3
    for item, sent in zip(items, batch.items, strict=True):
        assert torch.equal(kv(sent).key, kv(item).key[:, :, 2:4])
    held = producer.core.buffer.nbytes
    out = producer.send(READERS[1], m.DropSelectMany(request_id=6, queries=queries, heads=m.HeadRange(6, 9), readers=2))
    assert isinstance(out[0].message, m.ErrorReply)
    assert producer.core.buffer.nbytes == held  # nothing of the refused batch stays out


def test_an_item_whose_readers_do_not_all_come_expires_and_the_pieces_out_stay_valid() -> None:
    producer = Producer(item_ttl_s=5.0)
    item = producer.insert([1, 2])
    deliver, sent = piece(producer.ask(READERS[0], [1, 2], 0, 4))
    producer.now = 6.0
    producer.core.expire(producer.now)
    assert len(producer.core.buffer) == 0 and producer.core.counters.expired_items == 1
    assert producer.core.buffer.nbytes == sent.nbytes  # only the piece still out
    (late,) = producer.ask(READERS[1], [1, 2], 4, 8)
    assert isinstance(late.message, m.Miss)
    producer.confirm(READERS[0], deliver)
    assert producer.core.buffer.nbytes == 0 and producer.core.buffer.held == 0
    assert item.pieces is not None and item.pieces.dropped


def test_more_readers_than_connected_consumers_are_refused() -> None:
    producer = Producer()
    producer.insert([1, 2])
    (refused,) = producer.ask(READERS[0], [1, 2], 0, 1, readers=m.MAX_READERS)
    assert isinstance(refused.message, m.ErrorReply) and "4 consumers are connected" in refused.message.message
    assert piece(producer.ask(READERS[0], [1, 2], 0, 1, readers=4))  # the item was left whole


def test_more_readers_than_connected_consumers_wait_for_them_with_an_item_ttl() -> None:
    # A decode group's ranks reach a producer one after the other: the first asks for its piece
    # before the others are connected. The item waits for them, as long as its TTL at most.
    producer = Producer(item_ttl_s=5.0)
    producer.insert([1, 2])
    assert piece(producer.ask(READERS[0], [1, 2], 0, 1, readers=m.MAX_READERS))


@pytest.mark.parametrize("hidden", [True, False])
def test_a_piece_carries_the_hidden_states_only_when_asked(hidden: bool) -> None:
    producer = Producer()
    producer.insert([1, 2])
    request = m.DropSelect(request_id=1, tokens=None, heads=m.HeadRange(0, 1), readers=1, hidden=hidden)
    deliver, _ = piece(producer.send(READERS[0], request))
    assert (deliver.hidden is not None) is hidden


def test_a_latent_item_travels_whole_as_every_piece() -> None:
    producer = Producer()
    latent = torch.randn(2, 3, 1, 16)
    item = kept(buffered_item(
        (torch.tensor([4, 5, 6]), None, latent, torch.empty(2, 3, 0, 16), None), torch.device("cpu"),
        item_id=producer.core.new_item_id(), seq=producer.core.buffer.next_seq(),
    ))  # fmt: skip
    producer.core.insert(item, producer.now)
    pieces = [piece(producer.ask(peer, [4, 5, 6], rank, rank + 1, readers=4)) for rank, peer in enumerate(READERS)]
    assert all(torch.equal(kv(piece_item).key, latent) for _, piece_item in pieces)


@pytest.mark.parametrize("heads", [[5, 3], [4, 4], [0, 1 << 40], [-1, 2], "x"])
def test_a_hand_built_range_that_is_no_range_of_heads_fails_that_request_alone(heads: object) -> None:
    producer = Producer()
    item = producer.insert([1, 2])
    frame = msgspec.msgpack.encode(
        [m.PROTOCOL_VERSION, {"type": "drop_select", "request_id": 7, "tokens": None, "heads": heads}]
    )
    (refused,) = producer.core.receive(READERS[0], frame, 0, producer.now)
    assert isinstance(refused.message, m.ErrorReply) and refused.message.request_id == 7
    assert refused.message.code in (ErrorCode.INVALID, ErrorCode.PROTOCOL)
    (whole,) = producer.send(READERS[1], m.DropSelect(request_id=8, tokens=None))
    assert isinstance(whole.message, m.Deliver) and whole.message.item_id == item.item_id


def test_a_waiting_request_for_heads_an_item_lacks_is_refused_and_the_next_waiter_gets_it() -> None:
    producer = Producer()
    assert producer.ask(READERS[0], None, 0, 1000, readers=1, timeout_s=None) == []  # can never be served
    assert producer.send(READERS[1], m.DropSelect(request_id=50, tokens=None, timeout_s=None)) == []
    item = producer.item([1, 2])
    refused, delivered = producer.core.insert(item, producer.now)
    assert refused.peer == READERS[0] and isinstance(refused.message, m.ErrorReply)
    assert refused.message.code is ErrorCode.INVALID
    assert delivered.peer == READERS[1] and isinstance(delivered.message, m.Deliver)
    assert delivered.message.request_id == 50 and delivered.message.item_id == item.item_id


def test_a_readers_second_waiting_request_does_not_keep_another_reader_waiting() -> None:
    producer = Producer()
    assert producer.ask(READERS[0], [7, 8], 0, 4, timeout_s=None) == []
    assert producer.ask(READERS[0], [7, 8], 0, 4, timeout_s=None) == []  # its next request, older than B's
    assert producer.ask(READERS[1], [7, 8], 4, 8, timeout_s=None) == []
    item = producer.item([7, 8])
    out = producer.core.insert(item, producer.now)
    assert sorted(sent.peer for sent in out) == READERS[:2]  # both readers of the item, once each
    assert producer.core.waiting_count == 1  # rank 0's second request waits for the next item


def test_a_piece_taker_is_charged_its_share_of_the_item_so_a_hoarder_is_suspended() -> None:
    producer = Producer()
    producer.core.buffer_limit_bytes = 6 * producer.insert([0, 1]).nbytes
    for index in range(1, 6):
        producer.insert([index, 1], seed=index)
    refused = None
    for index in range(6):
        out = producer.ask(READERS[0], [index, 1], 0, 1, readers=2)  # one head, never confirmed
        if isinstance(out[0].message, m.ErrorReply):
            refused = out[0].message
            break
    assert refused is not None and refused.code is ErrorCode.CAPACITY  # held past its share


def test_an_item_whose_places_were_all_taken_expires_once_a_piece_comes_back_after_its_time() -> None:
    producer = Producer(item_ttl_s=1.0)
    producer.insert([1, 2])
    first, _ = piece(producer.ask(READERS[0], [1, 2], 0, 4))
    second, _ = piece(producer.ask(READERS[1], [1, 2], 4, 8))
    producer.now = 3.0
    producer.core.expire(producer.now)  # every place taken: not expired
    producer.send(READERS[1], m.Release(item_id=second.item_id, lease=second.lease))
    producer.confirm(READERS[0], first)
    producer.now = 3.5
    producer.core.expire(producer.now)
    assert len(producer.core.buffer) == 0 and producer.core.counters.expired_items == 1
    assert producer.core.buffer.nbytes == 0


def test_an_item_taken_in_pieces_is_listed_and_an_operator_can_evict_it() -> None:
    producer = Producer()
    item = producer.insert([1, 2])
    deliver, _ = piece(producer.ask(READERS[0], [1, 2], 0, 4))
    (listing,) = producer.send(READERS[3], m.ListItems(request_id=60))
    assert isinstance(listing.message, m.ItemList) and [s.item_id for s in listing.message.items] == [item.item_id]
    (evicted,) = producer.send(READERS[3], m.Evict(request_id=61, item_id=item.item_id))
    assert isinstance(evicted.message, m.Evicted)
    (late,) = producer.ask(READERS[1], [1, 2], 4, 8)
    assert isinstance(late.message, m.Miss)
    producer.confirm(READERS[0], deliver)  # the piece out stays valid
    assert producer.core.buffer.nbytes == 0 and producer.core.buffer.held == 0


def test_an_item_one_reader_took_its_piece_of_is_probed_and_evicted_by_its_prompt() -> None:
    # A decode rank took its piece; another rank's load failed: the decode releases the prompt
    # (probe, then evict by the id the probe names), and the pieces nobody will take go now,
    # not with the item's time to live.
    producer = Producer(item_ttl_s=120.0)
    item = producer.insert([1, 2, 3])
    first, _ = piece(producer.ask(READERS[0], [1, 2, 3], 0, 4))
    producer.confirm(READERS[0], first)
    (probed,) = producer.send(READERS[2], m.ProbeMany(request_id=98, queries=[m.tokens_to_bytes(np.array([1, 2, 3]))]))
    assert isinstance(probed.message, m.ProbeManyReply)
    assert probed.message.answers == [m.Probed(3, item.item_id)]
    (evicted,) = producer.send(READERS[2], m.Evict(request_id=99, item_id=item.item_id))
    assert isinstance(evicted.message, m.Evicted)
    assert len(producer.core.buffer) == 0 and producer.core.buffer.nbytes == 0 and producer.core.buffer.held == 0
