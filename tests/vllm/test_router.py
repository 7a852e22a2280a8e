"""kvrt's router in front of instances that misbehave: an error the client can read, and the
router goes on serving."""

from __future__ import annotations

import asyncio
import struct
from socket import SO_LINGER, SOL_SOCKET

import aiohttp
import pytest
import torch
from aiohttp import web

import kvrt
from kvrt.integrations.vllm.proxy import application
from tests.vllm.fake_instance import Handler, serving


def instance(completions: Handler) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def prefilled(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"text": ""}], "kv_transfer_params": {"kvrt_endpoint": "tcp://x:1"}})


async def answered(request: web.Request) -> web.Response:
    body = await request.json()
    return web.json_response({"choices": [{"text": "ok"}], "asked": body.get("kv_transfer_params")})


async def disconnecting(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.close()  # gone mid-request (killed, or its server failed)
    await asyncio.sleep(0)
    return web.Response()


async def complete(url: str) -> tuple[int, dict[str, object]]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(url + "/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}) as answer,
    ):
        return answer.status, await answer.json()


async def test_a_decode_gone_before_it_answers_is_replaced_by_another_that_gets_the_prefills_kv() -> None:
    async with (
        serving(instance(prefilled)) as prefill,
        serving(instance(disconnecting)) as broken,
        serving(instance(answered)) as decode,
        serving(application([prefill], [broken, decode])) as router,
    ):
        for _ in range(2):  # the first goes to the broken one, and on to the other; the next to the other
            status, body = await complete(router)
            assert status == 200 and body["asked"] == {"kvrt_endpoint": "tcp://x:1"}


async def test_a_decode_gone_before_it_answers_is_a_502_naming_it_when_no_other_is_left() -> None:
    async with (
        serving(instance(prefilled)) as prefill,
        serving(instance(disconnecting)) as broken,
        serving(application([prefill], [broken])) as router,
    ):
        status, body = await complete(router)
    error = body["error"]
    assert status == 502 and isinstance(error, dict) and f"the decode instance at {broken}" in error["message"]


async def test_a_decode_that_refuses_connections_is_a_502() -> None:
    async with serving(instance(prefilled)) as prefill:
        async with serving(instance(answered)) as closed:
            pass  # its port is free again: nothing listens there
        async with serving(application([prefill], [closed])) as router:
            status, body = await complete(router)
    assert status == 502 and "ClientConnectorError" in str(body["error"])


PROMPT = list(range(40, 60))


def prefilled_at(endpoint: str, after_s: float = 0.0) -> Handler:
    """A prefill instance whose KV for every prompt is at `endpoint` (as vLLM answers when
    asked for `return_token_ids`), answering `after_s` after the request came."""

    async def prefill(request: web.Request) -> web.Response:
        await asyncio.sleep(after_s)  # its forward pass
        body = await request.json()
        assert body["return_token_ids"] is True
        choice = {"text": "", "prompt_token_ids": body["prompt"]}
        return web.json_response({"choices": [choice], "kv_transfer_params": {"kvrt_endpoint": endpoint}})

    return prefill


async def hanging(request: web.Request) -> web.Response:
    await asyncio.sleep(60)  # a decode that has not got to the request yet
    return web.Response()


async def held(producer: kvrt.Producer, items: int, within_s: float = 10.0) -> bool:
    """Whether `producer` holds `items` items within `within_s` (releases are never waited for)."""
    async with asyncio.timeout(within_s):
        while producer.stats().items != items:  # noqa: ASYNC110 (no event says another client evicted)
            await asyncio.sleep(0.05)
    return True


@pytest.mark.parametrize("decode_is", ["left by its client", "left during the prefill", "gone"])
async def test_a_hand_off_the_decode_never_finished_releases_the_prompts_kv_on_the_producer(decode_is: str) -> None:
    # The client left as the prefill answered (the decode may never see the request), or while
    # the prefill ran (its answer alone names the KV it published), or the decode failed:
    # nobody would take that KV, so the router frees it.
    async with kvrt.Producer() as producer:
        shape = (1, len(PROMPT), 2, 4)
        await producer.insert(torch.tensor(PROMPT), None, torch.zeros(shape), torch.zeros(shape))
        decode = instance(disconnecting if decode_is == "gone" else hanging)
        prefill_s = 2.0 if decode_is == "left during the prefill" else 0.0
        async with (
            serving(instance(prefilled_at(producer.endpoint, prefill_s))) as prefill,
            serving(decode) as decode_url,
            serving(application([prefill], [decode_url])) as router,
            aiohttp.ClientSession() as session,
        ):
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
            if decode_is != "gone":
                try:
                    async with asyncio.timeout(1.0), session.post(router + "/v1/completions", json=body):
                        pass
                except TimeoutError:
                    pass  # the client is gone
            else:
                async with session.post(router + "/v1/completions", json=body) as answer:
                    assert answer.status == 502
            assert await held(producer, 0)


def closing_kept_connections(completions: Handler, *, reset: bool) -> Handler:
    """An instance that closes a kept-alive connection as its next request arrives, without an
    answer (`reset`: with a TCP reset, as a socket closed with that request unread is): what
    vLLM's server (uvicorn) does when a connection's keep-alive time runs out as the router
    sends on it. Every connection's first request is answered."""
    answered_on: list[object] = []
    """Each connection answered once, by its protocol object: held, never by its id(), which a
    connection made after another one was freed may get again."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if any(protocol is request.protocol for protocol in answered_on):
            assert request.transport is not None
            if reset:
                socket = request.transport.get_extra_info("socket")
                socket.setsockopt(SOL_SOCKET, SO_LINGER, struct.pack("ii", 1, 0))
                request.transport.abort()
            else:
                request.transport.close()
            await asyncio.sleep(0)
            return web.Response()
        answered_on.append(request.protocol)
        return await completions(request)

    return handler


@pytest.mark.parametrize("how", ["closed", "reset"])
@pytest.mark.parametrize("closing", ["prefill", "decode"])
async def test_a_request_on_a_connection_the_instance_closed_as_it_was_sent_goes_again_on_a_new_one(
    closing: str, how: str
) -> None:
    # The instance never read it: sent again, the decode still gets the prefill's KV.
    reset = how == "reset"
    prefill = closing_kept_connections(prefilled, reset=reset) if closing == "prefill" else prefilled
    decode = closing_kept_connections(answered, reset=reset) if closing == "decode" else answered
    async with (
        serving(instance(prefill)) as prefill_url,
        serving(instance(decode)) as decode_url,
        serving(application([prefill_url], [decode_url])) as router,
    ):
        for _ in range(3):
            status, body = await complete(router)
            assert status == 200 and body["asked"] == {"kvrt_endpoint": "tcp://x:1"}


def running_then_dropping(runs: list[int], *, pooled: int) -> Handler:
    """An instance that answers its first `pooled` requests (their connections stay in the
    router's pool), then runs every later request and drops its connection without an answer
    (`runs` counts the requests it ran)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        runs.append(1)
        if len(runs) <= pooled:
            await asyncio.sleep(0.2)  # held at once: the router opens a connection each
            return await answered(request)
        assert request.transport is not None
        request.transport.close()
        await asyncio.sleep(0)
        return web.Response()

    return handler


async def test_a_request_the_instance_ran_then_dropped_is_sent_at_most_twice() -> None:
    runs: list[int] = []
    async with (
        serving(instance(prefilled)) as prefill,
        serving(instance(running_then_dropping(runs, pooled=6))) as decode,
        serving(application([prefill], [decode])) as router,
    ):
        answers = await asyncio.gather(*(complete(router) for _ in range(6)))  # six connections kept alive
        assert [status for status, _ in answers] == [200] * 6
        status, body = await complete(router)
        assert status == 502 and "ServerDisconnectedError" in str(body["error"])
        assert len(runs) == 6 + 2  # on a kept-alive connection, then once on a new one


async def test_a_redirect_to_a_failing_address_ends_in_the_decode_computing_the_prompt() -> None:
    """A prefill that redirects to a URL that drops the connection: the router gives up on
    it after at most two sends, and the decode computes the prompt."""
    hits: list[int] = []

    async def redirecting(request: web.Request) -> web.StreamResponse:
        hits.append(1)
        raise web.HTTPTemporaryRedirect("/dropped")

    async def dropping(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()
        await asyncio.sleep(0)
        return web.Response()

    prefill_app = instance(redirecting)
    prefill_app.router.add_post("/dropped", dropping)
    async with (
        serving(prefill_app) as prefill,
        serving(instance(answered)) as decode,
        serving(application([prefill], [decode])) as router,
    ):
        for _ in range(2):
            status, body = await asyncio.wait_for(complete(router), 10)
            assert status == 200 and body["asked"] is None  # the decode computed the prompt
        assert len(hits) <= 4
