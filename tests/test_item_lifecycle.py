"""The producer's item lifecycle, driven at random: a model-based test of `ProducerCore`.

Three consumers say hello, ask (at once, waiting, or a step's lookups in one batch), confirm,
give back, send receipts that are stale or not theirs, cancel, fall silent past their lease,
become unreachable (their driver gave up sending to them) and leave, while items are inserted
and time passes, now and then in a gap that is a stall of the producer itself. After every
step the core must agree with what its consumers saw on the wire:

* no item has two holders: an item is buffered, or in flight to one consumer, or taken for
  good by the one consumer whose receipt the producer accepted;
* none is lost: every item inserted is in exactly one of those places, and a taken item is
  never delivered again;
* a receipt is accepted exactly when it names the item's current delivery (its consumer and
  lease): a stale one (the lease ended, the item went back) or another consumer's is refused;
* the buffer's bytes are the sum of the bytes of the items it holds, in flight or not;
* waiting requests stay within their bound;
* every item's lifecycle state (`kvrt._protocol.lifecycle`) says where it is, and an item in
  flight names its holder.

Consumers also ask for pieces (a head range, two readers an item, as two decode ranks of
another TP size): a consumer holds at most one piece of an item, an item whose pieces are
out is never delivered whole, and it leaves once both readers confirmed theirs. Prefills
stream too (a stream opened, its layers published, finished or aborted): a streaming lookup
takes an open stream as its one reader, and a finished stream is an item like the others.

The core is given items' records only (`tests._records`: metas, no tensors), as the producer's
driver gives them: it never touches an item's bytes.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvrt import _messages as m
from kvrt._protocol import Outgoing, ProducerCore
from kvrt._protocol.lookup_buffer import BufferedItem, ItemState
from tests._records import item_record, layer_meta, piece_record, stream_record, whole_of

HEARTBEAT_S = 1.0
MAX_WAITING = 6
CONSUMERS = (b"consumer-0", b"consumer-1", b"consumer-2")
PROMPTS = ([1, 2, 3], [1, 2, 4], [5, 6], [7])
"""Few and sharing prefixes, so that lookups match and compete."""

LAYERS = 2
"""Of a streamed prefill."""
HEADS = 2
READERS = 2
"""Pieces: one head each, of items with two."""

consumers = st.sampled_from(CONSUMERS)
prompts = st.sampled_from(PROMPTS)
head_ranges = st.sampled_from([(0, 1), (1, 2)])


class ItemLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = ProducerCore(
            producer_id="producer", heartbeat_s=HEARTBEAT_S, max_waiting=MAX_WAITING, cut=piece_record
        )
        self.now = 0.0
        self.nbytes: dict[int, int] = {}
        """Every item inserted, and its bytes."""
        self.taken: dict[int, bytes] = {}
        """Items whose receipt the producer accepted, and by whom."""
        self.current: dict[int, tuple[bytes, int]] = {}
        """Items in flight as the wire says: to whom, under which lease."""
        self.parent: dict[int, int] = {}
        """Pieces delivered, and the item each is a piece of."""
        self.readers: dict[int, set[bytes]] = {}
        """Per item, the consumers that hold or confirmed a piece of it."""
        self.streams: dict[int, BufferedItem] = {}
        """Streams open (their prefill still publishing)."""
        self.aborted: set[int] = set()
        """Streams whose prefill failed: gone, not lost."""
        self.records: dict[int, BufferedItem] = {}
        """Every item's record, by id: the latest (a finished stream's is its whole item)."""
        self.waiting: dict[bytes, list[int]] = {consumer: [] for consumer in CONSUMERS}
        self.request_ids = itertools.count(1)

    # -- the wire -------------------------------------------------------------------------

    def send(self, consumer: bytes, message: m.Message) -> list[Outgoing]:
        outgoing = self.core.receive(consumer, m.encode(message), 0, self.now)
        self.seen(outgoing)
        return outgoing

    def seen(self, outgoing: list[Outgoing]) -> None:
        """What the producer sent; a consumer that left has what it held voided first."""
        for departure in self.core.take_departed():
            self.void(departure.peer, {item.item_id for item in departure.unconfirmed})
        for out in outgoing:
            message = out.message
            if isinstance(message, m.Deliver):
                self.delivered(out.peer, message.item_id, message.lease, out.item)
                self.answered(out.peer, message.request_id)
            elif isinstance(message, m.DeliverMany):
                hits = {item.item_id: item for item in out.items}
                for hit in message.hits:
                    if hit is not None:
                        self.delivered(out.peer, hit.item_id, hit.lease, hits.get(hit.item_id))
            elif isinstance(message, m.StreamStart):
                self.delivered(out.peer, message.item_id, message.lease, out.item)
                self.answered(out.peer, message.request_id)
            elif isinstance(message, m.StreamAbort):
                assert self.current.pop(message.item_id)[0] == out.peer
            elif isinstance(message, m.Miss | m.ErrorReply):
                self.answered(out.peer, message.request_id)

    def delivered(self, consumer: bytes, item_id: int, lease: int, item: BufferedItem | None) -> None:
        """An item, a piece or a stream went out to `consumer` under `lease`."""
        assert item_id not in self.taken, f"item {item_id} delivered again after it was taken"
        holder = self.current.get(item_id)
        assert holder is None, f"item {item_id} delivered to {consumer!r} while {holder} holds it"
        assert not self.readers.get(item_id), f"item {item_id} delivered whole, its pieces out"
        self.current[item_id] = (consumer, lease)
        if item is not None and item.parent is not None:
            self.took_a_piece(consumer, item.parent.item_id, item_id)

    def took_a_piece(self, consumer: bytes, item_id: int, piece_id: int) -> None:
        readers = self.readers.setdefault(item_id, set())
        assert consumer not in readers, f"{consumer!r} got a second piece of item {item_id}"
        assert len(readers) < READERS, f"item {item_id} cut into more than {READERS} pieces"
        readers.add(consumer)
        self.parent[piece_id] = item_id

    def answered(self, consumer: bytes, request_id: int | None) -> None:
        if request_id is not None and request_id in self.waiting[consumer]:
            self.waiting[consumer].remove(request_id)

    def void(self, consumer: bytes, unconfirmed: set[int]) -> None:
        """`consumer` left; what it held and never confirmed went back. (What it holds besides
        is the receipt that ended its session, recorded next: `every_item_is_in_exactly_one_place`
        checks that nothing else stays.)"""
        held = {item_id for item_id, (holder, _) in self.current.items() if holder == consumer}
        assert unconfirmed <= held, f"{consumer!r} held {sorted(held)}, the producer took back {sorted(unconfirmed)}"
        for item_id in unconfirmed:
            self.back(item_id)
        self.waiting[consumer].clear()

    def back(self, item_id: int) -> None:
        """A delivery went back (given back, or its consumer left); a piece frees its reader's place."""
        holder, _ = self.current.pop(item_id)
        if item_id in self.parent:
            self.readers[self.parent[item_id]].discard(holder)

    def held_by(self, consumer: bytes) -> list[tuple[int, int]]:
        return sorted((item_id, lease) for item_id, (holder, lease) in self.current.items() if holder == consumer)

    # -- what consumers and the producer do --------------------------------------------------

    @initialize()
    def all_connect(self) -> None:
        for consumer in CONSUMERS:
            self.hello(consumer)

    def hello(self, consumer: bytes) -> None:
        self.send(consumer, m.Hello(version=m.PROTOCOL_VERSION, name=consumer.decode(), capabilities=["tcp"]))

    @rule(consumer=consumers, how=st.sampled_from(["hello", "bye"]))
    def session_ends(self, consumer: bytes, how: str) -> None:
        """A consumer that says hello again starts a new session (a reconnect, a restart) and
        one that says bye leaves: either way, what its old session held goes back."""
        if how == "hello":
            self.hello(consumer)
        else:
            self.send(consumer, m.Bye(reason="closing"))

    @rule(prompt=prompts)
    def insert(self, prompt: list[int]) -> None:
        item = item_record(self.core.new_item_id(), self.core.buffer.next_seq(), prompt, heads=HEADS)
        self.nbytes[item.item_id] = item.nbytes
        self.records[item.item_id] = item
        self.seen(self.core.insert(item, self.now))

    @rule(consumer=consumers, prompt=prompts)
    def insert_then_ask(self, consumer: bytes, prompt: list[int]) -> None:
        """The common case, made likelier: a prefill's KV, then its decode's lookup."""
        self.insert(prompt)
        self.drop_select(consumer, prompt, 0.0)

    @rule(consumer=consumers, prompt=st.none() | prompts, timeout_s=st.sampled_from([0.0, 0.5, 5.0, None]))
    def drop_select(self, consumer: bytes, prompt: list[int] | None, timeout_s: float | None) -> None:
        request_id = next(self.request_ids)
        tokens = None if prompt is None else m.tokens_to_bytes(np.array(prompt))
        if timeout_s != 0.0:
            self.waiting[consumer].append(request_id)
        self.send(consumer, m.DropSelect(request_id=request_id, tokens=tokens, timeout_s=timeout_s))

    @rule(
        consumer=consumers, asked=st.lists(st.none() | prompts, min_size=1, max_size=4),
        heads=st.none() | head_ranges,
    )  # fmt: skip
    def drop_select_many(self, consumer: bytes, asked: list[list[int] | None], heads: tuple[int, int] | None) -> None:
        """A scheduler step's lookups in one request (whole items, or a piece of each)."""
        queries = [None if prompt is None else m.tokens_to_bytes(np.array(prompt)) for prompt in asked]
        batch = m.DropSelectMany(
            request_id=next(self.request_ids), queries=queries,
            heads=None if heads is None else m.HeadRange(*heads), readers=1 if heads is None else READERS,
        )  # fmt: skip
        self.send(consumer, batch)

    @rule(consumer=consumers, prompt=prompts, timeout_s=st.sampled_from([0.0, 5.0]))
    def open_stream_lookup(self, consumer: bytes, prompt: list[int], timeout_s: float) -> None:
        """A decode that takes a prefill layer by layer, while it is still running if it is."""
        request_id = next(self.request_ids)
        if timeout_s != 0.0:
            self.waiting[consumer].append(request_id)
        tokens = m.tokens_to_bytes(np.array(prompt))
        self.send(consumer, m.DropSelect(request_id=request_id, tokens=tokens, timeout_s=timeout_s, stream=True))

    @rule(prompt=prompts)
    def open_stream(self, prompt: list[int]) -> None:
        item = stream_record(self.core.new_item_id(), self.core.buffer.next_seq(), prompt, layers=LAYERS)
        self.streams[item.item_id] = item
        self.nbytes[item.item_id] = 0  # counted once finished (see `the_buffers_bytes_are_its_items`)
        self.records[item.item_id] = item
        self.seen(self.core.open_stream(item, self.now))

    @rule(data=st.data())
    def publish_a_layer(self, data: st.DataObject) -> None:
        open_streams = [item for item in self.streams.values() if item.stream and len(item.stream.metas) < LAYERS]
        if not open_streams:
            return
        item = data.draw(st.sampled_from(open_streams))
        layer = layer_meta(item, heads=HEADS)
        self.seen(self.core.stream_layer(item, layer, layer))

    @rule(data=st.data(), how=st.sampled_from(["finish", "finish", "abort"]))
    def stream_ends(self, data: st.DataObject, how: str) -> None:
        """A prefill's last layer was published and it finishes, or it fails and aborts."""
        if not self.streams:
            return
        item_id = data.draw(st.sampled_from(sorted(self.streams)))
        item = self.streams[item_id]
        assert item.stream is not None
        if how == "abort":
            del self.streams[item_id]
            self.aborted.add(item_id)
            self.seen(self.core.abort_stream(item, "the prefill failed"))
            return
        if len(item.stream.metas) < LAYERS:
            return
        del self.streams[item_id]
        whole = whole_of(item, layer_meta(item, heads=HEADS))
        self.nbytes[item_id] = whole.nbytes
        self.records[item_id] = whole
        self.seen(self.core.finish_stream(item, whole, self.now))
        assert item.state is ItemState.DONE, "a finished stream's record lives on after its end"

    @rule(consumer=consumers, prompt=st.none() | prompts, heads=head_ranges, timeout_s=st.sampled_from([0.0, 5.0]))
    def ask_for_a_piece(
        self, consumer: bytes, prompt: list[int] | None, heads: tuple[int, int], timeout_s: float
    ) -> None:
        request_id = next(self.request_ids)
        tokens = None if prompt is None else m.tokens_to_bytes(np.array(prompt))
        if timeout_s != 0.0:
            self.waiting[consumer].append(request_id)
        asked = m.DropSelect(
            request_id=request_id, tokens=tokens, timeout_s=timeout_s, heads=m.HeadRange(*heads), readers=READERS
        )
        self.send(consumer, asked)

    @rule(consumer=consumers, data=st.data())
    def cancel(self, consumer: bytes, data: st.DataObject) -> None:
        if self.waiting[consumer]:
            request_id = data.draw(st.sampled_from(self.waiting[consumer]))
            self.send(consumer, m.Cancel(request_id=request_id))

    @rule(consumer=consumers, data=st.data(), keep=st.booleans())
    def settle(self, consumer: bytes, data: st.DataObject, keep: bool) -> None:
        """A consumer confirms (keeps) or gives back one of the deliveries it holds."""
        held = self.held_by(consumer)
        if not held:
            return
        item_id, lease = data.draw(st.sampled_from(held))
        if keep:
            self.receipt(consumer, item_id, lease, good=True)
        else:
            self.back(item_id)
            self.send(consumer, m.Release(item_id=item_id, lease=lease))

    @rule(consumer=consumers, data=st.data())
    def stale_or_foreign_receipt(self, consumer: bytes, data: st.DataObject) -> None:
        """A receipt naming a delivery that is not this consumer's current one."""
        if not self.nbytes:
            return
        item_id = data.draw(st.sampled_from(sorted(self.nbytes)))
        lease = data.draw(st.integers(1, 40))
        if self.current.get(item_id) == (consumer, lease):
            return
        self.receipt(consumer, item_id, lease, good=False)

    def receipt(self, consumer: bytes, item_id: int, lease: int, *, good: bool) -> None:
        self.send(consumer, m.Received(item_ids=[item_id], leases=[lease]))
        gone = item_id not in self.buffered() | self.in_flight().keys() | self.cut_and_out()
        if item_id in self.streams:  # not ended: a stream is confirmed after its end
            assert not gone, f"a receipt of open stream {item_id} took it"
        elif good and self.current.get(item_id) == (consumer, lease):
            assert gone, f"a receipt of item {item_id}'s current delivery was refused"
            del self.current[item_id]
            self.taken[item_id] = consumer
            whole = self.parent.get(item_id)
            if whole is not None and sum(self.parent.get(taken) == whole for taken in self.taken) == READERS:
                self.taken[whole] = consumer  # its last piece: the item leaves
        elif item_id not in self.taken and item_id not in self.aborted:
            assert not gone, f"a receipt of item {item_id} that is not its current delivery took it"

    @rule(consumer=consumers)
    def unreachable(self, consumer: bytes) -> None:
        """The driver gave up sending to a consumer (disconnected, or not reading): its waiting
        requests go at once, what it holds stays its own until its lease ends or it settles it."""
        self.seen(self.core.peer_unreachable(consumer, self.now, "not reading"))
        self.waiting[consumer].clear()

    @rule(consumer=consumers)
    def ping(self, consumer: bytes) -> None:
        self.send(consumer, m.Ping())

    @rule(seconds=st.sampled_from([0.1, 0.1, 0.1, 0.6, 0.6, 2.0, 4.5]))
    def time_passes(self, seconds: float) -> None:
        """Past the lease (`HEARTBEAT_MISSES` heartbeats), a silent consumer is forgotten and
        what it held goes back; waiting requests reach their deadline."""
        self.now += seconds
        self.seen(self.core.expire(self.now))

    # -- what must hold after every step ----------------------------------------------------

    def buffered(self) -> set[int]:
        """Items and open streams no consumer holds."""
        return {item.item_id for item in self.core.buffer.items() + self.core.streams.items()}

    def in_flight(self) -> dict[int, bytes]:
        """The core's own record of what is in flight to whom (its peers' state)."""
        in_flight: dict[int, bytes] = {}
        for identity, holding in self.core.lifecycle.holdings.items():
            for item_id in holding.items:
                assert item_id not in in_flight, f"item {item_id} in flight to {identity!r} and {in_flight[item_id]!r}"
                in_flight[item_id] = identity
        return in_flight

    @invariant()
    def every_item_is_in_exactly_one_place(self) -> None:
        buffered, in_flight = self.buffered(), self.in_flight()
        assert not buffered & in_flight.keys(), "an item in flight is buffered too"
        assert not (buffered | in_flight.keys()) & self.taken.keys(), "a taken item is still held"
        assert not (buffered | in_flight.keys()) & self.aborted, "an aborted stream is still held"
        lost = self.nbytes.keys() - buffered - in_flight.keys() - self.taken.keys() - self.cut_and_out() - self.aborted
        assert not lost, f"items {sorted(lost)} are nowhere"
        assert {item_id: holder for item_id, (holder, _) in self.current.items()} == in_flight
        for item_id, (holder, lease) in self.current.items():
            assert self.core.lifecycle.held(holder, item_id, lease) is not None

    def cut_and_out(self) -> set[int]:
        """Items not buffered (every reader holds or confirmed a piece) but not taken: held
        for their pieces."""
        return {
            item_id for item_id, readers in self.readers.items()
            if len(readers) == READERS and item_id not in self.taken and item_id not in self.buffered()
        }  # fmt: skip

    @invariant()
    def the_buffers_bytes_are_its_items(self) -> None:
        pieces = {item.item_id: item.nbytes for item in self.pieces_in_flight()}
        open_streams = {item_id for item_id, item in self.streams.items() if item.stream is not None}
        held = sum(pieces.get(item_id) or self.nbytes[item_id] for item_id in self.in_flight().keys() - open_streams)
        buffered = sum(item.nbytes for item in self.core.buffer.items())
        waiting_for_pieces = sum(self.nbytes[item_id] for item_id in self.cut_and_out())
        assert self.core.buffer.nbytes == buffered + held + waiting_for_pieces
        # An open stream's bytes are its tokens and its layers so far, held or not.
        streamed = sum(item.nbytes for item in self.streams.values())
        assert self.core.streams.nbytes == streamed

    def pieces_in_flight(self) -> list[BufferedItem]:
        holdings = self.core.lifecycle.holdings.values()
        return [item for holding in holdings for item in holding.items.values() if item.parent]

    @invariant()
    def waiting_requests_are_bounded(self) -> None:
        assert self.core.waiting_count <= MAX_WAITING

    @invariant()
    def every_items_state_says_where_it_is(self) -> None:
        lifecycle = self.core.lifecycle
        for item in lifecycle.buffer.items():
            assert item.state in (ItemState.BUFFERED, ItemState.SPLIT), f"buffered item {item.item_id} is {item.state}"
        for item in lifecycle.streams.items():
            assert item.state is ItemState.OPEN, f"open stream {item.item_id} is {item.state}"
        for peer, holding in lifecycle.holdings.items():
            for item in holding.items.values():
                assert item.state in (ItemState.OUT, ItemState.PIECE, ItemState.READ), f"{item.item_id}: {item.state}"
                assert item.holder == peer
        for item_id in self.taken.keys() - self.parent.keys():
            assert self.records[item_id].state is ItemState.DONE, f"taken item {item_id}"
        for item_id in self.cut_and_out() - self.taken.keys():
            assert self.records[item_id].state is ItemState.PIECES_OUT
        for item_id in self.aborted:
            assert self.records[item_id].state is ItemState.DONE


ItemLifecycle.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_the_item_lifecycle = ItemLifecycle.TestCase
