"""Tensors on the wire: every dtype bit for bit, odd shapes, and metadata that lies."""

from __future__ import annotations

import pytest
import torch

from kvrt._errors import RemoteProtocolError
from kvrt._messages import TensorMeta
from kvrt._tensors import DTYPES, tensor_bytes, tensor_from_buffer, tensor_meta


def random_bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` whose bytes are random (NaN patterns included)."""
    count = 1
    for size in shape:
        count *= size
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)


def through_the_wire(tensor: torch.Tensor) -> torch.Tensor:
    meta = tensor_meta(tensor)
    frame = bytearray(tensor_bytes(tensor))  # what the socket hands the other side: its own copy
    return tensor_from_buffer(meta, memoryview(frame))


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_arrives_bit_for_bit(name: str) -> None:
    dtype = DTYPES[name]
    tensor = random_bits((3, 5, 2), dtype)
    received = through_the_wire(tensor)
    assert received.dtype == dtype and received.shape == tensor.shape
    assert torch.equal(received.view(torch.uint8), tensor.view(torch.uint8))


def test_the_dtypes_kvrt_promises_are_all_on_the_wire() -> None:
    assert {"bool", "bfloat16", "float16", "float32", "int64", "uint8", "float8_e4m3fn", "float8_e5m2"} <= set(DTYPES)


@pytest.mark.parametrize("shape", [(0,), (4, 0, 3), ()], ids=["empty", "empty-middle", "scalar"])
def test_empty_and_scalar_tensors_keep_their_shape(shape: tuple[int, ...]) -> None:
    tensor = torch.arange(max(1, len(shape)), dtype=torch.float32).reshape(-1)[: 1 if not shape else 0].reshape(shape)
    received = through_the_wire(tensor)
    assert received.shape == tensor.shape and torch.equal(received, tensor)


def test_a_non_contiguous_tensor_arrives_with_its_logical_values() -> None:
    tensor = torch.arange(24, dtype=torch.float16).view(2, 3, 4).transpose(0, 2)
    assert not tensor.is_contiguous()
    assert torch.equal(through_the_wire(tensor), tensor)


def test_a_frame_at_an_odd_address_still_yields_the_right_values() -> None:
    tensor = torch.arange(7, dtype=torch.float64)
    storage = bytearray(1 + tensor.nbytes)
    storage[1:] = bytes(tensor_bytes(tensor))
    received = tensor_from_buffer(tensor_meta(tensor), memoryview(storage)[1:])
    assert torch.equal(received, tensor)


def test_metadata_that_disagrees_with_the_frame_size_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match=r"needs 24 bytes, its frame has 16"):
        tensor_from_buffer(TensorMeta("float32", [2, 3]), memoryview(bytearray(16)))


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="unknown dtype 'float7'"):
        tensor_from_buffer(TensorMeta("float7", [1]), memoryview(bytearray(1)))
