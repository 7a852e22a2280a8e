"""The C heap under libzmq's messages and kvrt's host items (glibc's malloc).

libzmq allocates every message it receives with `malloc`, and a host item's bytes are a
torch allocation, which is `malloc` too. glibc gives an allocation of more than 128 KiB
its own mapping and, once a few are freed, returns what lies at the top of its heap to the
system: so a layer of a few MiB received or buffered every request is a fresh mapping, its
pages first touched (and zeroed) inside the request, and unmapped again when it is freed.
On a 2-core host that was a thousand page faults and about 1 ms of CPU a side for a 16 MiB
item. `keep_freed_memory` has malloc serve allocations up to its ceiling for that (32 MiB)
from its heap and keep up to `KEPT_FREE_BYTES` of freed memory for the next ones: after the
first requests the pages are warm. A thread's heaps other than the main one are 64 MiB each,
and a thread that needs more (libzmq's, receiving a large item in frames: `kvrt.transports.tcp`)
makes another, which glibc unmaps whenever it empties unless `KEPT_FREE_BYTES` is also the
padding it keeps at a heap's top: so it is, and such a heap stays. Once per process, at the
first producer or consumer; `KVRT_HEAP_TUNING=0` leaves malloc as it is (an engine that tunes
it itself).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Final

_M_TRIM_THRESHOLD: Final = -1
_M_TOP_PAD: Final = -2
_M_MMAP_THRESHOLD: Final = -3
HEAP_ALLOCATIONS_UP_TO: Final = 32 << 20
"""The largest allocation malloc serves from its heap (glibc's ceiling for the setting)."""
KEPT_FREE_BYTES: Final = 64 << 20
"""Freed memory at the top of a heap that malloc keeps before it returns the rest."""

_lock = threading.Lock()
_tuned = False


def _libc() -> ctypes.CDLL | None:
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
        libc = _libc()
        mallopt = None if libc is None else getattr(libc, "mallopt", None)
        if mallopt is None or getattr(libc, "gnu_get_libc_version", None) is None:
            return
        mallopt(_M_MMAP_THRESHOLD, HEAP_ALLOCATIONS_UP_TO)
        mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES)
        mallopt(_M_TOP_PAD, KEPT_FREE_BYTES)


def trim_heap() -> None:
    """Give freed heap memory back to the system now (glibc's `malloc_trim`; nothing elsewhere)."""
    libc = _libc()
    trim = None if libc is None else getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
