"""A step's lookups as batch requests (`DropSelectMany`): at most `MAX_BATCH` queries and
`BATCH_QUERY_BYTES` of tokens a request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from kvrt import _messages as m
from kvrt._heads import PiecePlan
from kvrt._item import KVBuffers

BATCH_QUERY_BYTES: Final = 32 << 20
"""Most token bytes one drop_select_many request carries (a producer drops messages over 64 MiB)."""


def batches(queries: list[bytes | None]) -> list[list[bytes | None]]:
    """Queries cut into requests of at most `MAX_BATCH` queries and `BATCH_QUERY_BYTES`."""
    cut: list[list[bytes | None]] = []
    size = 0
    for query in queries:
        length = 0 if query is None else len(query)
        if not cut or len(cut[-1]) == m.MAX_BATCH or size + length > BATCH_QUERY_BYTES:
            cut.append([])
            size = 0
        cut[-1].append(query)
        size += length
    return cut


def batch_request(queries: list[bytes | None], plan: PiecePlan | None = None) -> Callable[[int], m.Message]:
    if plan is None:
        return lambda request_id: m.DropSelectMany(request_id=request_id, queries=queries)
    return lambda request_id: m.DropSelectMany(
        request_id=request_id, queries=queries, heads=plan.heads, readers=plan.readers, hidden=plan.hidden
    )


def chunks(buffers: list[KVBuffers | None], cut: list[list[bytes | None]]) -> list[list[KVBuffers | None]]:
    """`buffers` (one per query) cut as the queries are into batches (`cut`)."""
    out, start = [], 0
    for batch in cut:
        out.append(buffers[start : start + len(batch)])
        start += len(batch)
    return out
