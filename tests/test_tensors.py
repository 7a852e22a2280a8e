"""Tensors on the wire: packed into one buffer, every dtype bit for bit, and metadata that lies."""

from __future__ import annotations

import pytest
import torch

from kvrt._errors import RemoteProtocolError
from kvrt._messages import TensorMeta
from kvrt._tensors import DTYPES, PACK_ALIGN_BYTES, pack, tensor_bytes, unpack

CPU = torch.device("cpu")


def random_bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` whose bytes are random (NaN patterns included)."""
    count = 1
    for size in shape:
        count *= size
    raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)


def through_the_wire(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    packed = pack(tensors, CPU)
    frame = bytearray(tensor_bytes(packed.storage))  # what the socket hands the other side: its own copy
    return unpack(packed.metas, memoryview(frame))


def same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return (
        a is not None
        and a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(tensor_bytes(a)) == bytes(tensor_bytes(b.contiguous()))
    )


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_arrives_bit_for_bit(name: str) -> None:
    tensor = random_bits((3, 5, 2), DTYPES[name])
    (received,) = through_the_wire(tensor)
    assert same_bits(received, tensor)


def test_the_dtypes_kvrt_promises_are_all_on_the_wire() -> None:
    assert {"bool", "bfloat16", "float16", "float32", "int64", "uint8", "float8_e4m3fn", "float8_e5m2"} <= set(DTYPES)


def test_five_tensors_of_mixed_dtypes_pack_at_aligned_offsets_and_come_back() -> None:
    tensors = (
        torch.arange(7),
        torch.tensor([True, False, True, True, False, True, False]),
        random_bits((2, 7, 3, 5), torch.bfloat16),
        random_bits((2, 7, 3, 5), torch.float16),
        None,
    )
    packed = pack(tensors, CPU)
    offsets = [meta.offset for meta in packed.metas if meta is not None]
    assert all(offset % PACK_ALIGN_BYTES == 0 for offset in offsets) and offsets == sorted(set(offsets))
    for original, packed_view in zip(tensors, packed.tensors, strict=True):
        assert (original is None and packed_view is None) or same_bits(packed_view, original)  # type: ignore[arg-type]
    received = through_the_wire(*tensors)
    assert received[4] is None
    for original, back in zip(tensors[:4], received[:4], strict=True):
        assert same_bits(back, original)


def test_packing_copies_so_the_caller_may_change_its_tensors() -> None:
    tensor = torch.arange(4.0)
    packed = pack((tensor,), CPU)
    tensor.fill_(-1)
    assert packed.tensors[0] is not None and packed.tensors[0].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("shape", [(0,), (4, 0, 3), ()], ids=["empty", "empty-middle", "scalar"])
def test_empty_and_scalar_tensors_keep_their_shape(shape: tuple[int, ...]) -> None:
    tensor = torch.full(shape, 7.0)
    (received,) = through_the_wire(tensor)
    assert received is not None and received.shape == tensor.shape and torch.equal(received, tensor)


def test_a_non_contiguous_tensor_arrives_with_its_logical_values() -> None:
    tensor = torch.arange(24, dtype=torch.float16).view(2, 3, 4).transpose(0, 2)
    assert not tensor.is_contiguous()
    (received,) = through_the_wire(tensor)
    assert received is not None and torch.equal(received, tensor) and received.is_contiguous()


def test_a_payload_at_an_odd_address_still_yields_the_right_values() -> None:
    packed = pack((torch.arange(7, dtype=torch.float64),), CPU)
    storage = bytearray(1 + packed.storage.nbytes)
    storage[1:] = bytes(tensor_bytes(packed.storage))
    (received,) = unpack(packed.metas, memoryview(storage)[1:])
    assert received is not None and torch.equal(received, torch.arange(7, dtype=torch.float64))


def test_metadata_that_reaches_past_the_payload_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match=r"needs 24 bytes, the payload has 16"):
        unpack([TensorMeta("float32", [2, 3])], memoryview(bytearray(16)))


def test_metadata_misaligned_for_its_dtype_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="misaligned"):
        unpack([TensorMeta("float32", [1], offset=2)], memoryview(bytearray(16)))


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="unknown dtype 'float7'"):
        unpack([TensorMeta("float7", [1])], memoryview(bytearray(1)))
