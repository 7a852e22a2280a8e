"""Tensors on the wire: dtype names, metadata, and raw bytes in and out of frames.

Every dtype whose elements can be viewed as bytes travels (bool, bfloat16 and the fp8
types too). An item's tensors are packed into one buffer at insert (`pack`: the one copy
insert makes anyway), travel as that one buffer with a `TensorMeta(dtype, shape, offset)`
per tensor, and are rebuilt on the other side as views over the received bytes
(`unpack`), without a copy. Metadata that disagrees with the bytes is refused before any
tensor is built.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import torch

from kvrt._errors import InvalidInputError, RemoteProtocolError
from kvrt._messages import BATCH_ALIGNMENT, MAX_SEGMENTS, TensorMeta
from kvrt._sizes import ITEM_BYTES, packed_layout
from kvrt._sizes import PACK_ALIGN_BYTES as PACK_ALIGN_BYTES
from kvrt._sizes import meta_end as meta_end  # the size arithmetic lives in `kvrt._sizes`, without torch
from kvrt._sizes import meta_nbytes as meta_nbytes

Allocate = Callable[[int], torch.Tensor | None]
"""Gives an item's packed buffer: a 1-D uint8 tensor of that many bytes, or None (see `pack_empty`)."""


def _wire_dtypes() -> dict[str, torch.dtype]:
    """Every wire dtype of `kvrt._sizes.ITEM_BYTES` this torch has (those it lacks are skipped),
    each of the element size the protocol core reckons with."""
    table: dict[str, torch.dtype] = {}
    for name, size in ITEM_BYTES.items():
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            assert dtype.itemsize == size, f"torch.{name} has {dtype.itemsize}-byte elements, not {size}"
            table[str(dtype).removeprefix("torch.")] = dtype
    return table


