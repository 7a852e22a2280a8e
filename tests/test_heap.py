"""The C heap under libzmq's messages and host items (`kvrt._heap`): once tuned, memory a
layer-sized allocation freed is kept warm for the next one instead of going back to the
system and being faulted in anew (on a 2-core host, ~1 ms of CPU a side for a 16 MiB item
taken request after request)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_FAULTS_PER_ROUND = textwrap.dedent(
    """
    import resource, sys
    from kvrt._heap import keep_freed_memory

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    if sys.argv[1] == "tuned":
        keep_freed_memory()
    for _ in range(3):  # glibc's own thresholds settle on the first frees
        pair = [bytearray(16 << 20), bytearray(16 << 20)]  # a layer received while the last is held
        del pair
    before = faults()
    for _ in range(10):
        pair = [bytearray(16 << 20), bytearray(16 << 20)]
        for block in pair:
            block[::4096] = b"x" * len(block[::4096])
        del pair
    print((faults() - before) // 10)
    """
)


def _faults_per_round(mode: str, **environment: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _FAULTS_PER_ROUND, mode], capture_output=True, text=True, timeout=60,
        env={**os.environ, **environment}, check=True,
    )  # fmt: skip
    return int(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_two_16_mib_blocks_freed_and_made_again_reuse_warm_pages_once_the_heap_is_tuned() -> None:
    plain = _faults_per_round("plain")
    assert plain > (32 << 20) // 4096 // 16  # glibc alone returns them, and faults them in again
    assert _faults_per_round("tuned") < plain // 2
    assert _faults_per_round("tuned", KVRT_HEAP_TUNING="0") > plain // 2  # an engine that tunes malloc itself
