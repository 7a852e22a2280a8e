"""Checksums of an item's bytes: computed where the producer wrote them, checked where the
consumer lands them, before its caller sees them (`Producer(checksum=True)`).

An item travels as one packed payload (`kvrt._item.pack`) with the description of each
tensor in it (dtype, shape, offset: `TensorMeta`), so one 64-bit checksum covers both: XXH3-64
of the payload, seeded with XXH3-64 of the descriptions as MessagePack encodes them. A bit
flipped in the bytes, or in where a tensor is said to lie, fails the check alike. On the CPU
xxHash hashes at memory speed, and the bytes are hashed where they lie, without a copy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Final

import msgspec
import torch
import xxhash

from kvrt._errors import IntegrityError, InvalidInputError
from kvrt._messages import TensorMeta
from kvrt._tensors import tensor_bytes

ItemMetas = tuple[TensorMeta | None, ...]
"""An item's tensors as its delivery describes them: tokens, roi, key, value, hidden."""

_encode_metas = msgspec.msgpack.Encoder().encode

CHECKSUM_ENV: Final = "KVRT_CHECKSUM"
"""`1` turns checksums on for every producer that does not say (`Producer(checksum=None)`)."""


def checksum_wanted(checksum: bool | None) -> bool:
    """A producer's `checksum` argument, or `KVRT_CHECKSUM` when it is None."""
    if checksum is not None:
        if not isinstance(checksum, bool):
            raise InvalidInputError(f"checksum must be True, False or None, got {checksum!r}")
        return checksum
    value = os.environ.get(CHECKSUM_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise InvalidInputError(f"{CHECKSUM_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def payload_checksum(payload: memoryview | bytes, seed: int = 0) -> int:
    """XXH3-64 of a payload's bytes (a host buffer, hashed in place)."""
    return xxhash.xxh3_64_intdigest(payload, seed)


def metas_seed(metas: Sequence[TensorMeta | None]) -> int:
    """XXH3-64 of tensors' descriptions as MessagePack encodes them: the seed of their bytes'
    checksum (on the host, and on a GPU: `kvrt.kernels.checksum`)."""
    return xxhash.xxh3_64_intdigest(_encode_metas(tuple(metas)))


def item_checksum(payload: memoryview | bytes, metas: ItemMetas) -> int:
    """An item's checksum: its payload's, seeded with that of its tensors' descriptions."""
    return payload_checksum(payload, metas_seed(metas))


def delivery_checksum(request_id: int, item_id: int, matched: int, lease: int, item: int) -> int:
    """What covers a delivery's own fields, which change with each delivery of an item: XXH3-64
    of the msgpack array `[request_id, item_id, matched, lease]`, seeded with the item's
    checksum. A consumer that took an item under a flipped id or lease would confirm another
    delivery, and the item would reach a second consumer; one that finds a mismatch takes
    nothing and starts a new session instead."""
    return xxhash.xxh3_64_intdigest(_encode_metas((request_id, item_id, matched, lease)), item)


def stream_start_checksum(
    request_id: int, item_id: int, matched: int, lease: int, layers: int, payload_bytes: int,
    tokens_frame: memoryview | bytes, tokens_metas: ItemMetas,
) -> int:  # fmt: skip
    """What covers a stream's start (`StreamStart.checksum`): as `delivery_checksum`, its own
    fields with its layer count and frame length, seeded with the checksum of its tokens frame
    and metas."""
    fields = _encode_metas((request_id, item_id, matched, lease, layers, payload_bytes))
    return xxhash.xxh3_64_intdigest(fields, item_checksum(tokens_frame, tokens_metas))


DeviceChecksum = Callable[[torch.Tensor, int], int]
"""`kvrt.kernels.checksum`'s checksum of a contiguous byte tensor with a seed (a GPU's
kernel, or its reference on the host): a consumer gives its receivers one, which is how a
transport checks `Deliver.device_checksum` without importing the kernels."""


def device_checksum_mismatch(
    checksum_of: DeviceChecksum | None, payload: torch.Tensor, metas: ItemMetas, expected: int | None, what: str
) -> IntegrityError | None:
    """The error for an item whose landed payload does not match the GPU checksum its
    producer computed, else None (also where there is nothing to check with)."""
    if expected is None or checksum_of is None:
        return None
    if checksum_of(payload, metas_seed(metas)) == expected:
        return None
    return IntegrityError(
        f"{what}: its {payload.numel()} bytes, or the description of its tensors, do not match the checksum its "
        "producer computed on its GPU where it wrote them (damaged on the way): it went back whole"
    )


def tensors_checksum(tensors: Sequence[torch.Tensor], metas: Sequence[TensorMeta | None], position: int) -> int:
    """The checksum of tensors that travel in frames of their own: a stream's layer (its key
    and value; `position` is the layer's index) or a stream's hidden states (`position` -1).
    Each one's bytes in turn, seeded with the last, the first with the XXH3-64 of
    `[position, *metas]`: a layer said to be another fails as a flipped byte does. Each
    tensor is contiguous in host memory."""
    seed = tensors_seed(metas, position)
    for tensor in tensors:
        seed = payload_checksum(tensor_bytes(tensor), seed)
    return seed


def tensors_seed(metas: Sequence[TensorMeta | None], position: int) -> int:
    """XXH3-64 of `[position, *metas]`: what seeds the checksums of a stream's layer or hidden
    states (`tensors_checksum` on the host, `tensors_device_checksum` on a GPU)."""
    return xxhash.xxh3_64_intdigest(_encode_metas((position, *metas)))


def tensors_device_checksum(sums: Sequence[int], seed: int) -> int:
    """What a producer on a GPU sends for a stream's layer or hidden states
    (`StreamEnd.layer_checksums`, `StreamEnd.device_checksum`): XXH3-64 of the kernel's
    checksum of each tensor's bytes (`kvrt.kernels.checksum`, seeded with `tensors_seed`), in
    order, seeded with that seed. Each tensor's sum is computed on its own, so that the GPU
    sums all of them at once; key and value swapped, or a layer said to be another, fail."""
    return xxhash.xxh3_64_intdigest(_encode_metas(tuple(sums)), seed)


HIDDEN_POSITION: Final = -1
"""`tensors_checksum`'s position of a stream's hidden states (its end)."""


def storage_checksum(storage: torch.Tensor, metas: ItemMetas) -> int:
    """`item_checksum` of an item's packed storage: a contiguous uint8 tensor in host memory
    (a producer on a GPU refuses `checksum=True` when it is made)."""
    return item_checksum(tensor_bytes(storage), metas)