DTYPES: Final[dict[str, torch.dtype]] = _wire_dtypes()
"""Wire name → dtype, for every dtype that can travel."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    """The metadata of a tensor sent on its own (offset 0 in its own frame)."""
    return TensorMeta(dtype=dtype_name(tensor.dtype), shape=list(tensor.shape))


def back_to_back(metas: Sequence[TensorMeta]) -> tuple[list[TensorMeta], int]:
    """Tensors sent on their own (a stream's layer: key and value) laid one after the other
    in one payload, each at a multiple of `BATCH_ALIGNMENT`: their metas placed there, and the
    payload's size. Both ends compute it, so that an out-of-band transport moves them as one
    transfer. Refuses unknown dtypes."""
    placed: list[TensorMeta] = []
    end = 0
    for meta in metas:
        offset = -(-end // BATCH_ALIGNMENT) * BATCH_ALIGNMENT
        placed.append(TensorMeta(dtype=meta.dtype, shape=meta.shape, offset=offset))
        end = offset + _nbytes(meta.shape, _dtype_of(meta))
    return placed, end


def span_of(tensors: Sequence[torch.Tensor], placed: Sequence[TensorMeta], nbytes: int) -> torch.Tensor | None:
    """The `nbytes` bytes holding `tensors` as a uint8 tensor, if they already lie where
    `placed` says, in one storage (a stream's layer copied into one block); else None."""
    first = tensors[0]
    storage = first.untyped_storage()
    start = first.storage_offset() * first.element_size()
    for tensor, meta in zip(tensors, placed, strict=True):
        if (
            not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() != storage.data_ptr()
            or tensor.storage_offset() * tensor.element_size() != start + meta.offset
        ):
            return None
    if start + nbytes > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (nbytes,), (1,))


def pack_back_to_back(
    tensors: Sequence[torch.Tensor], placed: Sequence[TensorMeta], nbytes: int, device: torch.device
) -> torch.Tensor:
    """A new buffer of `nbytes` with each of `tensors` copied where `placed` says (on the
    current stream): for tensors that `span_of` found apart."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for tensor, meta in zip(tensors, placed, strict=True):
        buffer[meta.offset : meta.offset + tensor.nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
    return buffer


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True, slots=True)
class Packed:
    """Tensors copied into one contiguous byte buffer, and views of them into it."""

    storage: torch.Tensor
    tensors: tuple[torch.Tensor | None, ...]
    metas: tuple[TensorMeta | None, ...]


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor copied to `device` on the current stream, without waiting for the
    stream: from pageable memory CUDA stages the bytes before the call returns, so the caller
    may change `host` at once. A pinned `host` is copied to pageable memory first (an
    asynchronous copy would read it later)."""
    return _pageable(host).to(device, non_blocking=True)


def copy_from_host(into: torch.Tensor, host: torch.Tensor) -> None:
    """`host_to_device` straight into an existing tensor on a GPU: no device copy of its own."""
    into.copy_(_pageable(host), non_blocking=True)


def copy_into(into: torch.Tensor, source: torch.Tensor) -> None:
    """`into.copy_(source)`; into a GPU tensor queued on the current stream and never waited
    for, a host source copied as `copy_from_host` does (a plain `copy_` from the host would
    make the host wait for everything queued on the stream, a whole prefill's work)."""
    if into.device.type != "cuda":
        into.copy_(source.detach())  # to the host: done when this returns
    elif source.device.type == "cpu":
        copy_from_host(into, source.detach())
    else:
        into.copy_(source.detach(), non_blocking=True)


def _pageable(host: torch.Tensor) -> torch.Tensor:
    return host.clone() if host.is_pinned() else host


def pack_empty(
    specs: Sequence[tuple[Sequence[int], torch.dtype] | None], device: torch.device, allocate: Allocate | None = None
) -> Packed:
    """One new buffer on `device` laid out for tensors of these shapes and dtypes (None stays
    None), and views of them: for a caller that fills them in place. `allocate` may give the
    buffer (a 1-D uint8 tensor of the size asked for, on `device`; None from it: a new one)."""
    named = [None if spec is None else (spec[0], dtype_name(spec[1])) for spec in specs]
    element_bytes = {dtype_name(spec[1]): spec[1].itemsize for spec in specs if spec is not None}
    layout = packed_layout(named, element_bytes.__getitem__)
    storage = None if allocate is None else allocate(layout.nbytes)
    if storage is None:
        storage = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    views = tuple(
        None if spec is None or meta is None else _view(storage, meta, spec[1])
        for spec, meta in zip(specs, layout.metas, strict=True)
    )
    return Packed(storage, views, layout.metas)


def pack(tensors: Sequence[torch.Tensor | None], device: torch.device, allocate: Allocate | None = None) -> Packed:
    """Copy `tensors` (None stays None) into one new buffer on `device`: one copy each, none
    waited for (`copy_into`). `allocate`: as for `pack_empty`."""
    specs = [None if tensor is None else (tensor.shape, tensor.dtype) for tensor in tensors]
    packed = pack_empty(specs, device, allocate)
    for tensor, view in zip(tensors, packed.tensors, strict=True):
        if tensor is not None and view is not None:
            copy_into(view, tensor)
    return packed


def unpack_tensor(
    metas: Sequence[TensorMeta | None], payload: torch.Tensor, *, at: int = 0, end: int | None = None,
    typed: dict[torch.dtype, torch.Tensor] | None = None,
) -> list[torch.Tensor | None]:  # fmt: skip
    """Views of the tensors `metas` describe inside `payload[at:end]`, `payload` a 1-D uint8
    tensor on any device (an aligned allocation, `at` a multiple of 16); refuses metadata that
    does not fit or is misaligned. `typed` caches the payload's views as each dtype: one view
    op per tensor after the first of its dtype (a batch of items shares one cache)."""
    check_metas(metas, (payload.numel() if end is None else end) - at)
    return views_at(metas, payload, at=at, typed={} if typed is None else typed)


def check_metas(metas: Sequence[TensorMeta | None], available: int) -> None:
    """Refuse metadata that does not fit in `available` bytes or is misaligned."""
    for meta in metas:
        if meta is not None:
            _check_meta(meta, available)


def views_at(
    metas: Sequence[TensorMeta | None], payload: torch.Tensor, *, at: int, typed: dict[torch.dtype, torch.Tensor]
) -> list[torch.Tensor | None]:
    """`unpack_tensor` for metas already checked."""
    views: list[torch.Tensor | None] = []
    for meta in metas:
        if meta is None:
            views.append(None)
            continue
        flat, offset, shape = _placed(meta, payload, at, typed)
        views.append(flat.as_strided(shape, _contiguous_strides(shape), offset))  # one op, the cheapest
    return views


def batch_views(
    entries: Sequence[tuple[Sequence[TensorMeta | None], int]], payload: torch.Tensor
) -> list[list[torch.Tensor | None]]:
    """`views_at` for each (metas, at) of a batch, metas already checked. A run of entries
    laid out alike at evenly spaced offsets (a scheduler step's requests often are) gets each
    of its tensors from one strided view split by one `unbind`: one call into torch per
    tensor of the run instead of one per tensor of each entry (a view of a CUDA tensor costs
    microseconds of host time, mostly in the call)."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views: list[list[torch.Tensor | None]] = []
    start = 0
    while start < len(entries):
        metas, at = entries[start]
        end = start + 1
        step = entries[end][1] - at if end < len(entries) else 0
        while end < len(entries) and entries[end][1] - entries[end - 1][1] == step and entries[end][0] == metas:
            end += 1
        if end - start == 1 or step <= 0 or any(meta is not None and step % _dtype_of(meta).itemsize for meta in metas):
            views += [views_at(metas_of, payload, at=at_of, typed=typed) for metas_of, at_of in entries[start:end]]
            start = end
            continue
        columns: list[Sequence[torch.Tensor | None]] = []
        for meta in metas:
            if meta is None:
                columns.append([None] * (end - start))
                continue
            flat, offset, shape = _placed(meta, payload, at, typed)
            run = flat.as_strided((end - start, *shape), (step // flat.itemsize, *_contiguous_strides(shape)), offset)
            columns.append(run.unbind(0))
        views += [list(row) for row in zip(*columns, strict=True)]
        start = end
    return views


def _placed(
    meta: TensorMeta, payload: torch.Tensor, at: int, typed: dict[torch.dtype, torch.Tensor]
) -> tuple[torch.Tensor, int | torch.SymInt, tuple[int, ...]]:
    """The payload's view as `meta`'s dtype (made once per dtype, kept in `typed`), the element
    offset where `meta`'s tensor starts in it (`at` counted in bytes from the payload's start),
    and its shape."""
    dtype = DTYPES[meta.dtype]
    flat = typed.get(dtype)
    if flat is None:  # the payload's whole elements of this dtype (an aligned allocation)
        spare = payload.numel() % dtype.itemsize
        flat = typed[dtype] = (payload[: payload.numel() - spare] if spare else payload).view(dtype)
    return flat, flat.storage_offset() + (at + meta.offset) // dtype.itemsize, tuple(meta.shape)


@functools.lru_cache(maxsize=1024)  # a batch's items share few shapes: look each up once
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return tuple(strides)


def _checked_dtypes(metas: Sequence[TensorMeta | None], available: int) -> list[torch.dtype | None]:
    return [None if meta is None else _check_meta(meta, available) for meta in metas]


def _check_meta(meta: TensorMeta, available: int) -> torch.dtype:
    """`meta`'s dtype, once it is known, inside `available` bytes and aligned."""
    dtype = _dtype_of(meta)
    end = meta.offset + _nbytes(meta.shape, dtype)
    if end > available:
        raise RemoteProtocolError(
            f"tensor {meta.dtype}{list(meta.shape)} at offset {meta.offset} needs {end} bytes, "
            f"the payload has {available}"
        )
    if meta.offset % dtype.itemsize:
        raise RemoteProtocolError(f"tensor {meta.dtype} at offset {meta.offset} is misaligned for its dtype")
    return dtype


