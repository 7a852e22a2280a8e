"""Head ranges: an item's KV heads cut into pieces for decode ranks of another TP size.

Prefill and decode may shard attention heads differently (prefill TP=2, decode TP=8, or the
reverse). A decode rank asks for `heads=slice(h0, h1)`: the producer cuts those heads out of
the item (`piece_of`, `fill_piece`) and moves only their bytes; a rank whose heads lie with
several producers asks each for its part (`plan_pieces`) and joins the parts (`join_pieces`).

Numbering: a producer told `heads=` (its share of the model's heads) numbers them so, and a
consumer's range is in that numbering; a producer told nothing numbers its own heads from 0.
An item whose value is empty (MLA: one latent per token, the same on every rank) is whole in
every piece.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrt._errors import InvalidInputError
from kvrt._item import KVItem, NewItem, item_from_packed, truncate
from kvrt._item_bytes import ItemBytes
from kvrt._messages import MAX_HEADS, HeadRange
from kvrt._protocol.lookup_buffer import BufferedItem
from kvrt._tensors import Allocate, copy_into, pack_empty


def head_range(heads: object, name: str) -> HeadRange | None:
    """`heads=` as the protocol carries it: a `slice(h0, h1)` of step 1, 0 <= h0 < h1."""
    if heads is None:
        return None
    if (
        not isinstance(heads, slice)
        or not isinstance(heads.start, int)
        or not isinstance(heads.stop, int)
        or heads.step not in (None, 1)
        or not 0 <= heads.start < heads.stop <= MAX_HEADS
    ):
        raise InvalidInputError(
            f"{name} must be None or slice(h0, h1) with 0 <= h0 < h1 <= {MAX_HEADS} (KV heads [h0, h1)), got {heads!r}"
        )
    return HeadRange(heads.start, heads.stop)


def is_latent(value: torch.Tensor) -> bool:
    """Whether an item's KV is one latent per token (MLA): its value is empty."""
    return value.numel() == 0


def check_heads(heads: HeadRange | None, key: torch.Tensor, value: torch.Tensor, *, what: str) -> None:
    """A producer told its heads takes items with that many heads (or latents)."""
    if heads is None or is_latent(value):
        return
    count = heads.end - heads.first
    if key.shape[2] != count or value.shape[2] != count:
        raise InvalidInputError(
            f"{what}: this producer holds heads [{heads.first}, {heads.end}) ({count}), the item has "
            f"{key.shape[2]} key and {value.shape[2]} value heads"
        )


def piece_of(
    record: BufferedItem, item: ItemBytes, heads: HeadRange, hidden: bool, *, item_id: int,
    allocate: Allocate | None,
) -> NewItem:  # fmt: skip
    """A piece of an item (`record`, its bytes `item`): its tokens, roi, the key and value
    heads [first, end) (every head of a latent), and its hidden states if `hidden`; its memory
    allocated, its bytes not written (`fill_piece`). Raises `InvalidInputError` for heads the
    item does not have."""
    key, value = item.key, item.value
    if heads.first >= heads.end:
        raise InvalidInputError(f"heads [{heads.first}, {heads.end}) is empty: a range of heads has first < end")
    first = first_head(item, heads)
    end = key.shape[2] if is_latent(value) else heads.end
    if end > key.shape[2]:
        raise InvalidInputError(
            f"heads [{heads.first}, {heads.end}) asked of an item with {key.shape[2]} KV heads "
            "(in the producer's numbering, from 0)"
        )
    sliced = (key.shape[0], key.shape[1], end - first, key.shape[3])
    value_shape = tuple(value.shape) if is_latent(value) else (*sliced[:3], value.shape[3])
    specs = [
        (item.input_tokens.shape, item.input_tokens.dtype),
        None if item.roi is None else (item.roi.shape, item.roi.dtype),
        (sliced, key.dtype),
        (value_shape, value.dtype),
        None if item.hidden is None or not hidden else (item.hidden.shape, item.hidden.dtype),
    ]
    packed = pack_empty(specs, item.storage.device, allocate)
    return item_from_packed(packed, item_id=item_id, seq=record.seq, masked=record.masked_tokens)


def first_head(item: ItemBytes, heads: HeadRange) -> int:
    """The first of an item's heads a piece of `heads` takes (0 for a latent: it takes all)."""
    return 0 if is_latent(item.value) else heads.first


