"""The lookup buffer: vLLM SimpleBuffer's matching, the longest-then-oldest selection, and an
index that stays small."""

from __future__ import annotations

import gc
import random
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvrt._bench.vllm_simple_buffer import SimpleBuffer
from kvrt._item import masked_tokens
from kvrt._protocol.lookup_buffer import BufferedItem, LookupBuffer, prefix_match_length

VOCAB = 4
"""A tiny vocabulary, so that random sequences share prefixes often (and stay far below the
token ids where SimpleBuffer's `allclose` starts to call neighbouring ids equal)."""


def simple_buffer_matched(
    tokens: torch.Tensor, roi: torch.Tensor, query: torch.Tensor | None, query_roi: torch.Tensor
) -> int:
    """SimpleBuffer's `_matches`, as a number (it returns True for a query of None)."""
    result = SimpleBuffer._matches(None, [tokens, roi], [query, query_roi])
    return int(result)


def make_item(buffer: LookupBuffer, tokens: list[int], roi: list[bool] | None = None, nbytes: int = 10) -> BufferedItem:
    """The record of an item of these tokens and roi, whose packed buffer holds `nbytes`."""
    input_tokens = torch.tensor(tokens, dtype=torch.int64)
    roi_tensor = None if roi is None else torch.tensor(roi, dtype=torch.bool)
    return BufferedItem(
        item_id=buffer.next_seq(),
        seq=buffer.next_seq(),
        masked_tokens=masked_tokens(input_tokens, roi_tensor),
        metas=(),
        packed_bytes=nbytes,
    )


def reference_best(items: list[BufferedItem], query: np.ndarray | None) -> tuple[BufferedItem, int] | None:
    """Longest match first, then oldest (a query of None: the oldest), by brute force over every item."""
    if query is None:
        oldest = min(items, key=lambda item: item.seq, default=None)
        return None if oldest is None else (oldest, len(oldest.masked_tokens))
    scored = [(prefix_match_length(item.masked_tokens, query), -item.seq, item) for item in items]
    scored = [entry for entry in scored if entry[0] > 0]
    if not scored:
        return None
    matched, _, item = max(scored, key=lambda entry: (entry[0], entry[1]))
    return item, matched


sequences = st.lists(st.integers(0, VOCAB - 1), max_size=12)


