"""The C heap under libzmq's messages and kvrt's host items (glibc's malloc).

libzmq allocates every message it receives with `malloc`, and a host item's bytes are a
torch allocation, which is `malloc` too. glibc gives an allocation of more than 128 KiB
its own mapping and, once a few are freed, returns what lies at the top of its heap to the
system: so a layer of a few MiB received or buffered every request is a fresh mapping, its
pages first touched (and zeroed) inside the request, and unmapped again when it is freed.
On a 2-core host that was a thousand page faults and about 1 ms of CPU a side for a 16 MiB
item. `keep_freed_memory` has malloc serve allocations up to its ceiling for that (32 MiB)
from its heap and keep up to `KEPT_FREE_BYTES` of freed memory for the next ones: after the
first requests the pages are warm. Once per process, at the first producer or consumer;
`KVRT_HEAP_TUNING=0` leaves malloc as it is (an engine that tunes it itself).

A thread's heaps other than the main one are 64 MiB each, and a thread that needs more at
once (libzmq's, receiving an item of 64 MiB in frames: `kvrt.transports.tcp`) makes another,
which glibc unmaps whenever it empties, unless the padding malloc keeps at a heap's top is as
large as a heap (16 and 32 MiB kept none of them: 2,049 faults a 64 MiB item). So
`keep_extra_heaps` makes that padding `KEPT_FREE_BYTES`, and such a heap stays: once per
process, when the first payload in frames arrives. A producer's process, which receives
none, keeps returning its heaps: that padding, kept in every heap of every thread, grew a
producer's memory by 40-90 MiB under a flood of large lookups.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Any, Final

_M_TRIM_THRESHOLD: Final = -1
_M_TOP_PAD: Final = -2
_M_MMAP_THRESHOLD: Final = -3
HEAP_ALLOCATIONS_UP_TO: Final = 32 << 20
"""The largest allocation malloc serves from its heap (glibc's ceiling for the setting)."""
KEPT_FREE_BYTES: Final = 64 << 20
"""Freed memory at the top of a heap that malloc keeps before it returns the rest."""

_lock = threading.Lock()
_tuned = False
_heaps_kept = False


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The GNU C library, loaded once (None on another C library)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> None:
    """Tune glibc's malloc as the module says, once per process (nothing on another C library,
    or with `KVRT_HEAP_TUNING=0`)."""
    global _tuned
    with _lock:
        if _tuned:
            return
        _tuned = True
        if os.environ.get("KVRT_HEAP_TUNING", "").strip() == "0":
            return
        mallopt = _mallopt()
        if mallopt is None:
            return
        mallopt(_M_MMAP_THRESHOLD, HEAP_ALLOCATIONS_UP_TO)
        mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES)


def keep_extra_heaps() -> None:
    """Keep a thread's extra heaps as the module says, once per process (nothing on another C
    library, or with `KVRT_HEAP_TUNING=0`)."""
    global _heaps_kept
    with _lock:
        if _heaps_kept:
            return
        _heaps_kept = True
        if os.environ.get("KVRT_HEAP_TUNING", "").strip() == "0":
            return
        mallopt = _mallopt()
        if mallopt is not None:
            mallopt(_M_TOP_PAD, KEPT_FREE_BYTES)


def _mallopt() -> Any:
    """glibc's `mallopt`, or None on another C library."""
    c_library = libc()
    mallopt = None if c_library is None else getattr(c_library, "mallopt", None)
    if mallopt is None or getattr(c_library, "gnu_get_libc_version", None) is None:
        return None
    return mallopt


def trim_heap() -> None:
    """Give freed heap memory back to the system now (glibc's `malloc_trim`; nothing elsewhere)."""
    c_library = libc()
    trim = None if c_library is None else getattr(c_library, "malloc_trim", None)
    if trim is not None:
        trim(0)
