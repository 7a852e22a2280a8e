"""cProfile of both processes of `kvrt bench nccl` at one size (a diagnostic).

python3 tools/nccl_profile.py OUT_DIR [SIZE_MIB [LAYERS]]     (two CUDA devices; default 16 32)

Runs the benchmark for that one size (every pass: one request per item and batched) with
each process under cProfile, and writes OUT_DIR/{producer,consumer}-profile.txt: the
functions that took the most time of their own, then the most time with their callees.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path
from typing import Any

from kvrt._bench import nccl

OUT = Path(os.environ.get("KVRT_PROFILE_OUT", "/tmp/kvrt-nccl-profile"))
_original_producer = nccl._producer


def _case() -> tuple[tuple[int, int], ...]:
    size_mib, layers = os.environ.get("KVRT_PROFILE_CASE", "16 32").split()
    return ((int(size_mib), int(layers)),)


def _write(profile: cProfile.Profile, side: str) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    (OUT / f"{side}-profile.txt").write_text(text.getvalue())


def _profiled_producer(store_port: int, control: Any) -> None:
    nccl.CASES = _case()  # type: ignore[misc]
    nccl.LATENCY_REQUESTS = 30  # type: ignore[misc]
    profile = cProfile.Profile()
    profile.enable()
    try:
        _original_producer(store_port, control)
    finally:
        profile.disable()
        _write(profile, "producer")


def main() -> None:
    global OUT
    OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    OUT.mkdir(parents=True, exist_ok=True)
    os.environ["KVRT_PROFILE_OUT"] = str(OUT)  # the producer process inherits both
    os.environ["KVRT_PROFILE_CASE"] = " ".join((sys.argv[2:] + ["16", "32"][len(sys.argv[2:]) :])[:2])
    nccl.CASES = _case()  # type: ignore[misc]
    nccl.LATENCY_REQUESTS = 30  # type: ignore[misc]
    nccl._producer = _profiled_producer  # type: ignore[assignment]
    profile = cProfile.Profile()
    profile.enable()
    nccl.main(argparse.Namespace(json=None, plot=None, in_flight=None))
    profile.disable()
    _write(profile, "consumer")


if __name__ == "__main__":
    main()