@st.composite
def tokens_and_roi(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = draw(sequences)
    roi = draw(st.lists(st.booleans(), min_size=len(tokens), max_size=len(tokens)))
    return torch.tensor(tokens, dtype=torch.int64), torch.tensor(roi, dtype=torch.bool)


@settings(max_examples=2000, deadline=None)
@given(item=tokens_and_roi(), query=tokens_and_roi())
def test_matched_length_equals_simple_buffers_on_random_pairs(
    item: tuple[torch.Tensor, torch.Tensor], query: tuple[torch.Tensor, torch.Tensor]
) -> None:
    expected = simple_buffer_matched(item[0], item[1], query[0], query[1])
    assert prefix_match_length(masked_tokens(*item), masked_tokens(*query)) == expected


@settings(max_examples=200, deadline=None)
@given(item=tokens_and_roi())
def test_a_query_of_none_matches_every_item_as_in_simple_buffer(item: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert simple_buffer_matched(item[0], item[1], None, torch.ones(0, dtype=torch.bool)) == 1
    assert prefix_match_length(masked_tokens(*item), None) == int(item[1].sum())


@settings(max_examples=500, deadline=None)
@given(items=st.lists(tokens_and_roi(), max_size=12), query=tokens_and_roi())
def test_selection_is_the_longest_simple_buffer_match_then_the_oldest(
    items: list[tuple[torch.Tensor, torch.Tensor]], query: tuple[torch.Tensor, torch.Tensor]
) -> None:
    buffer = LookupBuffer()
    inserted = []
    for tokens, roi in items:
        item = make_item(buffer, tokens.tolist(), roi.tolist())
        buffer.add(item)
        inserted.append((item, simple_buffer_matched(tokens, roi, query[0], query[1])))
    matching = [(matched, -item.seq, item) for item, matched in inserted if matched > 0]
    found = buffer.best_match(masked_tokens(*query))
    if not matching:
        assert found is None
    else:
        matched, _, expected = max(matching, key=lambda entry: (entry[0], entry[1]))
        assert found is not None
        assert (found.item, found.matched) == (expected, matched)


def test_the_oldest_item_wins_a_tie_and_none_takes_the_oldest() -> None:
    buffer = LookupBuffer()
    first, second = make_item(buffer, [1, 2, 3]), make_item(buffer, [1, 2, 3])
    buffer.add(first)
    buffer.add(second)
    assert buffer.best_match(np.array([1, 2, 3])) == buffer.best_match(None)
    found = buffer.best_match(np.array([1, 2]))
    assert found is not None and found.item is first and found.matched == 2


def test_an_item_given_back_keeps_its_age() -> None:
    buffer = LookupBuffer()
    old, new = make_item(buffer, [5, 6]), make_item(buffer, [5, 6])
    buffer.add(old)
    buffer.add(new)
    buffer.take(old)
    found = buffer.best_match(np.array([5, 6]))
    assert found is not None and found.item is new
    buffer.restore(old)
    found = buffer.best_match(np.array([5, 6]))
    assert found is not None and found.item is old


def test_bytes_count_until_a_taken_item_is_forgotten() -> None:
    buffer = LookupBuffer()
    item = make_item(buffer, [1], nbytes=100)
    buffer.add(item)
    buffer.take(item)
    assert (len(buffer), buffer.nbytes, buffer.held) == (0, 100, 1)
    buffer.forget(item)
    assert (len(buffer), buffer.nbytes, buffer.held) == (0, 0, 0)


@pytest.mark.parametrize("how", ["delivered", "dropped"])
def test_an_item_gone_from_the_buffer_is_not_kept_alive_by_its_index(how: str) -> None:
    # Removal from the index is lazy; a stale entry must not hold the item's record (and so
    # its bytes: a GPU item's are gigabytes) until the next compaction.
    buffer = LookupBuffer()
    for tokens in ([1, 2], [1, 3], [2]):
        item = make_item(buffer, tokens)
        buffer.add(item)
        alive = weakref.ref(item)
        if how == "delivered":
            buffer.take(item)
            buffer.forget(item)
        else:
            buffer.drop(item)
        del item
        gc.collect()
        assert alive() is None
        assert buffer.best_match(np.array(tokens)) is None


def test_an_empty_query_or_an_item_with_no_masked_tokens_never_matches() -> None:
    buffer = LookupBuffer()
    buffer.add(make_item(buffer, [1, 2], roi=[False, False]))
    assert buffer.best_match(np.array([1, 2])) is None
    buffer.add(make_item(buffer, [1, 2]))
    assert buffer.best_match(np.array([], dtype=np.int64)) is None


def test_the_index_shrinks_back_to_nothing_when_emptied_newest_first() -> None:
    buffer = LookupBuffer()
    rng = random.Random(0)
    items = [make_item(buffer, [rng.randrange(50) for _ in range(rng.randrange(1, 30))]) for _ in range(2000)]
    for item in items:
        buffer.add(item)
    for item in reversed(items):
        buffer.take(item)
        buffer.forget(item)
    root = buffer._index._root
    assert root.children == {}
    assert len(root.subtree.entries) <= 16
    assert buffer.nbytes == 0


class BufferMachine(RuleBasedStateMachine):
    """Random adds, takes, restores and drops: the index always agrees with brute force."""

    @initialize()
    def start(self) -> None:
        self.buffer = LookupBuffer()
        self.buffered: list[BufferedItem] = []
        self.held: list[BufferedItem] = []

    @rule(tokens=sequences)
    def add(self, tokens: list[int]) -> None:
        item = make_item(self.buffer, tokens)
        self.buffer.add(item)
        self.buffered.append(item)

    @rule(query=st.none() | sequences)
    def take_best(self, query: list[int] | None) -> None:
        array = None if query is None else np.array(query, dtype=np.int64)
        found = self.buffer.best_match(array)
        expected = reference_best(self.buffered, array)
        if expected is None:
            assert found is None
            return
        assert found is not None and (found.item, found.matched) == expected
        self.buffer.take(found.item)
        self.buffered.remove(found.item)
        self.held.append(found.item)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), give_back=st.booleans())
    def settle_a_held_item(self, data: st.DataObject, give_back: bool) -> None:
        item = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        if give_back:
            self.buffer.restore(item)
            self.buffered.append(item)
        else:
            self.buffer.forget(item)

    @precondition(lambda self: self.buffered)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        item = self.buffered.pop(data.draw(st.integers(0, len(self.buffered) - 1)))
        self.buffer.drop(item)

    @invariant()
    def accounting_matches(self) -> None:
        assert len(self.buffer) == len(self.buffered)
        assert self.buffer.held == len(self.held)
        assert self.buffer.nbytes == sum(item.nbytes for item in self.buffered + self.held)


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("count", [10, 10_000])
def test_a_lookup_walks_one_path_whatever_the_number_of_items(count: int) -> None:
    """Structural, not timed: the nodes a lookup visits depend on the query, not on `count`."""
    buffer = LookupBuffer()
    rng = np.random.default_rng(0)
    items = [make_item(buffer, rng.integers(0, 32000, 256).tolist()) for _ in range(count)]
    for item in items:
        buffer.add(item)
    visited = 0
    original = buffer._index._root.children.__class__.get

    class CountingDict(dict[int, object]):
        def get(self, key: int, default: object = None) -> object:  # type: ignore[override]
            nonlocal visited
            visited += 1
            return original(self, key, default)

    def instrument(node: object) -> None:
        node.children = CountingDict(node.children)  # type: ignore[attr-defined]
        for child in node.children.values():  # type: ignore[attr-defined]
            instrument(child)

    instrument(buffer._index._root)
    found = buffer.best_match(items[-1].masked_tokens)
    assert found is not None and found.item is items[-1]
    assert visited <= 3  # root → (branch on the first token) → leaf