def unpack(metas: Sequence[TensorMeta | None], buffer: memoryview) -> list[torch.Tensor | None]:
    """Views of the tensors `metas` describe inside the received `buffer`.

    No copy, unless the buffer starts misaligned for one of the dtypes (libzmq's messages
    start 8 bytes into a 16-byte block: fine for all but 16-byte complex types). Refuses
    metadata that does not fit the buffer, names an unknown dtype, or is misaligned.
    """
    dtypes = _checked_dtypes(metas, buffer.nbytes)
    if buffer.nbytes == 0:
        payload = torch.empty(0, dtype=torch.uint8)
        return [
            None if meta is None or dtype is None else _view(payload, meta, dtype)
            for meta, dtype in zip(metas, dtypes, strict=True)
        ]
    alignment = max((dtype.itemsize for dtype in dtypes if dtype is not None), default=1)
    if _address(buffer) % alignment:
        payload = torch.frombuffer(buffer, dtype=torch.uint8).clone()
        return [
            None if meta is None or dtype is None else _view(payload, meta, dtype)
            for meta, dtype in zip(metas, dtypes, strict=True)
        ]
    # Straight from the buffer, one view per tensor (a slice, a dtype view and a shape view
    # of one byte tensor cost twice as much).
    return [
        None if meta is None or dtype is None
        else _from_buffer(buffer, meta, dtype)
        for meta, dtype in zip(metas, dtypes, strict=True)
    ]  # fmt: skip


