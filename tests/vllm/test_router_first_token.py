"""The router answers the prefill's first token at once and has a decode go on from it: the
client reads a single instance's completion (streamed and not, its tokens, text and usage);
where that cannot be, the plain path, and the reason counted; a first token that ends the
request asks no decode and releases its KV; a client that leaves at any stage leaves nothing
held on the producer. Against fake instances (`fake_instance`): the real ones are in
`test_router_served`."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

import kvrt
from kvrt.integrations.vllm.proxy import application
from tests.vllm.fake_instance import EOS, FakeInstance, completion, events, next_token, serving, streamed_tokens

pytestmark = pytest.mark.timeout(60)

PARAMS = {"kvrt_endpoint": "tcp://127.0.0.1:1", "kvrt_endpoints": ["tcp://127.0.0.1:1"], "later": {"kept": True}}


@dataclass
class Served:
    router: str
    prefill: FakeInstance
    decode: FakeInstance
    decode_url: str


@asynccontextmanager
async def routed(*, first_token: bool = True, producer: kvrt.Producer | None = None) -> AsyncIterator[Served]:
    params = {"kvrt_endpoint": producer.endpoint} if producer is not None else PARAMS
    prefill, decode = FakeInstance(params=params, producer=producer), FakeInstance()
    async with (
        serving(prefill.app()) as prefill_url,
        serving(decode.app()) as decode_url,
        serving(application([prefill_url], [decode_url], first_token=first_token)) as router,
    ):
        yield Served(router, prefill, decode, decode_url)


async def post(url: str, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, str]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(url + path, json=body) as answer,
    ):
        return answer.status, await answer.text()


async def metric(url: str, name: str) -> float:
    """The router's metric `name` (with its labels, as Prometheus writes them): 0 if absent."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as answer:
        for line in (await answer.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def prompt(seed: int, length: int = 30) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 500) for _ in range(length)]


def without_ids(answer: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in answer.items() if key not in ("id", "created")}


@pytest.mark.parametrize("token_ids", [True, False], ids=["with-token-ids", "text-only"])
async def test_a_whole_completion_through_the_router_is_a_single_instances(token_ids: bool) -> None:
    asked = {"model": "m", "prompt": prompt(1), "max_tokens": 6, "return_token_ids": token_ids}
    async with routed() as served:
        status, text = await post(served.router, asked)
    assert status == 200
    answer = json.loads(text)
    assert without_ids(answer) == without_ids(completion(**asked))  # text, tokens, usage: the client's prompt
    assert len(served.decode.asked) == 1


