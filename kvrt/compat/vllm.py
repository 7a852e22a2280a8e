"""`KVLookupBuffer`: vLLM's KV lookup buffer interface (`KVLookupBufferBase`, as its
`SimpleBuffer` implements it) on top of `kvrt.blocking`, for code written against it.

    buffer = KVLookupBuffer("producer", 1e9)                      # prefill: binds
    buffer.insert(input_tokens, roi, key, value, hidden)          # waits while full
    buffer = KVLookupBuffer("consumer", 1e9, endpoint=address)     # decode: connects
    input_tokens, roi, key, value, hidden = buffer.drop_select(input_tokens, roi)
    buffer.close()

What it keeps of the seed: the surface (`insert`, a blocking `drop_select` answering at once
with five tensors, five `None`s on a miss, `close`), the fields its tests read
(`buffer_size`: the bytes of the five tensors as they were given, summed over the items
buffered; `len(buffer)` and `len(buffer.buffer)`: the items buffered; `buffer_size_threshold`),
what `insert` accepts (key, value and hidden of any shape and dtype, tokens of any dtype),
and its matching (each side's roi applied, then a common prefix). What kvrt changes: the
longest match wins (then the oldest), not the first found; tokens compare by exact value
(int32 1 matches int64 1 and float 1.0; a float that is not integral by its float64
value), not `allclose`; `insert` waits without polling; `close` ends the other side's
calls with an error instead of waiting for it; the roi may be None (every token).

How an item travels: kvrt's own items are `[layers, tokens, heads, head_dim]` KV. A seed
item of T tokens is carried as kvrt item with the tokens as int64 lookup keys, the roi as a
bool mask, as `key` one uint8 block `[1, T, 1, W]` holding a header (what was given: dtypes,
shapes) and then the given tokens, key, value and hidden, and as `value` an empty
`[1, T, 0, S]` whose last size S is the seed's byte count of the item, read on the host.
`buffer_size_thresh` is kvrt's `buffer_bytes`: the limit counts the items as kvrt holds
them, a little more than the seed counts (the int64 keys, the header, alignment).

What is not given is read from the `KVRT_*` variables (`kvrt._settings`): `KVRT_BIND` or
`KVRT_CONNECT` for a missing `endpoint`, `KVRT_DEVICE`, `KVRT_HEARTBEAT_S`, the CURVE files.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sized
from types import TracebackType
from typing import Any, Final, Literal, Self

import msgspec
import torch

from kvrt import blocking
from kvrt._errors import InvalidInputError
from kvrt._item import KVItem
from kvrt._messages import TensorMeta
from kvrt._producer import Producer
from kvrt._settings import consumer_settings, producer_settings
from kvrt._tensors import DTYPES, dtype_name

Role = Literal["producer", "consumer"]

_ALIGN_BYTES: Final = 16
"""Each part of the block starts at a multiple of this (every dtype's item size)."""
_LENGTH = struct.Struct("<Q")
"""The header's length, last in the block."""
_LAST_READ_BYTES: Final = 512
"""Bytes at the end of a block read first on the consumer (a GPU block: one copy to the
host), enough for the header of tensors of a dozen dimensions; a longer one is read again."""
_INTEGRAL_LIMIT: Final = float(2**62)
"""Floats below this magnitude that are integral compare as the integer they are."""


class _Layout(msgspec.Struct, frozen=True, array_like=True):
    """Where the given tensors are in the block, and what they were (dtype, shape)."""

    tokens: TensorMeta
    roi_shape: list[int] | None
    key: TensorMeta
    value: TensorMeta
    hidden: TensorMeta | None


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_Layout).decode


class _Buffered(Sized):
    """`buffer.buffer` as the seed's tests read it: its length is the items buffered."""

    def __init__(self, owner: KVLookupBuffer) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return len(self._owner)


