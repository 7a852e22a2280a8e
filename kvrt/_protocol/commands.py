"""What an operator (or a scheduler) asks a producer outside any delivery: health, stats,
probes, the list of buffered items, evict.

Each is answered at once from the buffer and the counters; none touches a peer's session,
its lease or a waiting request, and only `evict` changes anything (it drops one buffered
item). A request that cannot be answered raises a typed error (`ProtocolError` for tokens
that do not decode, `NotFoundError` for an item that is not buffered), which the producer's
core turns into an `ErrorReply` to the asker alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kvrt import _messages as m
from kvrt._errors import NotFoundError
from kvrt._protocol.lookup_buffer import BufferedItem, LookupBuffer

Command = m.Health | m.Stats | m.Probe | m.ProbeMany | m.ListItems | m.Evict
"""The messages answered here."""


@dataclass(slots=True)
class ProducerCounters:
    """Totals since start, for stats and metrics."""

    inserted_items: int = 0
    inserted_bytes: int = 0
    delivered_items: int = 0
    delivered_bytes: int = 0
    returned_items: int = 0
    evicted_items: int = 0
    expired_items: int = 0
    misses: int = 0
    errors: int = 0

    def totals(self) -> dict[str, int]:
        """Every counter by name (a stats answer's `totals`): read field by field, a tenth of
        `dataclasses.asdict`'s cost, which copies recursively (a peer may ask for stats
        thousands of times a second)."""
        return {name: getattr(self, name) for name in _COUNTER_NAMES}


_COUNTER_NAMES: Final = tuple(field.name for field in dataclasses.fields(ProducerCounters))


@dataclass(frozen=True, slots=True)
class Facts:
    """What health and stats tell of the producer beside its buffer and counters."""

    producer_id: str
    started_at: float
    transports: tuple[str, ...]
    buffer_limit_bytes: int
    peers: int
    waiting_requests: int


def answer(
    command: Command, now: float, buffer: LookupBuffer, counters: ProducerCounters, facts: Callable[[], Facts],
    evict: Callable[[BufferedItem], None],
) -> m.Message:  # fmt: skip
    """The reply to `command` (`facts` is asked for health and stats only; `evict` drops an
    item for `Evict`); raises `ProtocolError` or `NotFoundError` (see the module's docstring)."""
    match command:
        case m.Health(request_id=request_id):
            about = facts()
            uptime = max(0.0, now - about.started_at)
            return m.HealthReply(request_id, about.producer_id, uptime, list(about.transports))
        case m.Stats(request_id=request_id):
            about = facts()
            return m.StatsReply(
                request_id=request_id,
                items=len(buffer),
                buffer_bytes=buffer.nbytes,
                buffer_limit_bytes=about.buffer_limit_bytes,
                in_flight=buffer.held,
                waiting_requests=about.waiting_requests,
                peers=about.peers,
                totals=counters.totals(),
            )
        case m.Probe(request_id=request_id, tokens=tokens):
            found = buffer.held_match(None if tokens is None else m.tokens_from_bytes(tokens))
            if found is None:
                return m.ProbeReply(request_id=request_id, matched=0)
            return m.ProbeReply(request_id, found.matched, found.item.item_id)
        case m.ProbeMany(request_id=request_id, queries=queries):
            decoded = [None if tokens is None else m.tokens_from_bytes(tokens) for tokens in queries]
            answers = []
            for query in decoded:
                found = buffer.held_match(query)
                answers.append(m.Probed(0) if found is None else m.Probed(found.matched, found.item.item_id))
            return m.ProbeManyReply(request_id=request_id, answers=answers)
        case m.ListItems(request_id=request_id, limit=limit):
            items = buffer.items()
            summaries = [
                m.ItemSummary(item.item_id, len(item.masked_tokens), item.nbytes, max(0.0, now - item.inserted_at))
                for item in items[:limit]
            ]
            return m.ItemList(request_id=request_id, items=summaries, total=len(items))
        case m.Evict(request_id=request_id, item_id=item_id):
            item = buffer.get(item_id)
            if item is None:
                raise NotFoundError(f"item {item_id} is not buffered (taken, in flight, evicted, or never inserted)")
            evict(item)
            counters.evicted_items += 1
            return m.Evicted(request_id=request_id, item_id=item_id, nbytes=item.nbytes)