def fill_piece(piece: ItemBytes, item: ItemBytes, first: int) -> None:
    """Write a piece's bytes from its item's, the piece's heads from the item's head `first` on
    (`first_head`; queued, not waited for, on a GPU)."""
    end = first + piece.key.shape[2]
    copy_into(piece.input_tokens, item.input_tokens)
    if piece.roi is not None and item.roi is not None:
        copy_into(piece.roi, item.roi)
    copy_into(piece.key, item.key[:, :, first:end])
    if is_latent(item.value):
        copy_into(piece.value, item.value)
    else:
        copy_into(piece.value, item.value[:, :, first:end])
    if piece.hidden is not None and item.hidden is not None:
        copy_into(piece.hidden, item.hidden)


# -- the consumer's side ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PiecePlan:
    """One producer's part of a consumer's head range: which link, which of its heads (in its
    numbering), and how many consumers take pieces of its items."""

    link: int
    heads: HeadRange
    readers: int
    hidden: bool


def plan_pieces(
    wanted: HeadRange, held: Sequence[HeadRange | None], readers: Sequence[int]
) -> list[PiecePlan]:
    """Where each head of `wanted` lies among the producers of a consumer (`held`: what each
    was told to hold, in `connect` order), in head order. One producer told nothing holds
    heads from 0; of several, each must have been told (else a head could lie with any)."""
    if len(held) == 1 and held[0] is None:
        return [PiecePlan(0, wanted, readers[0], True)]
    if any(heads is None for heads in held):
        raise InvalidInputError(
            "a head range over several producers needs each producer to say which heads it holds "
            "(kvrt.Producer(..., heads=slice(h0, h1)), its prefill TP rank's share)"
        )
    known = sorted(((heads, index) for index, heads in enumerate(held) if heads is not None), key=lambda p: p[0].first)
    for (before, _), (after, _) in itertools.pairwise(known):
        if after.first < before.end:
            raise InvalidInputError(
                f"producers hold overlapping heads [{before.first}, {before.end}) and [{after.first}, {after.end}): "
                "a head range must have one place to come from"
            )
    plans: list[PiecePlan] = []
    covered = wanted.first
    for heads, index in known:
        first, end = max(wanted.first, heads.first), min(wanted.end, heads.end)
        if first >= end:
            continue
        if first != covered:
            break
        plans.append(PiecePlan(index, HeadRange(first - heads.first, end - heads.first), readers[index], not plans))
        covered = end
    if covered != wanted.end:
        raise InvalidInputError(
            f"heads [{wanted.first}, {wanted.end}) are not all held by the producers this consumer connects to "
            f"(they hold {[(h.first, h.end) for h, _ in known]}; head {covered} is missing)"
        )
    return plans


def join_pieces(pieces: Sequence[KVItem]) -> KVItem:
    """One item from its pieces, in head order: the shortest match, each piece cut to it, their
    heads side by side (latents: the first piece's), the first piece's tokens and hidden states.
    The pieces came from items that match one query, so the KV of their common prefix agrees."""
    if len(pieces) == 1:
        return pieces[0]
    matched = min(piece.matched for piece in pieces)
    cut = [truncate(piece, matched) for piece in pieces]
    first = cut[0]
    if is_latent(first.value):
        key, value = first.key, first.value
    else:
        key = torch.cat([piece.key for piece in cut], dim=2)
        value = torch.cat([piece.value for piece in cut], dim=2)
    hidden = next((piece.hidden for piece in cut if piece.hidden is not None), None)
    return KVItem(first.input_tokens, first.roi, key, value, hidden, matched)



def pieces_agree(pieces: Sequence[KVItem]) -> bool:
    """Whether pieces from several producers are of one request: their tokens (and roi) agree
    up to the shortest match. Pieces matched to one query always do; pieces taken by a query
    of None (each producer's oldest item) may be of different requests."""
    matched = min(piece.matched for piece in pieces)
    cut = [truncate(piece, matched) for piece in pieces]
    first = cut[0]
    return all(
        piece.input_tokens.shape == first.input_tokens.shape
        and torch.equal(piece.input_tokens, first.input_tokens)
        and (piece.roi is None) == (first.roi is None)
        and (piece.roi is None or first.roi is None or torch.equal(piece.roi, first.roi))
        for piece in cut[1:]
    )