class KVLookupBuffer:
    """vLLM's `KVLookupBufferBase` over kvrt (see the module docstring).

    `role` "producer" binds `endpoint` (default "tcp://127.0.0.1:0"; `endpoint` is then the
    address bound), "consumer" connects to the producer's `endpoint`. `buffer_size_thresh`:
    `insert` waits while the buffer holds more bytes than this. `options` go to
    `kvrt.blocking.Producer` or `Consumer` (`device`, `heartbeat_s`, `curve`, `transport`, ...),
    over the `KVRT_*` variables of the environment.
    Calls may come from any thread, several at once.
    """

    def __init__(self, role: str, buffer_size_thresh: float, *, endpoint: str | None = None, **options: Any) -> None:
        if role not in ("producer", "consumer"):
            raise InvalidInputError(f"role must be 'producer' (binds) or 'consumer' (connects), got {role!r}")
        if not isinstance(buffer_size_thresh, int | float) or not buffer_size_thresh >= 0:
            raise InvalidInputError(f"buffer_size_thresh must be a number of bytes >= 0, got {buffer_size_thresh!r}")
        for taken in ("bind", "connect", "buffer_bytes"):
            if taken in options:
                raise InvalidInputError(f"{taken}= is set by endpoint and buffer_size_thresh here; leave it out")
        self.role: Role = "producer" if role == "producer" else "consumer"
        self.buffer_size_threshold = buffer_size_thresh
        self._producer: blocking.Producer | None = None
        self._consumer: blocking.Consumer | None = None
        if self.role == "producer":
            settings = producer_settings(**options)
            settings.pop("buffer_bytes", None)  # buffer_size_thresh says it
            bind = endpoint or settings.pop("bind", "tcp://127.0.0.1:0")
            settings.pop("bind", None)
            limit = max(1, math.ceil(buffer_size_thresh)) if math.isfinite(buffer_size_thresh) else 1 << 62
            self._producer = blocking.Producer(bind, buffer_bytes=limit, **settings)
            self.endpoint: str = self._producer.endpoint
        else:
            settings = consumer_settings(**options)
            connect = endpoint or settings.pop("connect", None)
            settings.pop("connect", None)
            if connect is None:
                raise InvalidInputError(
                    "a consumer needs endpoint= (or KVRT_CONNECT): the address its producer bound, tcp://HOST:PORT"
                )
            self._consumer = blocking.Consumer(connect, **settings)
            self.endpoint = connect if isinstance(connect, str) else ",".join(connect)
        self.buffer: Sized = _Buffered(self)

    # -- the seed's surface -----------------------------------------------------------

    def insert(
        self,
        input_tokens: torch.Tensor,
        roi: torch.Tensor | None,
        key: torch.Tensor,
        value: torch.Tensor,
        hidden: torch.Tensor | None,
    ) -> None:
        """Buffer one request's KV (copied before this returns). Waits, without polling,
        while the buffer holds more than `buffer_size_threshold` bytes, until a consumer
        takes something or this buffer closes (`kvrt.ClosedError`). Producer role only."""
        if self._producer is None:
            raise InvalidInputError("insert is for the producer role; this buffer is a consumer")
        tokens = _checked_tokens(input_tokens, "insert")
        mask = _mask(roi, tokens, "insert")
        for name, tensor in (("key", key), ("value", value), ("hidden", hidden)):
            if not isinstance(tensor, torch.Tensor) and not (name == "hidden" and tensor is None):
                raise InvalidInputError(f"insert: {name} must be a tensor, got {type(tensor).__name__}")
        block, seed_bytes = _block(input_tokens, roi, key, value, hidden)
        count = tokens.numel()
        carried = block.view(1, count, 1, -1)
        sized = torch.empty((1, count, 0, seed_bytes), dtype=torch.uint8, device=block.device)
        self._producer.insert(_lookup_tokens(tokens), mask, carried, sized, None)

    def drop_select(
        self, input_tokens: torch.Tensor | None, roi: torch.Tensor | None
    ) -> list[torch.Tensor | None]:
        """Take the buffered item that matches best: `[input_tokens, roi, key, value, hidden]`
        as they were inserted (roi as a bool mask), or five `None`s if none matches now.
        `input_tokens` None takes the oldest item. Consumer role only."""
        if self._consumer is None:
            raise InvalidInputError("drop_select is for the consumer role; this buffer is a producer")
        if input_tokens is None:
            if roi is not None:
                raise InvalidInputError("drop_select: roi was given without input_tokens")
            item = self._consumer.drop_select(None, None, timeout=0.0)
        else:
            tokens = _checked_tokens(input_tokens, "drop_select")
            item = self._consumer.drop_select(_lookup_tokens(tokens), _mask(roi, tokens, "drop_select"), timeout=0.0)
        if item is None:
            return [None, None, None, None, None]
        return _given(item)

    def close(self) -> None:
        """Stop: every call still waiting on either side ends with an error, at once."""
        for side in (self._producer, self._consumer):
            if side is not None:
                side.close()

    # -- the seed's fields -------------------------------------------------------------

    @property
    def buffer_size(self) -> int:
        """The bytes of the buffered items' five tensors as they were given (0 on a consumer)."""
        if self._producer is None:
            return 0
        service = self._producer._service
        return self._producer._read(lambda: _held_seed_bytes(service))

    def __len__(self) -> int:
        """The items buffered (0 on a consumer)."""
        return 0 if self._producer is None else self._producer.stats().items

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _checked_tokens(tokens: object, what: str) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor) or tokens.is_complex():
        raise InvalidInputError(f"{what}: input_tokens must be a real or integer tensor, got {type(tokens).__name__}")
    flat = tokens.detach().reshape(-1)
    if flat.numel() == 0:
        raise InvalidInputError(f"{what}: input_tokens is empty; an item needs at least one token")
    return flat