def _address(buffer: memoryview) -> int:
    """Where `buffer`'s bytes start in memory."""
    return int(np.frombuffer(buffer, dtype=np.uint8, count=1).ctypes.data)


def _from_buffer(buffer: memoryview, meta: TensorMeta, dtype: torch.dtype) -> torch.Tensor:
    count = math.prod(meta.shape)
    if count == 0:
        return torch.empty(meta.shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=meta.offset).view(meta.shape)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def _view(storage: torch.Tensor, meta: TensorMeta, dtype: torch.dtype) -> torch.Tensor:
    flat = storage[meta.offset : meta.offset + _nbytes(meta.shape, dtype)].view(dtype)
    return flat.view(meta.shape)


def _dtype_of(meta: TensorMeta) -> torch.dtype:
    dtype = DTYPES.get(meta.dtype)
    if dtype is None:
        raise RemoteProtocolError(f"unknown dtype {meta.dtype!r} in tensor metadata")
    return dtype


# -- payload segments: a payload moved in chunks of whole layers -------------------------------


@dataclass(frozen=True, slots=True)
class LayerChunk:
    """Layers [first, end) of an item's key or value (`part`), and the payload segments
    (indexes in send order) that carry them: `ready` is the last of those, so a receiver that
    saw it land has the whole chunk (segments land in send order)."""

    first: int
    end: int
    ready: int
    part: Literal["key", "value"]


