"""Tensor parallelism on both sides: which KV heads each rank holds, which prefill ranks
publish, and which pieces each decode rank reads from which of them. Pure functions of the
model's KV head count and the two TP sizes, so that every rank of either instance works out
the same plan alone, with no message.

vLLM shards a model's H KV heads over TP ranks: rank r of P holds heads [r*H/P, (r+1)*H/P)
when H >= P; when P > H each head is replicated on P/H consecutive ranks (rank r holds head
r*H//P). MLA's one latent per token is the same on every rank.

    prefill TP=P, decode TP=D, H heads      decode rank r reads
    P == D                                  its own heads from prefill rank r
    D > P (1 -> 2, 2 -> 4)                  its heads from the one prefill rank holding them
    P > D (2 -> 1)                          a piece from each prefill rank holding some of its heads
    MLA                                     the latent from prefill rank 0 (the only one publishing)

Where heads are replicated only the first rank holding a head publishes it (the others' items
would never be read). An item of a prefill rank waits until each decode rank that reads from
it took its piece (`readers`).
"""

from __future__ import annotations

from dataclasses import dataclass


def heads_of(rank: int, tp: int, total_heads: int) -> slice:
    """The model's KV heads that rank `rank` of `tp` holds."""
    if total_heads >= tp:
        return slice(rank * total_heads // tp, (rank + 1) * total_heads // tp)
    head = rank * total_heads // tp
    return slice(head, head + 1)


def publishes(rank: int, tp: int, total_heads: int, *, mla: bool) -> bool:
    """Whether prefill rank `rank` publishes its KV: the first holder of its heads (rank 0 for MLA)."""
    if mla:
        return rank == 0
    return rank == 0 or heads_of(rank - 1, tp, total_heads) != heads_of(rank, tp, total_heads)


@dataclass(frozen=True, slots=True)
class Piece:
    """What a decode rank reads from one prefill rank: heads in the model's numbering (None: the
    whole item, a latent), and how many decode ranks read that prefill rank's items."""

    prefill_rank: int
    heads: slice | None
    readers: int


def _sources(
    decode_rank: int, decode_tp: int, prefill_tp: int, total_heads: int, *, mla: bool
) -> list[tuple[int, slice]]:
    """The prefill ranks decode rank `decode_rank` reads from, and which of its heads each has."""
    if mla:
        return [(0, slice(0, 1))]
    wanted = heads_of(decode_rank, decode_tp, total_heads)
    sources = []
    for rank in range(prefill_tp):
        if not publishes(rank, prefill_tp, total_heads, mla=False):
            continue
        held = heads_of(rank, prefill_tp, total_heads)
        first, end = max(wanted.start, held.start), min(wanted.stop, held.stop)
        if first < end:
            sources.append((rank, slice(first, end)))
    return sources


def pieces_for(decode_rank: int, decode_tp: int, prefill_tp: int, total_heads: int, *, mla: bool) -> list[Piece]:
    """The pieces decode rank `decode_rank` reads, in head order: together its heads."""
    readers = [0] * prefill_tp
    for rank in range(decode_tp):
        for source, _ in _sources(rank, decode_tp, prefill_tp, total_heads, mla=mla):
            readers[source] += 1
    pieces = []
    for source, heads in _sources(decode_rank, decode_tp, prefill_tp, total_heads, mla=mla):
        whole = readers[source] == 1 and (mla or heads == heads_of(source, prefill_tp, total_heads))
        pieces.append(Piece(source, None if whole else heads, readers[source]))
    return pieces
