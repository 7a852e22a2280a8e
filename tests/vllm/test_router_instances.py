"""The router in front of several prefill and decode instances: each request to the least busy
of its kind; one that fails is taken out (its state in `/health`), health-checked and brought
back; a prefill that failed is replaced once, a decode that failed by one that goes on from
what the client has; every fault counted in `/metrics`. Against fake instances
(`fake_instance`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

import kvrt
from kvrt.integrations.vllm import _instances
from kvrt.integrations.vllm.proxy import application
from tests.vllm.fake_instance import FakeInstance, completion, events, next_token, serving, streamed_tokens
from tests.vllm.test_router_first_token import held, metric, post, prompt, without_ids

pytestmark = pytest.mark.timeout(60)


@dataclass
class Fleet:
    router: str
    prefills: list[FakeInstance]
    decodes: list[FakeInstance]
    urls: dict[FakeInstance, str]


@asynccontextmanager
async def fleet(
    prefills: int = 2, decodes: int = 2, *, producer: kvrt.Producer | None = None,
    arrivals: asyncio.Queue[FakeInstance] | None = None,
) -> AsyncIterator[Fleet]:  # fmt: skip
    async with AsyncExitStack() as stack:
        # A producer of its own where the test has none: what the router releases, it releases
        # there (a release to an address nobody serves would wait for its connect timeout).
        producer = producer or await stack.enter_async_context(kvrt.Producer())
        params = {"kvrt_endpoint": producer.endpoint}
        made = Fleet("", [FakeInstance(params=params, producer=producer) for _ in range(prefills)],
                     [FakeInstance(arrivals=arrivals) for _ in range(decodes)], {})  # fmt: skip
        for fake in (*made.prefills, *made.decodes):
            made.urls[fake] = await stack.enter_async_context(serving(fake.app()))
        app = application([made.urls[fake] for fake in made.prefills], [made.urls[fake] for fake in made.decodes])
        made.router = await stack.enter_async_context(serving(app))
        yield made


async def health(router: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(router + "/health") as answer:
        return answer.status, await answer.json()


def state(view: dict[str, Any], kind: str, url: str) -> str:
    (found,) = [instance["state"] for instance in view[kind] if instance["url"] == url]
    return str(found)


async def within(seconds: float, check: Callable[[], Any]) -> bool:
    """Whether `check()` (awaited) comes true within `seconds`: the router's health checks run
    on its own timers, which nothing outside it can wait on."""
    async with asyncio.timeout(seconds):
        while not await check():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return True


STREAMED = {"model": "m", "max_tokens": 8, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


async def test_requests_go_to_the_least_busy_decode() -> None:
    arrivals: asyncio.Queue[FakeInstance] = asyncio.Queue()
    async with fleet(1, 2, arrivals=arrivals) as made:
        gate = asyncio.Event()
        for decode in made.decodes:
            decode.hold = gate
        asked = [post(made.router, {**STREAMED, "prompt": prompt(seed)}) for seed in range(4)]
        running = asyncio.gather(*asked)
        got = [await asyncio.wait_for(arrivals.get(), 10) for _ in range(4)]
        assert sorted(got.count(decode) for decode in made.decodes) == [2, 2]
        for decode in made.decodes:
            url = made.urls[decode]
            assert await metric(made.router, f'kvrt_router_in_flight{{instance="{url}",kind="decode"}}') == 2
        gate.set()
        assert all(status == 200 for status, _ in await running)


@pytest.mark.parametrize("drop_after", [0, 3], ids=["before-it-answers", "mid-stream"])
async def test_a_decode_that_fails_is_taken_out_and_another_goes_on_from_what_the_client_has(drop_after: int) -> None:
    asked = {**STREAMED, "prompt": prompt(11)}
    async with fleet(1, 2) as made:
        failing, other = made.decodes
        failing.drop_after = drop_after
        status, text = await post(made.router, asked)
        assert status == 200
        tokens, words, finish = streamed_tokens(text)
        expected = completion(**asked)["choices"][0]
        assert (tokens, words, finish) == (expected["token_ids"], expected["text"], "length")
        usage = [event["usage"] for event in events(text) if isinstance(event, dict) and event.get("usage")]
        assert usage == [completion(**asked)["usage"]]  # the client's prompt, every output token
        (going_on,) = other.asked
        assert going_on["prompt"] == asked["prompt"] + tokens[: 1 + drop_after]  # what the client had
        assert going_on["max_tokens"] == asked["max_tokens"] - 1 - drop_after
        _, view = await health(made.router)
        assert state(view, "decode", made.urls[failing]) == "out"
        assert await metric(made.router, 'kvrt_router_retries_total{kind="decode"}') == 1
        label = f'kvrt_router_failures_total{{error="disconnected",instance="{made.urls[failing]}",kind="decode"}}'
        assert await metric(made.router, label) == 1


async def test_a_stream_cut_after_its_last_token_ends_with_what_the_client_has_and_asks_no_other_decode() -> None:
    # The decode sent every token asked for, then died before the chunk that says the
    # completion ended: nothing is left to generate (a decode asked for 0 tokens refuses).
    asked = {**STREAMED, "prompt": prompt(14)}
    async with fleet(1, 2) as made:
        failing, other = made.decodes
        failing.finish_apart = other.finish_apart = True
        failing.drop_after = asked["max_tokens"] - 1  # every token after the prefill's first
        status, text = await post(made.router, asked)
        assert status == 200
        expected = completion(**asked)["choices"][0]
        assert streamed_tokens(text) == (expected["token_ids"], expected["text"], "length")
        usage = [event["usage"] for event in events(text) if isinstance(event, dict) and event.get("usage")]
        assert usage == [completion(**asked)["usage"]]
        assert other.asked == []


async def test_a_whole_answer_whose_decode_failed_comes_from_another() -> None:
    asked = {"model": "m", "max_tokens": 8, "prompt": prompt(12)}
    async with fleet(1, 2) as made:
        made.decodes[0].drop_after = 0
        status, text = await post(made.router, asked)
    assert status == 200 and without_ids(json.loads(text)) == without_ids(completion(**asked))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_when_every_decode_fails_the_client_reads_an_error_naming_one_and_the_kv_is_released(
    stream: bool,
) -> None:
    async with kvrt.Producer() as producer, fleet(1, 2, producer=producer) as made:
        for decode in made.decodes:
            decode.drop_after = 0
        status, text = await post(made.router, {**STREAMED, "prompt": prompt(13), "stream": stream})
        assert await held(producer, 0)
    if stream:  # the first token went out before: the stream ends with the error
        assert status == 200
        error = [event for event in events(text) if isinstance(event, dict) and "error" in event]
        assert len(error) == 1 and "the decode instance at http://" in error[0]["error"]["message"]
        assert events(text)[-1] == "[DONE]"
    else:
        assert status == 502 and "the decode instance at http://" in json.loads(text)["error"]["message"]


async def test_a_prefill_that_fails_is_taken_out_and_the_request_goes_to_another_prefill() -> None:
    asked = {**STREAMED, "prompt": prompt(14)}
    async with fleet(2, 1) as made:
        failing, other = made.prefills
        failing.drop_after = 0
        status, text = await post(made.router, asked)
        assert status == 200
        assert streamed_tokens(text)[0] == completion(**asked)["choices"][0]["token_ids"]
        assert len(failing.asked) == 1 and len(other.asked) == 1
        _, view = await health(made.router)
        assert state(view, "prefill", made.urls[failing]) == "out"
        assert await metric(made.router, 'kvrt_router_retries_total{kind="prefill"}') == 1
        assert made.decodes[0].asked[0]["prompt"] == [*asked["prompt"], next_token(asked["prompt"])]


async def test_a_request_whose_prefills_failed_twice_is_computed_by_the_decode() -> None:
    asked = {"model": "m", "max_tokens": 4, "prompt": prompt(15)}
    async with fleet(3, 1) as made:
        for prefill in made.prefills:
            prefill.status = 500
        status, _ = await post(made.router, asked)
        assert status == 200
        assert sum(len(prefill.asked) for prefill in made.prefills) == 2  # once, then once more
        assert made.decodes[0].asked == [asked]  # the client's request: it computes the prompt
        assert await metric(made.router, 'kvrt_router_fallbacks_total{reason="prefill_failed"}') == 1
        # One prefill is left up: the next request is its; with none up, no prefill is asked.
        await post(made.router, asked)
        await post(made.router, asked)
        assert sum(len(prefill.asked) for prefill in made.prefills) == 3
        assert await metric(made.router, 'kvrt_router_fallbacks_total{reason="no_prefill"}') == 1


async def test_an_instance_out_is_health_checked_and_brought_back_once_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_instances, "PROBE_S", (0.05, 0.2))
    async with fleet(1, 2) as made:
        failing, _ = made.decodes
        failing.status = 503  # its requests fail, and so does its /health
        assert (await post(made.router, {**STREAMED, "prompt": prompt(16)}))[0] == 200
        status, view = await health(made.router)
        assert status == 200 and state(view, "decode", made.urls[failing]) == "out"
        failing.status = None

        async def back() -> bool:
            return state((await health(made.router))[1], "decode", made.urls[failing]) == "up"

        assert await within(10, back)
        label = f'kvrt_router_instance_up{{instance="{made.urls[failing]}",kind="decode"}}'
        assert await metric(made.router, label) == 1


async def test_the_router_is_unhealthy_while_every_decode_is_out_and_still_tries_them() -> None:
    async with fleet(1, 1) as made:
        (decode,) = made.decodes
        decode.status = 500
        assert (await post(made.router, {"model": "m", "prompt": prompt(17), "max_tokens": 2}))[0] == 502
        status, view = await health(made.router)
        assert status == 503 and state(view, "decode", made.urls[decode]) == "out"
        decode.status = None  # back, before its health check said so: a request finds it
        assert (await post(made.router, {"model": "m", "prompt": prompt(17), "max_tokens": 2}))[0] == 200
        assert (await health(made.router))[0] == 200
