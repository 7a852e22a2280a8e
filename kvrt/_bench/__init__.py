"""`kvrt bench NAME`: every benchmark prints its reference measured in the same run, and the ratio."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = (
    "buffer", "checksum", "consensus", "heads", "hosts", "nccl", "ipc", "kernels", "nixl", "pull", "requests", "stream",
    "vllm",
)  # fmt: skip
"""Each is a module with `main(args) -> int`: of this package, but those `ELSEWHERE` says."""

ELSEWHERE = {"vllm": "kvrt.integrations.vllm._bench"}
"""Benchmarks that live with what they measure (above this package's layer)."""


def run_bench(name: str, args: argparse.Namespace) -> int:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}")
    module = importlib.import_module(ELSEWHERE.get(name, f"kvrt._bench.{name}"))
    code: int = module.main(args)
    return code
