"""`kvrt bench NAME`: every benchmark prints its reference measured in the same run, and the ratio."""

from __future__ import annotations

import argparse


def run_bench(name: str, args: argparse.Namespace) -> int:
    if name == "buffer":
        from kvrt._bench.buffer import main as buffer_main

        return buffer_main(args)
    raise ValueError(f"unknown benchmark {name!r}")
