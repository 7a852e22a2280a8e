"""`kvrt bench NAME`: every benchmark prints its reference measured in the same run, and the ratio."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = ("buffer", "consensus", "heads", "nccl", "ipc", "kernels", "nixl", "pull", "requests", "stream")
"""Each is a module of this package with `main(args) -> int`."""


def run_bench(name: str, args: argparse.Namespace) -> int:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}")
    module = importlib.import_module(f"kvrt._bench.{name}")
    code: int = module.main(args)
    return code