def _mask(roi: object, tokens: torch.Tensor, what: str) -> torch.Tensor | None:
    """The roi as kvrt's 1-D bool mask (a float roi as the seed reads it: > 0.5)."""
    if roi is None:
        return None
    if not isinstance(roi, torch.Tensor) or roi.numel() != tokens.numel():
        raise InvalidInputError(f"{what}: roi must be None or a tensor with one entry per token ({tokens.numel()})")
    flat = roi.detach().reshape(-1)
    return flat if flat.dtype == torch.bool else flat > 0.5


def _lookup_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """Tokens as int64 keys that compare by value: integers as they are, a float that is
    integral as that integer, any other float by the bits of its float64 value."""
    if not tokens.is_floating_point():
        return tokens.to(torch.int64)
    wide = tokens.to(torch.float64) + 0.0  # -0.0 becomes 0.0
    integral = (wide == wide.round()) & (wide.abs() < _INTEGRAL_LIMIT)
    return torch.where(integral, wide.nan_to_num(0.0).clamp(-_INTEGRAL_LIMIT, _INTEGRAL_LIMIT).to(torch.int64),
                       wide.view(torch.int64))  # fmt: skip


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.element_size() * tensor.numel()


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN_BYTES) * _ALIGN_BYTES


def _block(
    input_tokens: torch.Tensor,
    roi: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor | None,
) -> tuple[torch.Tensor, int]:
    """The block carrying what was given, on key's device, its size a multiple of the token
    count: the given tokens, key, value and hidden, then zeros, then the header that says
    where they are and what they were, then the header's length in the last 8 bytes. And the
    seed's byte count of the item."""
    given = [input_tokens, key, value, hidden]
    metas: list[TensorMeta | None] = []
    end = 0
    for tensor in given:
        if tensor is None:
            metas.append(None)
            continue
        metas.append(TensorMeta(dtype_name(tensor.dtype), list(tensor.shape), end))
        end = _aligned(end + _nbytes(tensor))
    tokens_meta, key_meta, value_meta, hidden_meta = metas
    assert tokens_meta is not None and key_meta is not None and value_meta is not None
    layout = _Layout(tokens_meta, None if roi is None else list(roi.shape), key_meta, value_meta, hidden_meta)
    trailer = _encode(layout)
    trailer += _LENGTH.pack(len(trailer))
    count = input_tokens.numel()
    total = -(-(end + len(trailer)) // count) * count
    block = torch.zeros(total, dtype=torch.uint8, device=key.device)
    block[total - len(trailer) :].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
    for tensor, meta in zip(given, metas, strict=True):
        if tensor is not None and meta is not None:
            block[meta.offset : meta.offset + _nbytes(tensor)].copy_(_bytes_of(tensor))
    seed_bytes = sum(_nbytes(tensor) for tensor in (input_tokens, roi, key, value, hidden))
    return block, seed_bytes


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)


def _given(item: KVItem) -> list[torch.Tensor | None]:
    """What was inserted, read back out of a received item's block (its tail, where the
    header is, read to the host in one copy)."""
    block = item.key.reshape(-1)
    tail = block[-_LAST_READ_BYTES:].cpu().numpy().tobytes()
    (length,) = _LENGTH.unpack_from(tail, len(tail) - _LENGTH.size)
    if length + _LENGTH.size > len(tail):
        tail = block[-(length + _LENGTH.size) :].cpu().numpy().tobytes()
    layout = _decode(tail[len(tail) - _LENGTH.size - length : len(tail) - _LENGTH.size])
    roi = None if layout.roi_shape is None or item.roi is None else item.roi.reshape(layout.roi_shape)
    tokens = _view(block, layout.tokens)
    key = _view(block, layout.key)
    value = _view(block, layout.value)
    hidden = None if layout.hidden is None else _view(block, layout.hidden)
    return [tokens, roi, key, value, hidden]


def _held_seed_bytes(producer: Producer) -> int:
    """The seed's byte count of the items `producer` buffers (read on its loop): the last
    size of each item's empty `value` (see the module docstring)."""
    values = (item.metas[3] for item in producer._core.buffer.items())
    return sum(int(value.shape[3]) for value in values if value is not None and len(value.shape) == 4)


def _view(block: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    dtype = DTYPES[meta.dtype]
    count = math.prod(meta.shape)
    part = block[meta.offset : meta.offset + count * dtype.itemsize]
    if part.storage_offset() % dtype.itemsize:  # a received buffer that starts misaligned for it
        part = part.clone()
    return part.view(dtype).reshape(meta.shape)
