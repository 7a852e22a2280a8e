"""The short table `tools/gpu_check.sh` prints last: GPU tests, then each benchmark's ratios."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def main(out: Path) -> int:
    print("\n==== kvrt GPU check ====")
    versions = out / "versions.txt"
    if versions.exists():
        print(versions.read_text().strip())
    report = out / "gpu-tests.xml"
    if report.exists():
        suite = ElementTree.parse(report).getroot().find("testsuite")
        if suite is not None:
            print(f"gpu tests: {suite.get('tests')} run, {suite.get('failures')} failed, "
                  f"{suite.get('errors')} errors, {suite.get('skipped')} skipped")  # fmt: skip
            for case in suite.iter("testcase"):
                problem = case.find("failure")
                if problem is None:
                    problem = case.find("error")
                if problem is not None:
                    print(f"  FAILED {case.get('name')}: {(problem.get('message') or '')[:160]}")
    items(out / "nccl.json", "nccl", "raw")
    items(out / "ipc-items.json", "cuda_ipc items", "peer copy")
    one_gpu(out / "ipc-one-gpu.json")
    nixl(out / "nixl.json")
    kernels = out / "kernels.json"
    if kernels.exists():
        rows = json.loads(kernels.read_text())["rows"]
        ceiling = rows[0]["gbps"]
        print("kernels: variant | GB/s | of copy")
        for row in rows:
            print(f"  {row['variant']:<42} | {row['gbps']:6.0f} | {100 * row['gbps'] / ceiling:5.1f}%")
    pulls(out / "pull.json", "pull")
    pulls(out / "ipc-paged.json", "pull over cuda_ipc")
    fused(out / "ipc-fused.json")
    streams(out / "stream.json", "stream")
    streams(out / "stream-ipc.json", "stream over cuda_ipc")
    return 0


def items(path: Path, name: str, against: str) -> None:
    """`bench nccl`'s table (and `bench ipc`'s items, whose ratios are against a peer copy)."""
    if not path.exists():
        return
    data = json.loads(path.read_text())
    print(f"{name}: size MiB | layers | raw GB/s | kvrt GB/s | kvrt/{against} | batched GB/s | batched/{against}")
    for row in data["rows"]:
        size, layers, raw, kvrt = int(row["size_mib"]), int(row.get("layers", 1)), row["raw_gbps"], row["kvrt_gbps"]
        batched = row.get("batched_gbps", 0.0)
        print(f"  {size:>6} | {layers:>6} | {raw:8.1f} | {kvrt:9.1f} | {100 * row['ratio']:6.0f}% | "
              f"{batched:12.1f} | {100 * row.get('batched_ratio', 0.0):10.0f}%")  # fmt: skip
    latency = data["latency"]
    print(f"  small items p50 {latency['p50_ms']:.3f} ms, p99 {latency['p99_ms']:.3f} ms")


def one_gpu(path: Path) -> None:
    """`bench ipc` on one GPU: kvrt beside the raw mapped-once and mapped-per-item copies."""
    if not path.exists():
        return
    print("cuda_ipc on one GPU: item | in flight | p50 ms (once / per item / kvrt) | GB/s (same) | kvrt CPU us")
    for row in json.loads(path.read_text()):
        once, per_item, ours = row["mapped once"], row["mapped per item"], row["kvrt"]
        print(f"  {row['case']['label']:>8} | {row['case']['in_flight']:>2} | "
              f"{once['p50_ms']:.3f} / {per_item['p50_ms']:.3f} / {ours['p50_ms']:.3f} | "
              f"{once['bytes_per_s'] / 1e9:.1f} / {per_item['bytes_per_s'] / 1e9:.1f} / {ours['bytes_per_s'] / 1e9:.1f}"
              f" | {ours['producer_cpu_us']:.0f} / {ours['consumer_cpu_us']:.0f}")  # fmt: skip


def nixl(path: Path) -> None:
    """`bench nixl`: kvrt over NIXL beside raw NIXL READs of the same bytes."""
    if not path.exists():
        return
    print("nixl: request | raw READ p50 ms | kvrt p50 ms | kvrt/raw rate")
    for row in json.loads(path.read_text()):
        print(f"  {row['case']['label']:>26} | {row['raw_p50_ms']:.3f} | {row['kvrt_p50_ms']:.3f} | "
              f"{100 * row['ratio']:.0f}%")  # fmt: skip


def pulls(path: Path, name: str) -> None:
    """`bench pull`'s rows: against raw NCCL, or (over cuda_ipc) against a peer copy."""
    if not path.exists():
        return
    data = json.loads(path.read_text())
    against, reference = ("peer copy", data["peer_s"]) if "peer_s" in data else ("raw NCCL", data["raw_s"])
    print(f"{name}: {against} {reference * 1e3:.2f} ms; chunk MiB | tapered | indexes | end to end (median) "
          f"| of {against} | best")  # fmt: skip
    for row in data["rows"]:
        print(f"  {row['chunk_mib']:>6.0f} | {'yes' if row.get('taper') else 'no':>7} | "
              f"{'host' if row.get('indexes_on_host') else 'GPU':>7} | "
              f"{row['end_to_end_s'] * 1e3:7.2f} ms | {100 * row['ratio']:5.0f}% | "
              f"{100 * row.get('best_ratio', row['ratio']):3.0f}%")  # fmt: skip


def fused(path: Path) -> None:
    """`bench ipc`'s third part: the fused pool-to-pool kernel alone beside a peer copy."""
    if not path.exists():
        return
    data = json.loads(path.read_text())
    peer = data["peer"]["best_s"]
    print(f"fused pool-to-pool kernel alone: peer copy {peer * 1e3:.2f} ms; " + ", ".join(
        f"{name} {times['best_s'] * 1e3:.2f} ms ({100 * peer / times['best_s']:.0f}%)"
        for name, times in data.items() if name != "peer"
    ))  # fmt: skip


def streams(path: Path, name: str) -> None:
    """`bench stream`'s rows, against raw NCCL of one layer."""
    if not path.exists():
        return
    data = json.loads(path.read_text())
    print(f"{name}: raw NCCL one layer {data['raw_one_layer_s'] * 1e3:.3f} ms (GPU clocks, drift "
          f"{data.get('clock_drift_ns', 0) / 1e3:+.1f} us); last layer computed -> received:")  # fmt: skip
    for mode in ("stream", "paged", "whole"):
        row = data.get(mode)
        if row is None:
            continue
        peer = f", {row['peer_layers']:4.2f}x a peer copy of one" if "peer_layers" in row else ""
        print(f"  {mode:>6}: {row['median_s'] * 1e3:7.3f} ms median, {row['best_s'] * 1e3:7.3f} best "
              f"= {row['layers']:5.2f}x one layer{peer}{' (goal <= 1.5x)' if mode == 'stream' else ''}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
