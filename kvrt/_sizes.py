"""The bytes a `TensorMeta` describes, without torch: the size arithmetic the protocol core
needs (an open stream's growth, where a packed buffer's tokens end), from each wire dtype's
element size. `kvrt._tensors` builds its torch dtypes from the same names and checks that
torch agrees with these sizes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from kvrt._errors import RemoteProtocolError
from kvrt._messages import TensorMeta

ITEM_BYTES: Final[dict[str, int]] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}
"""Every plain dtype's wire name (quantized ones have no byte view) and the bytes of one
element; a torch that lacks one of them cannot send or receive it (`kvrt._tensors.DTYPES`)."""


def item_bytes(dtype: str) -> int:
    """The bytes of one element of the wire dtype `dtype`; refuses an unknown one."""
    size = ITEM_BYTES.get(dtype)
    if size is None:
        raise RemoteProtocolError(f"unknown dtype {dtype!r} in tensor metadata")
    return size


def shape_nbytes(shape: Sequence[int], dtype: str) -> int:
    """The bytes of a tensor of this shape and wire dtype."""
    return math.prod(shape) * item_bytes(dtype)


def meta_nbytes(meta: TensorMeta) -> int:
    """The bytes of the tensor `meta` describes."""
    return shape_nbytes(meta.shape, meta.dtype)


def meta_end(meta: TensorMeta) -> int:
    """Where the bytes of the tensor `meta` describes end in its packed buffer."""
    return meta.offset + shape_nbytes(meta.shape, meta.dtype)


PACK_ALIGN_BYTES: Final = 64
"""Each tensor of a packed item starts at a multiple of this (a cache line) from the start."""


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Where tensors lie in one packed buffer: a meta each (None stays None), and its size."""

    metas: tuple[TensorMeta | None, ...]
    nbytes: int


def packed_layout(
    specs: Sequence[tuple[Sequence[int], str] | None], element_bytes: Callable[[str], int] = item_bytes
) -> PackedLayout:
    """Tensors of these shapes and dtypes (None stays None) laid out one after the other in
    one packed buffer, each at a multiple of `PACK_ALIGN_BYTES` (see `kvrt._tensors.pack`);
    `element_bytes` gives the size of a dtype's element (a wire dtype's by default)."""
    metas: list[TensorMeta | None] = []
    end = 0
    for spec in specs:
        if spec is None:
            metas.append(None)
            continue
        shape, dtype = spec
        offset = -(-end // PACK_ALIGN_BYTES) * PACK_ALIGN_BYTES
        metas.append(TensorMeta(dtype=dtype, shape=list(shape), offset=offset))
        end = offset + math.prod(shape) * element_bytes(dtype)
    return PackedLayout(tuple(metas), end)
