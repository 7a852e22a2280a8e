"""A router for disaggregated vLLM with `KvrtConnector`: OpenAI-compatible, each request's
prompt to a prefill instance, then the request to a decode instance with the prefill's
`kv_transfer_params` (which name the kvrt producers holding its KV).

    python -m kvrt.integrations.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    kvrt proxy --prefill ... --decode ... [--port 8000]      (the same)

For each `POST /v1/completions` or `/v1/chat/completions`:

1. the body goes to a prefill instance (in turn) with `max_tokens` 1 and no streaming: its
   forward pass computes the prompt and kvrt publishes the KV;
2. the body goes to a decode instance (in turn) with the prefill's `kv_transfer_params`; its
   answer (streamed or not) is the client's. A prefill that fails or gives no params leaves
   the decode to compute the prompt itself: the client gets its answer all the same. A
   decode that fails before it answers (gone, refusing, disconnecting) is a 502 with an
   OpenAI-style error naming it; one that fails mid-answer closes the client's connection.

A request sent on a kept-alive connection that the instance closes without an answer goes
again, once, on a new connection: an instance's server closes a connection idle for its
keep-alive time (vLLM's: 5 s), and a request sent as it does was never read.

`GET /v1/models` and `GET /health` are the decode instances' (the first one's). A client that
leaves mid-request closes the decode's request too (vLLM aborts it and the connector releases
its KV on the producer). A hand-off that does not end in the decode's whole answer (the client
left, the decode failed) also has the router release the prompt's KV on the producers the
prefill named, as soon as it ends: the decode may never have seen the request (the client
left as the prefill answered), and then nobody else would. A prefill whose client leaves runs
to its answer for that reason. Needs aiohttp (a dependency of vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any, Final

import aiohttp
from aiohttp import web

import kvrt
from kvrt._errors import InvalidInputError
from kvrt.integrations.vllm._lookups import evict_prompt

log = logging.getLogger("kvrt.integrations.vllm.proxy")

TIMEOUT_S: Final = 600.0
"""The longest a request to an instance may take (a long decode)."""

RELEASE_TIMEOUT_S: Final = 10.0
"""The longest a release of a prompt's KV on one producer may take (it is never waited for)."""

MAX_RELEASES: Final = 1024
"""Releases on their way at most; past it, what one would free leaves with the item's TTL."""


def _error(message: str, status: int) -> web.Response:
    """An error as OpenAI's API (and vLLM's server) writes one, which clients know how to read."""
    return web.json_response({"error": {"message": message}}, status=status)


