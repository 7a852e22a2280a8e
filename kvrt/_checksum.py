"""Checksums of an item's bytes: computed where the producer wrote them, checked where the
consumer lands them, before its caller sees them (`Producer(checksum=True)`).

An item travels as one packed payload (`kvrt._item.pack`), so one 64-bit checksum of that
payload covers its tokens, key, value and hidden states. On the CPU it is xxHash's XXH3
(64 bits), which hashes at memory speed; the bytes are hashed where they lie, without a copy.
"""

from __future__ import annotations

import os
from typing import Final

import torch
import xxhash

from kvrt._errors import InvalidInputError
from kvrt._tensors import tensor_bytes

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


def payload_checksum(payload: memoryview | bytes) -> int:
    """XXH3-64 of a payload's bytes (a host buffer, hashed in place)."""
    return xxhash.xxh3_64_intdigest(payload)


def storage_checksum(storage: torch.Tensor) -> int:
    """XXH3-64 of an item's packed storage (a contiguous uint8 tensor in host memory)."""
    if storage.device.type != "cpu":
        raise InvalidInputError(
            f"checksum=True needs the item's bytes in host memory; this item is on {storage.device}"
        )
    return payload_checksum(tensor_bytes(storage))