def chunked_layers(layers: int) -> int:
    """The fewest layers per chunk that keep a request of `layers` layers within
    `MAX_SEGMENTS` segments (one before the key, then a key and a value segment per chunk)."""
    most_chunks = (MAX_SEGMENTS - 1) // 2
    return max(1, -(-layers // most_chunks))


def chunk_plan(
    layers: int, layers_per_chunk: int, *, small_first: bool = False, small_last: bool = False
) -> list[tuple[int, int]]:
    """Layer ranges [first, end) that a published request is gathered and sent in, in order:
    `layers_per_chunk` each, but a quarter of that for the first (`small_first`: it is on the
    wire sooner) and the last (`small_last`: it leaves less to scatter once the wire is
    idle). Never more chunks than `MAX_SEGMENTS` allows."""
    if layers_per_chunk < 1:
        raise InvalidInputError(f"layers_per_chunk must be >= 1, got {layers_per_chunk}")
    per_chunk = max(layers_per_chunk, chunked_layers(layers))
    uniform = [(first, min(layers, first + per_chunk)) for first in range(0, layers, per_chunk)]
    edge = per_chunk // 4
    head, tail = (edge if small_first else 0), (edge if small_last else 0)
    middle = layers - head - tail
    if edge == 0 or head + tail == 0 or middle < per_chunk:
        return uniform
    count = -(-middle // per_chunk)
    sizes = [head] + [middle // count + (index < middle % count) for index in range(count)] + [tail]
    sizes = [size for size in sizes if size]
    if len(sizes) > (MAX_SEGMENTS - 1) // 2:
        return uniform
    ends = list(itertools.accumulate(sizes))
    return list(zip([0, *ends[:-1]], ends, strict=True))


def layer_segments(
    key: TensorMeta, value: TensorMeta, payload_bytes: int, chunks: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int]], list[int]]:
    """Cut a payload whose key and value are [layers, tokens, ...] into segments of whole
    layers, in the order a pipelined transfer sends them: chunk by chunk (`chunks`: layer
    ranges that tile the layers, from `chunk_plan`) its key layers and its value layers,
    what precedes the key (tokens, roi) with the first chunk's key layers. Padding between
    tensors and whatever follows the value (hidden) join the segment before them, so the
    segments tile the payload. Returns the segments (offset, nbytes) and, for each, the
    index of the chunk whose gather it waits for."""
    layers = key.shape[0] if key.shape else 0
    if payload_bytes == 0:
        return [], []
    if layers:
        ends = [end for _, end in chunks]
        if not chunks or [first for first, _ in chunks] != [0, *ends[:-1]] or ends[-1] != layers:
            raise InvalidInputError(f"chunks {list(chunks)} do not tile {layers} layers")
        if any(end <= first for first, end in chunks):
            raise InvalidInputError(f"chunks {list(chunks)} include an empty one")
    key_layer = _nbytes(key.shape[1:], _dtype_of(key)) if layers else 0
    value_layer = _nbytes(value.shape[1:], _dtype_of(value)) if value.shape and value.shape[0] == layers else 0
    # (offset, chunk), in send order; ends come from the tiling. What precedes the key (the
    # tokens) travels with the first chunk's key layers: one operation fewer.
    nominal: list[tuple[int, int]] = [(0, 0)]
    for chunk, (first, _) in enumerate(chunks if layers else []):
        if key_layer and first:
            nominal.append((key.offset + first * key_layer, chunk))
        if value_layer:
            nominal.append((value.offset + first * value_layer, chunk))
    starts = sorted({offset for offset, _ in nominal if offset < payload_bytes})
    end_of = dict(zip(starts, [*starts[1:], payload_bytes], strict=True))
    segments, chunk_of, seen = [], [], set()
    for offset, chunk in nominal:
        if offset in end_of and offset not in seen:
            seen.add(offset)
            segments.append((offset, end_of[offset] - offset))
            chunk_of.append(chunk)
    return segments, chunk_of


def transfer_segments(segments: Sequence[tuple[int, int]], payload_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges a payload moves in: its segments, or else the whole payload as one
    (none for an empty payload)."""
    if segments:
        return list(segments)
    return [(0, payload_bytes)] if payload_bytes else []


def check_segments(segments: Sequence[tuple[int, int]], payload_bytes: int) -> None:
    """Refuse segments that do not tile [0, payload_bytes) exactly (each byte once)."""
    position = 0
    for offset, nbytes in sorted(segments):
        if offset != position or nbytes < 1:
            raise RemoteProtocolError(f"payload segments do not tile the payload: ({offset}, {nbytes}) at {position}")
        position = offset + nbytes
    if position != payload_bytes:
        raise RemoteProtocolError(f"payload segments cover {position} of {payload_bytes} bytes")


def check_batch_segments(
    segments: Sequence[tuple[int, int]], hits: Sequence[tuple[int, int]], payload_bytes: int
) -> None:
    """Refuse a batch's transfers that are out of order, overlap or reach past the payload, and
    hits (offset, nbytes) that do not lie inside one of them."""
    position = 0
    for offset, nbytes in segments:
        if offset < position or nbytes < 1 or offset + nbytes > payload_bytes:
            raise RemoteProtocolError(
                f"batch segment ({offset}, {nbytes}) is out of order or past {payload_bytes} bytes"
            )
        position = offset + nbytes
    starts = [offset for offset, _ in segments]
    for offset, nbytes in hits:
        index = bisect.bisect_right(starts, offset) - 1
        if nbytes and (index < 0 or offset + nbytes > starts[index] + segments[index][1]):
            raise RemoteProtocolError(f"the hit at ({offset}, {nbytes}) is not inside one transfer of its batch")


def layer_chunks(key: TensorMeta, value: TensorMeta, segments: Sequence[tuple[int, int]]) -> list[LayerChunk]:
    """For a receiver of `segments` (checked) in send order: consecutive layers of the key,
    and of the value, grouped by the segment after whose landing all of their bytes are there,
    in landing order. Keys and values are grouped apart: a receiver can use a chunk's keys
    while its values are still on the wire."""
    layers = key.shape[0] if key.shape else 0
    metas: list[tuple[Literal["key", "value"], TensorMeta]] = [("key", key)]
    if value.shape and value.shape[0] == layers and _nbytes(value.shape[1:], _dtype_of(value)):
        metas.append(("value", value))  # MLA items carry an empty value: nothing to write
    chunks: list[LayerChunk] = []
    for part, meta in metas:
        layer_bytes = _nbytes(meta.shape[1:], _dtype_of(meta))
        grouped: list[LayerChunk] = []
        for layer in range(layers):
            first_byte, end_byte = meta.offset + layer * layer_bytes, meta.offset + (layer + 1) * layer_bytes
            carriers = (
                i for i, (offset, nbytes) in enumerate(segments) if offset < end_byte and first_byte < offset + nbytes
            )
            ready = max(carriers, default=0)
            if grouped and grouped[-1].ready == ready and grouped[-1].end == layer:
                grouped[-1] = LayerChunk(grouped[-1].first, layer + 1, ready, part)
            else:
                grouped.append(LayerChunk(layer, layer + 1, ready, part))
        chunks += grouped
    return sorted(chunks, key=lambda chunk: chunk.ready)  # stable: keys before values that land together