class Router:
    """The instances to route to, in turn, and one HTTP session to reach them."""

    def __init__(self, prefills: Sequence[str], decodes: Sequence[str]) -> None:
        if not prefills or not decodes:
            raise InvalidInputError("the router needs at least one prefill and one decode instance")
        self.prefills = [url.rstrip("/") for url in prefills]
        self.decodes = [url.rstrip("/") for url in decodes]
        self._next_prefill = itertools.cycle(self.prefills)
        self._next_decode = itertools.cycle(self.decodes)
        self._session: aiohttp.ClientSession | None = None
        self._fresh_session: aiohttp.ClientSession | None = None
        """For a request sent again: a new connection each (never one kept alive)."""
        self._releases: set[asyncio.Task[None]] = set()
        """Releases of KV on their way (each removes itself when done; cancelled at stop)."""
        self._prefills: set[asyncio.Future[tuple[dict[str, Any] | None, list[int]]]] = set()
        """Prefills whose clients left, running to their answer (cancelled at stop)."""
        self._stopping = False

    async def start(self, _: web.Application) -> None:
        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(_note_reuse)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S), trace_configs=[reuse])
        self._fresh_session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S), connector=aiohttp.TCPConnector(force_close=True)
        )

    async def stop(self, _: web.Application) -> None:
        self._stopping = True  # no release starts now; what is on its way is cancelled
        pending: list[asyncio.Future[Any]] = [*self._prefills, *self._releases]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for session in (self._session, self._fresh_session):
            if session is not None:
                await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router starts its session with the application"
        return self._session

    @property
    def fresh_session(self) -> aiohttp.ClientSession:
        assert self._fresh_session is not None, "the router starts its sessions with the application"
        return self._fresh_session

    @asynccontextmanager
    async def post(self, url: str, body: dict[str, Any]) -> AsyncIterator[aiohttp.ClientResponse]:
        """`body` posted to `url`: its answer, once its status and headers came. Sent again,
        once and on a new connection, when a kept-alive one it went on was closed before any
        answer: so a request an instance read and then dropped runs at most twice."""
        sent = _Sent()
        try:
            answer = await self.session.post(url, json=body, trace_request_ctx=sent)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):  # closed, or reset with the request unread
            if not sent.reused:
                raise
            answer = await self.fresh_session.post(url, json=body)
        async with answer:
            yield answer

    async def prefill(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int]]:
        """Run the prompt on a prefill instance: the `kv_transfer_params` it answers with, and
        the prompt's tokens (to release its KV should the decode never take it)."""
        asked = {
            **body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True},
            "return_token_ids": True,
        }  # fmt: skip
        asked.pop("stream_options", None)
        asked.pop("max_completion_tokens", None)
        url = next(self._next_prefill) + path
        try:
            async with self.post(url, asked) as response:
                if response.status != 200:
                    log.warning("prefill at %s answered %d: the decode computes the prompt", url, response.status)
                    return None, []
                answer = await response.json()
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            log.warning("prefill at %s failed (%s): the decode computes the prompt", url, exc)
            return None, []
        params = answer.get("kv_transfer_params")
        return (params if isinstance(params, dict) else None), _prompt_tokens(answer)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error("the body is not JSON", 400)
        if not isinstance(body, dict):
            return _error("the body is not a JSON object", 400)
        # The prefill runs to its answer even when the client leaves meanwhile: a prefill that
        # finished as its client left has published KV that only its answer names, and that
        # answer is what lets the router release it.
        prefilled = asyncio.ensure_future(self.prefill(request.path, body))
        try:
            params, prompt = await asyncio.shield(prefilled)
        except asyncio.CancelledError:
            self._release_when_answered(prefilled)
            raise
        decode_body = {**body, "kv_transfer_params": params} if params else dict(body)
        url = next(self._next_decode) + request.path
        response: web.StreamResponse | None = None
        answered = False
        try:
            async with self.post(url, decode_body) as answer:
                content_type = answer.headers.get("Content-Type", "application/json")
                response = web.StreamResponse(status=answer.status, headers={"Content-Type": content_type})
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                answered = True
                return response
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("decode at %s failed (%s: %s)", url, type(exc).__name__, exc)
            if response is not None:
                raise  # its status went out already: the connection closes, the client sees the body cut short
            return _error(f"the decode instance at {url} failed: {type(exc).__name__}: {exc}", 502)
        finally:
            if not answered and params:  # the client left, or the decode failed: its KV may wait for nobody
                self._release(params, prompt)

    def _release_when_answered(self, prefilled: asyncio.Future[tuple[dict[str, Any] | None, list[int]]]) -> None:
        """Release what a prefill whose client left publishes, once it answered (the prefill
        is one of the router's own tasks until then: cancelled at stop)."""

        def answered(done: asyncio.Future[tuple[dict[str, Any] | None, list[int]]]) -> None:
            self._prefills.discard(done)
            if not done.cancelled() and done.exception() is None:
                params, prompt = done.result()
                if params:
                    self._release(params, prompt)

        self._prefills.add(prefilled)
        prefilled.add_done_callback(answered)

    def _release(self, params: dict[str, Any], prompt: list[int]) -> None:
        """Evict the item of exactly `prompt` from every producer `params` name, in a task of
        the router's own (never waited for; what it cannot free leaves with the item's TTL)."""
        endpoints = params.get("kvrt_endpoints") or [params.get("kvrt_endpoint")]
        endpoints = [endpoint for endpoint in endpoints if isinstance(endpoint, str)]
        if len(prompt) < 2 or not endpoints or self._stopping:
            return
        if len(self._releases) >= MAX_RELEASES:
            log.warning("%d releases on their way already: this one is left to the item's TTL", len(self._releases))
            return
        release = asyncio.get_running_loop().create_task(_release_on(endpoints, prompt))
        self._releases.add(release)
        release.add_done_callback(self._releases.discard)

    async def forward_get(self, request: web.Request) -> web.Response:
        async with self.session.get(self.decodes[0] + request.path) as answer:
            return web.Response(status=answer.status, body=await answer.read(), content_type=answer.content_type)


class _Sent:
    """One request's trace: whether it went on a kept-alive connection."""

    reused = False


async def _note_reuse(_: aiohttp.ClientSession, context: SimpleNamespace, __: object) -> None:
    sent = context.trace_request_ctx
    if isinstance(sent, _Sent):
        sent.reused = True


def _prompt_tokens(answer: dict[str, Any]) -> list[int]:
    """The prompt's token ids in a completion's answer (`return_token_ids`): in its choice for
    /v1/completions, at the top for /v1/chat/completions; [] when it has none."""
    tokens = answer.get("prompt_token_ids")
    choices = answer.get("choices")
    if tokens is None and isinstance(choices, list) and choices and isinstance(choices[0], dict):
        tokens = choices[0].get("prompt_token_ids")
    if not isinstance(tokens, list) or not all(isinstance(token, int) for token in tokens):
        return []
    return tokens


async def _release_on(endpoints: Sequence[str], prompt: list[int]) -> None:
    """Evict the item of exactly `prompt` on each producer, if it holds one (the decode may
    have taken it, or released it itself: then there is nothing to do)."""
    for endpoint in endpoints:
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                async with kvrt.Client(endpoint, connect_timeout_s=RELEASE_TIMEOUT_S) as client:
                    await evict_prompt(client, prompt)
        except (kvrt.KVRTError, TimeoutError) as exc:
            log.warning("could not release KV at %s: %s", endpoint, exc)


def application(prefills: Sequence[str], decodes: Sequence[str]) -> web.Application:
    router = Router(prefills, decodes)
    app = web.Application()
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", router.generate)
    app.router.add_post("/v1/chat/completions", router.generate)
    app.router.add_get("/v1/models", router.forward_get)
    app.router.add_get("/health", router.forward_get)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrt proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True, help="a prefill instance's URL (repeat for more)")
    parser.add_argument("--decode", action="append", required=True, help="a decode instance's URL (repeat for more)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # handler_cancellation: a client that leaves ends its handler, and so the decode's request.
    web.run_app(
        application(args.prefill, args.decode), host=args.host, port=args.port, print=None, handler_cancellation=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
