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

`GET /v1/models` and `GET /health` are the decode instances' (the first one's). A client that
leaves mid-request closes the decode's request too (vLLM aborts it and the connector releases
its KV on the producer). Needs aiohttp (a dependency of vLLM).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any, Final

import aiohttp
from aiohttp import web

from kvrt._errors import InvalidInputError

log = logging.getLogger("kvrt.integrations.vllm.proxy")

TIMEOUT_S: Final = 600.0
"""The longest a request to an instance may take (a long decode)."""


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

    async def start(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))

    async def stop(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the router starts its session with the application"
        return self._session

    async def prefill(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """Run the prompt on a prefill instance; the `kv_transfer_params` it answers with."""
        asked = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        asked.pop("stream_options", None)
        asked.pop("max_completion_tokens", None)
        url = next(self._next_prefill) + path
        try:
            async with self.session.post(url, json=asked) as response:
                if response.status != 200:
                    log.warning("prefill at %s answered %d: the decode computes the prompt", url, response.status)
                    return None
                answer = await response.json()
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            log.warning("prefill at %s failed (%s): the decode computes the prompt", url, exc)
            return None
        params = answer.get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error("the body is not JSON", 400)
        if not isinstance(body, dict):
            return _error("the body is not a JSON object", 400)
        params = await self.prefill(request.path, body)
        decode_body = {**body, "kv_transfer_params": params} if params else dict(body)
        url = next(self._next_decode) + request.path
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(url, json=decode_body) as answer:
                content_type = answer.headers.get("Content-Type", "application/json")
                response = web.StreamResponse(status=answer.status, headers={"Content-Type": content_type})
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("decode at %s failed (%s: %s)", url, type(exc).__name__, exc)
            if response is not None:
                raise  # its status went out already: the connection closes, the client sees the body cut short
            return _error(f"the decode instance at {url} failed: {type(exc).__name__}: {exc}", 502)

    async def forward_get(self, request: web.Request) -> web.Response:
        async with self.session.get(self.decodes[0] + request.path) as answer:
            return web.Response(status=answer.status, body=await answer.read(), content_type=answer.content_type)


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