async def test_a_streamed_completion_through_the_router_is_a_single_instances_event_for_event() -> None:
    asked = {
        "model": "m", "prompt": prompt(2), "max_tokens": 6, "return_token_ids": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    async with routed() as served:
        status, text = await post(served.router, asked)
        async with serving(FakeInstance().app()) as single:
            _, alone = await post(single, asked)
    assert status == 200
    got, expected = events(text), events(alone)
    ids = {event["id"] for event in got if isinstance(event, dict)}
    assert len(ids) == 1  # one completion, though two instances wrote it
    strip = [without_ids(event) if isinstance(event, dict) else event for event in got]
    assert strip == [without_ids(event) if isinstance(event, dict) else event for event in expected]


async def test_the_decode_goes_on_from_the_prompt_and_first_token_with_one_token_fewer_and_the_prefills_params() -> (
    None
):
    asked = {"model": "m", "prompt": prompt(3), "max_tokens": 5, "min_tokens": 3, "stream": True}
    async with routed() as served:
        await post(served.router, asked)
    (prefilled,) = served.prefill.asked
    assert (prefilled["max_tokens"], prefilled["min_tokens"], prefilled["stream"]) == (1, 1, False)
    (decoded,) = served.decode.asked
    first = next_token(asked["prompt"])
    assert decoded["prompt"] == [*asked["prompt"], first]
    assert (decoded["max_tokens"], decoded["min_tokens"]) == (4, 2)
    assert decoded["kv_transfer_params"] == PARAMS  # verbatim, keys it does not know included


async def test_the_first_token_reaches_a_streamed_client_before_the_decode_answers() -> None:
    asked = {"model": "m", "prompt": prompt(4), "max_tokens": 4, "stream": True, "return_token_ids": True}
    async with routed() as served:
        served.decode.hold = asyncio.Event()
        async with (
            aiohttp.ClientSession() as session,
            session.post(served.router + "/v1/completions", json=asked) as answer,
        ):
            first = await asyncio.wait_for(answer.content.readuntil(b"\n\n"), 10)
            assert not served.decode.hold.is_set()
            assert events(first.decode())[0]["choices"][0]["token_ids"] == [next_token(asked["prompt"])]  # type: ignore[index]
            served.decode.hold.set()
            tokens, _, finish = streamed_tokens(first.decode() + await answer.text())
    assert (tokens, finish) == (completion(**asked)["choices"][0]["token_ids"], "length")


def ending_prompt(stop_token: int | None = None) -> list[int]:
    """A prompt whose first token is the end of sequence (or `stop_token`'s token)."""
    for seed in range(100_000):
        candidate = prompt(seed, 12)
        token = next_token(candidate)
        if (stop_token is None and token == EOS) or (stop_token is not None and token == stop_token):
            return candidate
    raise AssertionError("no such prompt")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("ends_by", ["max_tokens 1", "end of sequence", "a stop token"])
async def test_a_first_token_that_ends_the_request_asks_no_decode_and_releases_its_kv(
    ends_by: str, stream: bool
) -> None:
    asked: dict[str, Any] = {"model": "m", "prompt": prompt(5), "max_tokens": 1, "return_token_ids": True}
    if ends_by == "end of sequence":
        asked |= {"prompt": ending_prompt(), "max_tokens": 8}
    elif ends_by == "a stop token":
        stop_token = next_token(prompt(6))
        asked |= {"prompt": prompt(6), "max_tokens": 8, "stop_token_ids": [stop_token]}
    async with kvrt.Producer() as producer, routed(producer=producer) as served:
        status, text = await post(served.router, {**asked, "stream": stream})
        assert status == 200 and served.decode.asked == []
        assert await held(producer, 0)
        assert await metric(served.router, 'kvrt_router_requests_total{route="first_token_only"}') == 1
    expected = completion(**asked)["choices"][0]
    if stream:
        tokens, _, finish = streamed_tokens(text)
        assert (tokens, finish) == (expected["token_ids"], expected["finish_reason"])
        assert events(text)[-1] == "[DONE]"
    else:
        assert without_ids(json.loads(text)) == without_ids(completion(**asked))


async def held(producer: kvrt.Producer, items: int, within_s: float = 10.0) -> bool:
    """Whether `producer` holds `items` items within `within_s` (releases are never waited for)."""
    async with asyncio.timeout(within_s):
        while producer.stats().items != items:  # noqa: ASYNC110 (no event says another client evicted)
            await asyncio.sleep(0.05)
    return True


FALLBACKS = {
    "several_choices": {"n": 2},
    "logprobs": {"logprobs": 2},
    "echo": {"echo": True},
    "structured_output": {"response_format": {"type": "json_object"}},
    "stop_strings": {"stop": ["<7>"]},
    "seeded_sampling": {"seed": 3, "temperature": 0.8},
    "output_penalties": {"presence_penalty": 0.5},
    "prompt_form": {"suffix": "x"},
    "several_prompts": {"prompt": [[5, 6, 7], [8, 9, 10]]},
}


@pytest.mark.parametrize("reason", [*FALLBACKS, "chat", "off"])
async def test_a_request_whose_first_token_cannot_come_at_once_takes_the_plain_path_and_says_why(reason: str) -> None:
    asked = {"model": "m", "prompt": prompt(7), "max_tokens": 4, **FALLBACKS.get(reason, {})}
    path = "/v1/chat/completions" if reason == "chat" else "/v1/completions"
    async with routed(first_token=reason != "off") as served:
        status, _ = await post(served.router, asked, path)
        assert status == 200
        assert await metric(served.router, f'kvrt_router_fallbacks_total{{reason="{reason}"}}') == 1
    (decoded,) = served.decode.asked
    assert decoded == {**asked, "kv_transfer_params": PARAMS}  # the client's request, and the prefill's KV


async def test_a_prefill_that_gives_no_first_token_leaves_the_decode_to_answer_it() -> None:
    asked = {"model": "m", "prompt": prompt(8), "max_tokens": 4}
    async with routed() as served:
        served.prefill.status = 400  # it refuses the request: the decode answers the client
        status, _ = await post(served.router, asked)
        assert status == 200
        assert await metric(served.router, 'kvrt_router_fallbacks_total{reason="prefill_failed"}') == 1
    assert served.decode.asked == [asked]


STAGES = ["during the prefill", "after the first token", "mid-stream"]


@pytest.mark.parametrize("stage", STAGES)
async def test_a_client_that_leaves_at_any_stage_leaves_nothing_held_on_the_producer(stage: str) -> None:
    asked = {"model": "m", "prompt": prompt(9), "max_tokens": 8, "stream": True, "return_token_ids": True}
    async with kvrt.Producer() as producer, routed(producer=producer) as served:
        gate = asyncio.Event()
        held_by = served.prefill if stage == "during the prefill" else served.decode
        held_by.hold, held_by.hold_at = gate, 2 if stage == "mid-stream" else 0
        got_first = asyncio.Event()

        async def client() -> None:
            async with (
                aiohttp.ClientSession() as session,
                session.post(served.router + "/v1/completions", json=asked) as answer,
            ):
                assert b"token_ids" in await answer.content.readuntil(b"\n\n")
                got_first.set()
                await asyncio.Event().wait()  # until it leaves

        leaving = asyncio.create_task(client())
        await asyncio.wait_for(held_by.holding.wait(), 10)
        if stage != "during the prefill":
            await asyncio.wait_for(got_first.wait(), 10)
        leaving.cancel()  # the client leaves
        await asyncio.gather(leaving, return_exceptions=True)
        gate.set()  # what was held runs on to its end
        assert await held(producer, 0)
        in_flight = f'kvrt_router_in_flight{{instance="{served.decode_url}",kind="decode"}}'
        assert await metric(served.router, in_flight) == 0
