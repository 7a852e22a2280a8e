"""Tensors on the wire: packed into one buffer, every dtype bit for bit, and metadata that lies."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt._errors import RemoteProtocolError
from kvrt._messages import MAX_SEGMENTS, TensorMeta
from kvrt._sizes import meta_end, meta_nbytes
from kvrt._tensors import (
    DTYPES,
    PACK_ALIGN_BYTES,
    Packed,
    batch_views,
    check_segments,
    chunk_plan,
    chunked_layers,
    layer_chunks,
    layer_segments,
    pack,
    pack_empty,
    tensor_bytes,
    unpack,
    unpack_tensor,
)
from tests._checks import same_bits

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


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_arrives_bit_for_bit(name: str) -> None:
    tensor = random_bits((3, 5, 2), DTYPES[name])
    (received,) = through_the_wire(tensor)
    assert same_bits(received, tensor)


def test_the_dtypes_kvrt_promises_are_all_on_the_wire() -> None:
    assert {"bool", "bfloat16", "float16", "float32", "int64", "uint8", "float8_e4m3fn", "float8_e5m2"} <= set(DTYPES)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_the_protocol_core_reckons_a_tensors_bytes_as_torch_does_without_torch(name: str) -> None:
    tensor = random_bits((3, 5, 2), DTYPES[name])
    (meta,) = pack([tensor], CPU).metas
    assert meta is not None
    assert meta_nbytes(meta) == tensor.nbytes
    assert meta_end(TensorMeta(dtype=meta.dtype, shape=meta.shape, offset=128)) == 128 + tensor.nbytes


def test_the_size_of_an_unknown_dtype_is_refused_as_the_peers_error() -> None:
    with pytest.raises(RemoteProtocolError, match="unknown dtype"):
        meta_nbytes(TensorMeta(dtype="float7", shape=[2]))


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


def test_items_packed_back_to_back_in_one_device_payload_come_back_as_views_of_it() -> None:
    """A batch: items at aligned offsets of one payload, their views sharing its typed views."""
    items = [
        (torch.arange(5), None, random_bits((2, 5, 3, 4), torch.bfloat16), random_bits((2, 0, 3, 4), torch.bfloat16),
         random_bits((5, 7), torch.float32)),
        (torch.arange(9), torch.ones(9, dtype=torch.bool), random_bits((1, 9, 2), torch.float16),
         random_bits((1, 9, 2), torch.float16), None),
    ]  # fmt: skip
    packs = [pack(tensors, CPU) for tensors in items]
    offsets = [0, -(-packs[0].storage.numel() // 256) * 256]
    payload = torch.zeros(offsets[1] + packs[1].storage.numel() + 3, dtype=torch.uint8)  # a length no dtype divides
    for packed, offset in zip(packs, offsets, strict=True):
        payload[offset : offset + packed.storage.numel()] = packed.storage
    typed: dict[torch.dtype, torch.Tensor] = {}
    for tensors, packed, offset in zip(items, packs, offsets, strict=True):
        views = unpack_tensor(packed.metas, payload, at=offset, end=offset + packed.storage.numel(), typed=typed)
        for original, view in zip(tensors, views, strict=True):
            assert (original is None and view is None) or (
                same_bits(view, original)  # type: ignore[arg-type]
                and view is not None
                and view.untyped_storage().data_ptr() == payload.untyped_storage().data_ptr()
            )
    with pytest.raises(RemoteProtocolError, match="the payload has"):
        unpack_tensor(packs[1].metas, payload, at=offsets[1], end=offsets[1] + 64)


def test_a_batch_of_items_laid_out_alike_comes_back_as_views_of_their_own_bytes() -> None:
    """Runs of alike items (one strided view and an unbind per tensor) and the odd ones between
    and after them (one view each) come back as the items that were packed, views of the payload."""

    def item(seed: int, tokens: int, hidden: bool) -> list[torch.Tensor | None]:
        torch.manual_seed(seed)
        kv = (2, tokens, 3, 4)
        return [torch.arange(tokens) + seed, None, random_bits(kv, torch.bfloat16), random_bits(kv, torch.bfloat16),
                random_bits((tokens, 5), torch.float32) if hidden else None]  # fmt: skip

    items = [item(seed, 7, False) for seed in range(3)] + [item(3, 9, True)] + [item(seed, 7, False) for seed in (4, 5)]
    packs = [pack(tensors, CPU) for tensors in items]
    offsets, end = [], 0
    for packed in packs:
        offsets.append(end)
        end += -(-packed.storage.numel() // 256) * 256
    payload = torch.zeros(end + 5, dtype=torch.uint8)
    for packed, offset in zip(packs, offsets, strict=True):
        payload[offset : offset + packed.storage.numel()] = packed.storage
    views = batch_views([(packed.metas, offset) for packed, offset in zip(packs, offsets, strict=True)], payload)
    assert len(views) == len(items)
    for tensors, got in zip(items, views, strict=True):
        for original, view in zip(tensors, got, strict=True):
            assert (original is None and view is None) or (
                view is not None
                and same_bits(view, original)  # type: ignore[arg-type]
                and view.is_contiguous()
                and view.untyped_storage().data_ptr() == payload.untyped_storage().data_ptr()
            )
    views[1][2].fill_(0)  # each is its own view: writing one leaves its neighbours alone
    assert same_bits(views[0][2], items[0][2]) and same_bits(views[2][2], items[2][2])  # type: ignore[arg-type]


def test_metadata_that_reaches_past_the_payload_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match=r"needs 24 bytes, the payload has 16"):
        unpack([TensorMeta("float32", [2, 3])], memoryview(bytearray(16)))


def test_metadata_misaligned_for_its_dtype_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="misaligned"):
        unpack([TensorMeta("float32", [1], offset=2)], memoryview(bytearray(16)))


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="unknown dtype 'float7'"):
        unpack([TensorMeta("float7", [1])], memoryview(bytearray(1)))


# -- payload segments ----------------------------------------------------------------------


def _published_layout(layers: int, tokens: int, kv: int, with_roi: bool) -> Packed:
    """The payload layout of a published request (tokens, roi, key, value, no hidden)."""
    value_shape = (layers, tokens, 2, 3) if kv == 2 else (layers, tokens, 1, 0)
    return pack_empty(
        [((tokens,), torch.int64), ((tokens,), torch.bool) if with_roi else None,
         ((layers, tokens, 2, 3), torch.bfloat16), (value_shape, torch.bfloat16), None],
        torch.device("cpu"),
    )  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    layers=st.integers(1, 9),
    tokens=st.integers(0, 7),
    kv=st.sampled_from([1, 2]),
    with_roi=st.booleans(),
    per_chunk=st.integers(1, 10),
    taper=st.booleans(),
)
def test_layer_segments_tile_the_payload_and_each_chunk_is_ready_after_its_own_segments(
    layers: int, tokens: int, kv: int, with_roi: bool, per_chunk: int, taper: bool
) -> None:
    packed = _published_layout(layers, tokens, kv, with_roi)
    _, _, key, value, _ = packed.metas
    assert key is not None and value is not None
    size = packed.storage.numel()
    plan = chunk_plan(layers, per_chunk, small_first=taper, small_last=taper)
    segments, chunk_of = layer_segments(key, value, size, plan)
    check_segments(segments, size)  # every byte once
    if size == 0:
        assert segments == []
        return
    assert chunk_of == sorted(chunk_of)  # sent in gather order
    # Keys and values are grouped apart, in landing order; each part's chunks tile the layers
    # and wait for exactly the last segment that carries their own bytes, which is the
    # segment of the chunk they were gathered in; keys are ready before the values after them.
    chunks = layer_chunks(key, value, segments)
    assert [chunk.ready for chunk in chunks] == sorted(chunk.ready for chunk in chunks)
    assert {chunk.part for chunk in chunks} == ({"key", "value"} if kv == 2 else {"key"})  # MLA: no values
    layer_bytes = packed.tensors[2].nbytes // layers  # type: ignore[union-attr]
    for part, meta in (("key", key), ("value", value)) if kv == 2 else (("key", key),):
        mine = [chunk for chunk in chunks if chunk.part == part]
        assert mine[0].first == 0 and mine[-1].end == layers
        assert all(a.end == b.first and a.ready < b.ready for a, b in itertools.pairwise(mine))
        for chunk in mine:
            last = 0
            for layer in range(chunk.first, chunk.end):
                first = meta.offset + layer * layer_bytes
                carriers = [i for i, (o, n) in enumerate(segments) if o < first + layer_bytes and first < o + n]
                last = max([last, *carriers])
            assert chunk.ready == last or layer_bytes == 0
            assert plan[chunk_of[chunk.ready]] == (chunk.first, chunk.end) or tokens == 0
    if kv == 2 and tokens:
        key_ready = next(chunk.ready for chunk in chunks if chunk.part == "key")
        value_ready = next(chunk.ready for chunk in chunks if chunk.part == "value")
        assert key_ready < value_ready


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([(0, 10), (12, 8)], "do not tile"),
        ([(0, 10), (5, 15)], "do not tile"),
        ([(0, 10)], "cover 10 of 20 bytes"),
        ([(0, 10), (10, 10), (20, 1)], "cover 21 of 20 bytes"),
    ],
)
def test_segments_that_do_not_tile_the_payload_are_refused(segments: list[tuple[int, int]], message: str) -> None:
    with pytest.raises(RemoteProtocolError, match=message):
        check_segments(segments, 20)


@pytest.mark.parametrize("layers", [1, 32, 2047, 2048, 10_000])
def test_a_request_with_very_many_layers_still_fits_in_the_segment_limit(layers: int) -> None:
    packed = _published_layout(layers, 2, 2, with_roi=False)
    _, _, key, value, _ = packed.metas
    assert key is not None and value is not None
    for taper in (False, True):
        plan = chunk_plan(layers, 1, small_first=taper, small_last=taper)
        segments, _ = layer_segments(key, value, packed.storage.numel(), plan)
        assert len(segments) <= MAX_SEGMENTS
    assert chunked_layers(layers) == 1 or layers > (MAX_SEGMENTS - 1) // 2


@pytest.mark.parametrize(
    ("layers", "per_chunk", "taper", "sizes"),
    [
        (32, 8, False, [8, 8, 8, 8]),
        (32, 8, True, [2, 7, 7, 7, 7, 2]),  # a quarter-size chunk first and last
        (32, 4, True, [1, 4, 4, 4, 4, 4, 4, 3, 3, 1]),  # the middle spread evenly
        (32, 3, True, [3] * 10 + [2]),  # too small to taper
        (5, 8, True, [5]),
    ],
)
def test_a_chunk_plan_cuts_whole_layers_tapered_at_both_ends(
    layers: int, per_chunk: int, taper: bool, sizes: list[int]
) -> None:
    plan = chunk_plan(layers, per_chunk, small_first=taper, small_last=taper)
    assert [end - first for first, end in plan] == sizes
    assert plan[0][0] == 0 and plan[-1][1] == layers


def test_chunks_that_do_not_tile_the_layers_are_refused() -> None:
    packed = _published_layout(4, 2, 2, with_roi=False)
    _, _, key, value, _ = packed.metas
    assert key is not None and value is not None
    with pytest.raises(ValueError, match="do not tile"):
        layer_segments(key, value, packed.storage.numel(), [(0, 2), (3, 4)])
