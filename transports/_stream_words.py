"""A GPU stream that waits for, or writes, a 64-bit word in memory: CUDA's stream memory
operations (`cuStreamWaitValue64`, `cuStreamWriteValue64`), which torch does not bind.

cuda_ipc marks a transfer's ranges with them: the producer's stream writes a pair's
sequence number once a range's bytes are written, and the consumer's receive stream waits
until the word reaches that number before it copies. Unlike a wait on another process's
CUDA event, this wait can be released by the consumer itself (by writing a number past
every mark), so a producer that dies mid-write never leaves the consumer's GPU waiting for
ever (such a wait passes some 20 us after the word is written)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

_WAIT_GEQ = 0x0
"""CU_STREAM_WAIT_VALUE_GEQ: wait until (int64)(*address - value) >= 0."""
_WRITE_DEFAULT = 0x0
"""CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write (the bytes a mark follows
are visible before the mark)."""


class StreamWords:
    """The two operations, from the driver library (loaded once per process)."""

    def __init__(self) -> None:
        library = _driver()
        self._wait = _function(library, "cuStreamWaitValue64")
        self._write = _function(library, "cuStreamWriteValue64")

    def wait_at_least(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """`stream` waits (on the GPU) until the word at `address` is at least `value`."""
        _check(self._wait(stream.cuda_stream, address, value, _WAIT_GEQ), "cuStreamWaitValue64")

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        """`stream` writes `value` at `address`, after its work queued before."""
        _check(self._write(stream.cuda_stream, address, value, _WRITE_DEFAULT), "cuStreamWriteValue64")


def stream_words_unavailable() -> str | None:
    """Why this process cannot use stream memory operations (None: it can)."""
    try:
        StreamWords()
    except (OSError, AttributeError) as error:
        return f"the CUDA driver's stream memory operations are not available: {error}"
    return None


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _function(library: ctypes.CDLL, name: str) -> Any:
    function = getattr(library, name + "_v2", None) or getattr(library, name)
    function.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _check(result: int, name: str) -> None:
    if result != 0:
        raise RuntimeError(f"{name} failed: CUresult {result}")


__all__ = ["StreamWords", "stream_words_unavailable"]
