"""What the producer's core gives its driver to send: `Outgoing` messages (with the items or
tensors whose bytes follow them), `Departure`s of peers, and the builders of each delivery's
message from an item's record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from kvrt import _messages as m
from kvrt._buffer import BufferedItem
from kvrt._errors import ErrorCode
from kvrt._protocol.commands import ProducerCounters
from kvrt._tensors import meta_end, tensor_meta


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A message for the driver to send to `peer`; for a Deliver or a stream's start, `item`
    holds the payload (for a DeliverMany, `items`); a stream's layers and end carry their
    tensors in `tensors` (and, when they are a whole item's, that item in `item`)."""

    peer: bytes
    message: m.Message
    item: BufferedItem | None = None
    tensors: tuple[torch.Tensor, ...] = ()
    ready: torch.cuda.Event | None = None
    """GPU: the event after which `tensors` hold their bytes (a send waits on it)."""
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
        payload_bytes=item.nbytes,
        segments=item.segments,
        lease=item.lease,
    )


def hit(item: BufferedItem, matched: int, offset: int) -> m.Hit:
    input_tokens, roi, key, value, hidden = item.metas
    assert input_tokens is not None and key is not None and value is not None
    return m.Hit(item.item_id, matched, input_tokens, roi, key, value, hidden, offset, item.nbytes, item.lease)


def whole_as_stream(peer: bytes, request_id: int, item: BufferedItem, matched: int) -> list[Outgoing]:
    """A complete item in flight to `peer` as a stream: start, every layer, end."""
    layers = item.key.shape[0]
    out = [Outgoing(peer, start_message(request_id, item, matched, layers), item)]
    for layer in range(layers):
        out.append(layer_outgoing(peer, item.item_id, layer, item.key[layer], item.value[layer], whole=item))
    out.append(end_outgoing(peer, item))
    return out


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


def layer_outgoing(
    peer: bytes, item_id: int, layer: int, key: torch.Tensor, value: torch.Tensor,
    ready: torch.cuda.Event | None = None, *, whole: BufferedItem | None = None,
) -> Outgoing:  # fmt: skip
    """A stream's layer: an open stream's (GPU: written once `ready` fired), or a layer of a
    `whole` item (then `item`: the driver waits for the item's storage, `BufferedItem.written`,
    known once its gathers or its fill were queued)."""
    message = m.StreamLayer(item_id=item_id, layer=layer, key=tensor_meta(key), value=tensor_meta(value))
    return Outgoing(peer, message, whole, tensors=(key, value), ready=ready)


def end_outgoing(peer: bytes, whole: BufferedItem) -> Outgoing:
    """A stream's end, with the whole item's hidden states if it has them (`item` as for a layer)."""
    if whole.hidden is None:
        return Outgoing(peer, m.StreamEnd(item_id=whole.item_id))
    end = m.StreamEnd(item_id=whole.item_id, hidden=tensor_meta(whole.hidden))
    return Outgoing(peer, end, whole, tensors=(whole.hidden,))


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
