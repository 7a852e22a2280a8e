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


_FRAMES_FAULTS_PER_ROUND = textwrap.dedent(
    """
    import resource, sys, threading
    from kvrt._heap import keep_extra_heaps, keep_freed_memory

    def faults():
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    def item():  # a 72 MiB item in frames of 8 MiB, all held until the last came
        frames = [bytearray(8 << 20) for _ in range(9)]
        for frame in frames:
            frame[::4096] = b"x" * len(frame[::4096])

    def receive(out):
        for _ in range(3):  # glibc's own thresholds settle on the first frees
            item()
        before = faults()
        for _ in range(10):
            item()
        out.append((faults() - before) // 10)

    if sys.argv[1] == "tuned":
        keep_freed_memory()
        keep_extra_heaps()  # as a consumer's TCP receiver does at its first payload in frames
    per_round = []
    thread = threading.Thread(target=receive, args=(per_round,))  # libzmq's I/O thread: heaps of its own
    thread.start()
    thread.join()
    print(per_round[0])
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_threads_frames_that_outgrow_its_first_heap_reuse_warm_pages_once_the_heap_is_tuned() -> None:
    def per_round(mode: str) -> int:
        result = subprocess.run(
            [sys.executable, "-c", _FRAMES_FAULTS_PER_ROUND, mode], capture_output=True, text=True, timeout=60,
            check=True,
        )  # fmt: skip
        return int(result.stdout)

    plain = per_round("plain")
    assert plain > (8 << 20) // 4096  # a heap made and unmapped each round: a frame's pages faulted anew
    assert per_round("tuned") < plain // 8
