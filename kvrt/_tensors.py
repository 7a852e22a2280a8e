"""Tensors on the wire: dtype names, metadata, and raw bytes in and out of frames.

Every dtype whose elements can be viewed as bytes travels (bool, bfloat16 and the fp8
types too): a tensor is sent as its contiguous bytes with `TensorMeta(dtype, shape)`
beside it, and rebuilt on the other side over the received buffer, without a copy.
Metadata that disagrees with the bytes is refused before any tensor is built.
"""

from __future__ import annotations

import math
from typing import Final

import torch

from kvrt._errors import RemoteProtocolError
from kvrt._messages import TensorMeta

_WIRE_DTYPE_NAMES: Final = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
"""Every plain dtype (quantized ones have no byte view); those this torch lacks are skipped."""


def _wire_dtypes() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {}
    for name in _WIRE_DTYPE_NAMES:
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            table[str(dtype).removeprefix("torch.")] = dtype
    return table


DTYPES: Final[dict[str, torch.dtype]] = _wire_dtypes()
"""Wire name → dtype, for every dtype that can travel."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(dtype=dtype_name(tensor.dtype), shape=list(tensor.shape))


def meta_nbytes(meta: TensorMeta) -> int:
    """Bytes the tensor described by `meta` occupies; refuses an unknown dtype."""
    return math.prod(meta.shape) * _dtype_of(meta).itemsize


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is a contiguous CPU tensor."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def tensor_from_buffer(meta: TensorMeta, buffer: memoryview) -> torch.Tensor:
    """The tensor described by `meta` over `buffer` (no copy unless misaligned for its dtype)."""
    dtype = _dtype_of(meta)
    expected = math.prod(meta.shape) * dtype.itemsize
    if buffer.nbytes != expected:
        raise RemoteProtocolError(
            f"tensor {meta.dtype}{list(meta.shape)} needs {expected} bytes, its frame has {buffer.nbytes}"
        )
    if expected == 0:
        return torch.empty(meta.shape, dtype=dtype)
    flat = torch.frombuffer(buffer, dtype=dtype)
    if flat.data_ptr() % dtype.itemsize:
        flat = flat.clone()  # small frames may sit unaligned inside a shared receive buffer
    return flat if len(meta.shape) == 1 else flat.view(meta.shape)


def _dtype_of(meta: TensorMeta) -> torch.dtype:
    dtype = DTYPES.get(meta.dtype)
    if dtype is None:
        raise RemoteProtocolError(f"unknown dtype {meta.dtype!r} in tensor metadata")
    return dtype
