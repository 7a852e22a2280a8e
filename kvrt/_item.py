"""What an item is: the five tensors of vLLM's SimpleBuffer, checked once at the API boundary.

Shapes (token axis in capitals):
    input_tokens  [TOKENS]                        integer dtype
    roi           [TOKENS] or None                bool mask; None means every token
    key, value    [layers, TOKENS, heads, head_dim]
    hidden        [TOKENS, hidden] or None
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from kvrt._arguments import seconds
from kvrt._errors import InvalidInputError
from kvrt._item_bytes import ItemBytes, StreamStore
from kvrt._messages import MAX_TOKENS, TOKEN_BYTES, tokens_to_bytes
from kvrt._protocol.lookup_buffer import BufferedItem, StreamRecord
from kvrt._tensors import Packed

_LITTLE_ENDIAN: Final = sys.byteorder == "little"
"""The wire's int64 tokens are little-endian: a native int64 tensor's bytes are them as they are."""

_INTEGER_DTYPES = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
)


@dataclass(frozen=True, slots=True)
class KVItem:
    """One request's KV as `drop_select` returns it; the consumer owns the tensors.

    `matched` is the number of roi-masked tokens the query and the item share (the shorter
    of the two masked lengths). Tensors are on the consumer's device (but for a pull whose
    K and V a transport READ into the pools: there `key` and `value` are meta tensors).
    """

    input_tokens: torch.Tensor
    roi: torch.Tensor | None
    key: torch.Tensor
    value: torch.Tensor
    hidden: torch.Tensor | None
    matched: int


@dataclass(frozen=True, slots=True)
class KVBuffers:
    """Memory of the caller's own that `drop_select(..., into=)` lands an item in.

    Each tensor is contiguous, on the consumer's device, and takes the item's tensor of the
    same name in its leading elements, viewed in the item's shape: of the item's dtype, with
    at least as many elements (a flat staging buffer sized for the longest prompt serves
    every item). The returned `KVItem`'s `key`, `value` (and `hidden`, where given) are those
    views. `hidden` None: an item's hidden states, if it has any, land in memory kvrt
    allocates, as without `into`.
    """

    key: torch.Tensor
    value: torch.Tensor
    hidden: torch.Tensor | None = None


def check_buffers(into: object, device: torch.device, *, what: str) -> KVBuffers | None:
    """`into` as a call takes it: None, or `KVBuffers` kvrt can write on `device`."""
    if into is None:
        return None
    if not isinstance(into, KVBuffers):
        raise InvalidInputError(f"{what}: into must be None or kvrt.KVBuffers(key=, value=, hidden=), got {type(into)}")
    for name in ("key", "value", "hidden"):
        tensor = getattr(into, name)
        if tensor is None and name == "hidden":
            continue
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInputError(f"{what}: into.{name} must be a tensor, got {type(tensor).__name__}")
        if tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index):
            raise InvalidInputError(f"{what}: into.{name} is on {tensor.device}; items land on device {device}")
        _check_data(tensor, f"into.{name}", what)
        if not tensor.is_contiguous():
            raise InvalidInputError(f"{what}: into.{name} must be contiguous (an item lands in its leading elements)")
        if tensor.requires_grad:
            raise InvalidInputError(f"{what}: into.{name} requires grad; pass a tensor kvrt may write (.detach())")
        if tensor.is_neg() or tensor.is_conj():
            # Written through the lazy bit, the memory would hold the item's values negated
            # (or conjugated) for whatever reads it directly.
            raise InvalidInputError(f"{what}: into.{name} is a lazily negated or conjugated view; pass its base")
    check_apart([(f"into.{name}", tensor) for name, tensor in _named(into)], what=what)
    return into


def _named(into: KVBuffers) -> list[tuple[str, torch.Tensor]]:
    named = (("key", into.key), ("value", into.value), ("hidden", into.hidden))
    return [(name, tensor) for name, tensor in named if tensor is not None]


def check_apart(buffers: Sequence[tuple[str, torch.Tensor]], *, what: str) -> None:
    """Refuse buffers of one call that share memory: one item would overwrite another's bytes
    (or its own key its value)."""
    spans = sorted(
        (str(tensor.device), tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes, name)
        for name, tensor in buffers
        if tensor.nbytes
    )
    # Sorted by start, memory is shared somewhere only if it is by two neighbours.
    for (device, _, end, name), (other_device, other_start, _, other) in itertools.pairwise(spans):
        if device == other_device and other_start < end:
            raise InvalidInputError(f"{what}: {name} and {other} share memory; give each its own")


def check_buffers_apart(into: Sequence[KVBuffers | None], *, what: str) -> None:
    """The buffers of a drop_select_many's queries, each its own memory."""
    check_apart(
        [(f"into[{index}].{name}", tensor) for index, buffers in enumerate(into) if buffers is not None
         for name, tensor in _named(buffers)],
        what=what,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Landing:
    """Where a call's items land: one `KVBuffers` (a drop_select) or one per query (None: kvrt's
    own memory), and whether the link copies them there as they land (`copy`), or checks only
    that they fit and leaves the copy to the caller, once it chose among several links or its
    TP group agreed (so that an item given back never overwrote the buffers)."""

    buffers: KVBuffers | Sequence[KVBuffers | None]
    copy: bool = True

    def at(self, index: int) -> KVBuffers | None:
        """The buffers of query `index` (of a drop_select_many's request)."""
        if isinstance(self.buffers, KVBuffers):
            return self.buffers
        return self.buffers[index]


def _pairs(item: KVItem, into: KVBuffers) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    pairs = [("key", item.key, into.key), ("value", item.value, into.value)]
    if item.hidden is not None and into.hidden is not None:
        pairs.append(("hidden", item.hidden, into.hidden))
    return pairs


def check_fit(item: KVItem, into: KVBuffers, *, what: str) -> None:
    """Raise `InvalidInputError` when one of `item`'s tensors does not fit its buffer."""
    for name, tensor, buffer in _pairs(item, into):
        if buffer.dtype != tensor.dtype:
            raise InvalidInputError(
                f"{what}: into.{name} is {buffer.dtype}; the item's {name} is {tensor.dtype}, so it goes back to "
                "the producer"
            )
        if buffer.numel() < tensor.numel():
            raise InvalidInputError(
                f"{what}: into.{name} holds {buffer.numel()} elements; the item's {name} needs {tensor.numel()} "
                f"(shape {tuple(tensor.shape)}), so it goes back to the producer"
            )


def land_in(item: KVItem, into: KVBuffers) -> KVItem:
    """`item` copied into `into` (which it fits: `check_fit`), queued on the current stream on a
    GPU; the returned item's tensors are views of those buffers."""
    landed = {}
    for name, tensor, buffer in _pairs(item, into):
        view = buffer.view(-1)[: tensor.numel()].view(tensor.shape)
        view.copy_(tensor, non_blocking=True)
        if tensor.is_cuda:  # freed once this returns: not reused before the copy read it
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
        landed[name] = view
    return KVItem(
        input_tokens=item.input_tokens,
        roi=item.roi,
        key=landed["key"],
        value=landed["value"],
        hidden=landed.get("hidden", item.hidden),
        matched=item.matched,
    )


def _describe(tensor: object) -> str:
    if isinstance(tensor, torch.Tensor):
        return f"{tensor.dtype} tensor of shape {tuple(tensor.shape)}"
    return type(tensor).__name__


def _check_data(tensor: torch.Tensor, name: str, what: str) -> None:
    """A tensor kvrt can read bytes from: dense, on a real device."""
    if tensor.device.type == "meta":
        raise InvalidInputError(f"{what}: {name} is a meta tensor (it has a shape but no data): pass real tensors")
    if tensor.layout is not torch.strided:
        raise InvalidInputError(f"{what}: {name} has layout {tensor.layout}; pass a dense tensor (.to_dense())")


def check_tokens(input_tokens: object, roi: object, *, what: str) -> int:
    """Check a token sequence and its roi; returns the number of tokens."""
    if (
        not isinstance(input_tokens, torch.Tensor)
        or input_tokens.dim() != 1
        or input_tokens.dtype not in _INTEGER_DTYPES
    ):
        raise InvalidInputError(f"{what}: input_tokens must be a 1-D integer tensor, got {_describe(input_tokens)}")
    _check_data(input_tokens, "input_tokens", what)
    length = input_tokens.shape[0]
    if roi is not None:
        if not isinstance(roi, torch.Tensor) or roi.dtype != torch.bool or roi.dim() != 1:
            raise InvalidInputError(
                f"{what}: roi must be None or a 1-D bool mask, got {_describe(roi)} (convert with `roi > 0.5`)"
            )
        if roi.shape[0] != length:
            raise InvalidInputError(f"{what}: roi has {roi.shape[0]} entries for {length} input tokens")
        _check_data(roi, "roi", what)
    return int(length)


def check_item(input_tokens: object, roi: object, key: object, value: object, hidden: object) -> None:
    """Refuse an item whose tensors disagree with each other, saying which one and why."""
    tokens = check_tokens(input_tokens, roi, what="insert")
    for name, tensor in (("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise InvalidInputError(
                f"insert: {name} must be a 4-D tensor [layers, tokens, heads, head_dim], got {_describe(tensor)}"
            )
        if tensor.shape[1] != tokens:
            raise InvalidInputError(f"insert: {name} has {tensor.shape[1]} tokens on axis 1, input_tokens has {tokens}")
        _check_data(tensor, name, "insert")
    assert isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
    if key.shape[0] != value.shape[0]:
        raise InvalidInputError(f"insert: key has {key.shape[0]} layers, value has {value.shape[0]}")
    if hidden is not None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            raise InvalidInputError(
                f"insert: hidden must be None or a 2-D tensor [tokens, hidden], got {_describe(hidden)}"
            )
        if hidden.shape[0] != tokens:
            raise InvalidInputError(f"insert: hidden has {hidden.shape[0]} tokens on axis 0, input_tokens has {tokens}")
        _check_data(hidden, "hidden", "insert")


def query_bytes(input_tokens: torch.Tensor | None, roi: torch.Tensor | None, *, what: str) -> bytes | None:
    """A lookup's tokens as they travel (roi applied, int64 bytes); None takes the oldest item.
    Refuses bad tokens, a roi without tokens, and more tokens than a request may name."""
    if input_tokens is None:
        if roi is not None:
            raise InvalidInputError(f"{what}: roi was given without input_tokens")
        return None
    check_tokens(input_tokens, roi, what=what)
    if _LITTLE_ENDIAN and roi is None and input_tokens.dtype == torch.int64 and input_tokens.is_cpu:
        # tokens_to_bytes without its no-op conversions (an integer tensor never requires grad)
        query = input_tokens.numpy().tobytes()
    else:
        query = tokens_to_bytes(masked_tokens(input_tokens, roi))
    if len(query) > MAX_TOKENS * TOKEN_BYTES:
        raise InvalidInputError(f"{what}: {len(query) // TOKEN_BYTES} masked tokens is over the limit of {MAX_TOKENS}")
    return query


def check_timeout(timeout: float | None, *, what: str) -> None:
    """A call's `timeout`: None (for ever), or finite seconds >= 0 the protocol can carry."""
    seconds(timeout, f"{what}: timeout", none=True, zero=True)


def masked_tokens(input_tokens: torch.Tensor, roi: torch.Tensor | None) -> np.ndarray:
    """The tokens the roi selects, as int64 on the host (the lookup key)."""
    tokens = input_tokens.detach()
    if roi is not None:
        tokens = tokens[roi.to(tokens.device)]
    return tokens.to(device="cpu", dtype=torch.int64).numpy()


def truncate(item: KVItem, matched_tokens: int) -> KVItem:
    """`item` cut along its token axis to its first `matched_tokens` masked tokens."""
    if item.roi is None:
        length = matched_tokens
    elif matched_tokens == 0:
        length = 0
    else:
        selected = torch.nonzero(item.roi).flatten()
        length = int(selected[matched_tokens - 1]) + 1
    return KVItem(
        input_tokens=item.input_tokens[:length],
        roi=None if item.roi is None else item.roi[:length],
        key=item.key[:, :length],
        value=item.value[:, :length],
        hidden=None if item.hidden is None else item.hidden[:length],
        matched=matched_tokens,
    )


@dataclass(frozen=True, slots=True)
class NewItem:
    """An item just made by the producer's driver: the record its protocol core keeps, and the
    bytes the driver keeps beside it."""

    record: BufferedItem
    bytes: ItemBytes


def item_from_packed(
    packed: Packed, *, item_id: int, seq: int, masked: np.ndarray | None = None,
    segments: list[tuple[int, int]] | None = None,
) -> NewItem:  # fmt: skip
    """An item for the buffer over an already packed and filled buffer (no copy). `masked`:
    its lookup key, if the caller read it already (reading it waits for the device);
    `segments`: the ranges its buffer travels in (None: one transfer)."""
    input_tokens, roi, key, value, hidden = packed.tensors
    assert input_tokens is not None and key is not None and value is not None  # packed from tensors
    record = BufferedItem(
        item_id=item_id,
        seq=seq,
        masked_tokens=masked_tokens(input_tokens, roi) if masked is None else masked,
        metas=packed.metas,
        packed_bytes=int(packed.storage.nbytes),
        segments=[] if segments is None else segments,
    )
    storage = packed.storage
    return NewItem(record, ItemBytes(item_id, storage, input_tokens, roi, key, value, hidden))


def item_from_tokens(packed: Packed, *, item_id: int, seq: int, layers: int) -> NewItem:
    """An open stream's item: its tokens and roi packed; the KV comes layer by layer (`layers`)."""
    input_tokens, roi = packed.tensors
    assert input_tokens is not None
    empty = torch.empty((0, int(input_tokens.numel()), 0, 0))
    record = BufferedItem(
        item_id=item_id,
        seq=seq,
        masked_tokens=masked_tokens(input_tokens, roi),
        metas=(*packed.metas, None, None, None),
        packed_bytes=int(packed.storage.nbytes),
        stream=StreamRecord(layers),
    )
    return NewItem(
        record, ItemBytes(item_id, packed.storage, input_tokens, roi, empty, empty, None, store=StreamStore())
    )
