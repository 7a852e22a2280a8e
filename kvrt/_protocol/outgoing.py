"""What the producer's core gives its driver to send: `Outgoing` messages (naming the items
whose bytes follow them), `Departure`s of peers, and the builders of each delivery's message
from an item's record. No tensor is touched here: the driver reads the bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from kvrt import _messages as m
from kvrt._errors import ErrorCode
from kvrt._protocol.commands import ProducerCounters
from kvrt._protocol.lookup_buffer import BufferedItem
from kvrt._sizes import meta_end


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A message for the driver to send to `peer`, and the record of the item whose bytes
    follow it (the driver keeps the bytes): a Deliver's or a stream start's (for a DeliverMany,
    `items`); for a stream's layer, the open stream that published it or the whole item it is
    a layer of; for a stream's end, the whole item (whose hidden states follow it, if it has
    them)."""

    peer: bytes
    message: m.Message
    item: BufferedItem | None = None
    items: tuple[BufferedItem, ...] = ()
    """A DeliverMany's hits, in order."""


@dataclass(frozen=True, slots=True)
class Departure:
    """A peer that left (bye, silence, a second hello, unreachable)."""

    peer: bytes
    transport: str
    """The transport chosen at its hello."""
    unconfirmed: tuple[BufferedItem, ...]
    """The items in flight to it that it never confirmed (back in the buffer now): a
    transport may still hold something for each on the peer's behalf."""


class Refusals:
    """Error replies, counted by code (for metrics)."""

    def __init__(self, counters: ProducerCounters) -> None:
        self._counters = counters
        self.by_code: dict[str, int] = {}

    def __call__(self, peer: bytes, request_id: int | None, code: ErrorCode, text: str) -> Outgoing:
        self._counters.errors += 1
        self.by_code[code.value] = self.by_code.get(code.value, 0) + 1
        return Outgoing(peer, m.ErrorReply(request_id=request_id, code=code, message=text))


def deliver(peer: bytes, request_id: int, item: BufferedItem, matched: int) -> Outgoing:
    return Outgoing(peer, deliver_message(request_id, item, matched), item)


def deliver_message(request_id: int, item: BufferedItem, matched: int) -> m.Deliver:
    input_tokens, roi, key, value, hidden = item.metas
    assert input_tokens is not None and key is not None and value is not None
    return m.Deliver(
        request_id=request_id,
        item_id=item.item_id,
        matched=matched,
        input_tokens=input_tokens,
        roi=roi,
        key=key,
        value=value,
        hidden=hidden,
        payload_bytes=item.packed_bytes,
        segments=item.segments,
        lease=item.lease,
        checksum=item.checksum,
    )


def hit(item: BufferedItem, matched: int, offset: int) -> m.Hit:
    input_tokens, roi, key, value, hidden = item.metas
    assert input_tokens is not None and key is not None and value is not None
    return m.Hit(
        item.item_id, matched, input_tokens, roi, key, value, hidden, offset, item.packed_bytes, item.lease,
        item.checksum,
    )  # fmt: skip


def whole_as_stream(peer: bytes, request_id: int, item: BufferedItem, matched: int) -> list[Outgoing]:
    """A complete item in flight to `peer` as a stream: start, every layer, end."""
    key, value = item.metas[2], item.metas[3]
    assert key is not None and value is not None
    layers = key.shape[0]
    out = [Outgoing(peer, start_message(request_id, item, matched, layers), item)]
    for layer in range(layers):
        out.append(layer_outgoing(peer, item, layer, _on_its_own(key, drop=1), _on_its_own(value, drop=1)))
    out.append(end_outgoing(peer, item))
    return out


def _on_its_own(meta: m.TensorMeta, *, drop: int = 0) -> m.TensorMeta:
    """The meta of a tensor sent on its own (offset 0 in its own frame), `drop` leading
    dimensions of `meta` taken off (a layer of an item's keys or values)."""
    return m.TensorMeta(dtype=meta.dtype, shape=meta.shape[drop:])


def start_message(request_id: int, item: BufferedItem, matched: int, layers: int) -> m.StreamStart:
    input_tokens, roi = item.metas[0], item.metas[1]
    assert input_tokens is not None
    return m.StreamStart(
        request_id=request_id,
        item_id=item.item_id,
        matched=matched,
        input_tokens=input_tokens,
        roi=roi,
        layers=layers,
        payload_bytes=_tokens_bytes(item),
        lease=item.lease,
    )


def _tokens_bytes(item: BufferedItem) -> int:
    """The bytes of the tokens and roi at the head of an item's packed buffer."""
    return max(meta_end(meta) for meta in item.metas[:2] if meta is not None)


def layer_outgoing(peer: bytes, item: BufferedItem, layer: int, key: m.TensorMeta, value: m.TensorMeta) -> Outgoing:
    """A stream's layer, of an open stream (the driver keeps the layer's tensors and the event
    after which they are written) or of a whole item (written once the item is: known once its
    gathers or its fill were queued)."""
    return Outgoing(peer, m.StreamLayer(item_id=item.item_id, layer=layer, key=key, value=value), item)


def end_outgoing(peer: bytes, whole: BufferedItem) -> Outgoing:
    """A stream's end, with the whole item's hidden states if it has them (`whole`: the item the
    stream is, whose GPU checksums the end carries)."""
    hidden = whole.metas[4]
    if hidden is None:
        return Outgoing(peer, m.StreamEnd(item_id=whole.item_id), whole)
    return Outgoing(peer, m.StreamEnd(item_id=whole.item_id, hidden=_on_its_own(hidden)), whole)


BATCH_SEGMENT_BYTES: Final = 256 << 20
"""A batch's hits under this size share transfers of about this size (packed by the sender: a
transfer's host cost, 0.1-0.15 ms a side on an H200 host, is paid once for many small items);
a larger hit travels alone, straight from its own buffer (no packing copy)."""


def batch_segments(hits: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The transfers of a batch whose hits are at these (offset, nbytes), in order."""
    segments: list[tuple[int, int]] = []
    start = end = None
    for offset, nbytes in hits:
        if nbytes == 0:
            continue
        if nbytes >= BATCH_SEGMENT_BYTES:
            if start is not None and end is not None:
                segments.append((start, end - start))
                start = end = None
            segments.append((offset, nbytes))
            continue
        start = offset if start is None else start
        end = offset + nbytes
        if end - start >= BATCH_SEGMENT_BYTES:
            segments.append((start, end - start))
            start = end = None
    if start is not None and end is not None:
        segments.append((start, end - start))
    return segments
