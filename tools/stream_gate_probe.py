"""Host timeline of the cuda_ipc gate in `kvrt bench stream --transport cuda_ipc` (a diagnostic).

    python3 tools/stream_gate_probe.py        (two CUDA devices)

On 2x H200 (2026-11-30, at fbcf0de), from the last layer's mark seen by the gate to the
bench's stamp (medians): queued 36 us, loop hop to the layer's delivery 124 us, delivery to
the reader's stamp 414 us: the host path, not the copy, is what the gate costs a stream.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from kvrt import _consumer
from kvrt._bench import stream as bench
from kvrt.transports import cuda_ipc

marks: dict[str, list[float]] = {k: [] for k in ("job", "noticed", "queued", "settle", "deliver", "stamp")}


def wrap(module: Any, name: str, key: str, before: bool = False) -> None:
    original = getattr(module, name)

    def patched(*args: Any, **kwargs: Any) -> Any:
        if before:
            marks[key].append(time.perf_counter())
        try:
            return original(*args, **kwargs)
        finally:
            if not before:
                marks[key].append(time.perf_counter())

    setattr(module, name, patched)


wrap(cuda_ipc, "_wait_fired", "noticed")
wrap(cuda_ipc, "_queue_copies", "queued")
wrap(cuda_ipc, "_settle_soon", "settle", before=True)
wrap(_consumer._Link, "_deliver_layer", "deliver", before=True)
wrap(bench.Stamps, "stamp", "stamp", before=True)


def main() -> int:
    args = argparse.Namespace(transport="cuda_ipc", json=None, plot=None)
    code = bench.main(args)
    n = len(marks["stamp"])
    print(f"stamps {n}; noticed {len(marks['noticed'])} queued {len(marks['queued'])} deliver {len(marks['deliver'])}")
    # The last deliver before each stamp, and the gate marks just before it.
    rows = []
    for stamp in marks["stamp"]:
        deliver = max((t for t in marks["deliver"] if t <= stamp), default=None)
        settle = max((t for t in marks["settle"] if deliver is not None and t <= deliver), default=None)
        queued = max((t for t in marks["queued"] if settle is not None and t <= settle), default=None)
        noticed = max((t for t in marks["noticed"] if queued is not None and t <= queued), default=None)
        if deliver is None or settle is None or queued is None or noticed is None or stamp - deliver > 0.05:
            continue
        rows.append((queued - noticed, settle - queued, deliver - settle, stamp - deliver, stamp - noticed))
    for label, column in zip(
        ("noticed->queued", "queued->settle", "settle->deliver", "deliver->stamp", "noticed->stamp"),
        zip(*rows, strict=True),
        strict=True,
    ):
        print(f"{label}: median {1e6 * statistics.median(column):.0f} us, max {1e6 * max(column):.0f} us")
    return code


if __name__ == "__main__":
    sys.exit(main())
