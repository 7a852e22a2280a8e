"""A stand-in for vLLM's OpenAI server, for the router's tests: `/v1/completions` (streamed and
not, in vLLM's format) of a deterministic "model" whose greedy next token depends on every
token before it, `/v1/chat/completions`, `/health`; each request it got is kept, and faults
are switched on by the test.

    fake = FakeInstance(params={"kvrt_endpoint": ...})    # a prefill names its KV's producer
    async with serving(fake.app()) as url: ...
    fake.asked                         # the bodies it got, in order
    fake.drop_after = 2                # drop the connection after 2 streamed tokens (or at once: 0)
    fake.finish_apart = True           # streamed: the finish reason in a chunk of its own, after
                                       # the last token's (as vLLM may send it)
    fake.status = 500                  # answer every request so (and /health 503)
    fake.hold = asyncio.Event()        # hold each request until set
    fake.hold_at = 2                   # ... streamed: once 2 tokens went out

`completion(prompt, **body)` is what a single instance answers, the reference of every test.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import torch
from aiohttp import web

import kvrt

EOS = 2
STREAMS = web.RequestKey("streams", bool)
VOCAB = 509
DEFAULT_MAX_TOKENS = 16


def next_token(context: list[int]) -> int:
    """The model's greedy next token after `context`."""
    return (sum(context) * 7 + len(context) * 3) % VOCAB


def text_of(token: int) -> str:
    return f"<{token}>"


def generate(prompt: list[int], body: dict[str, Any]) -> tuple[list[int], str, int | None]:
    """The tokens a greedy request generates, its finish reason and its stop reason."""
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    stops = set(body.get("stop_token_ids") or [])
    min_tokens = body.get("min_tokens", 0)
    tokens: list[int] = []
    while max_tokens is None or len(tokens) < max_tokens:
        token = next_token(prompt + tokens)
        tokens.append(token)
        if len(tokens) > min_tokens:
            if token in stops:
                return tokens, "stop", token
            if token == EOS and not body.get("ignore_eos"):
                return tokens, "stop", None
        if max_tokens is None and len(tokens) >= 64:
            break
    return tokens, "length", None


def completion(prompt: list[int], **body: Any) -> dict[str, Any]:
    """What a single instance answers (not streamed) for `prompt`, but its id and time."""
    tokens, finish, stop = generate(prompt, body)
    return answer_of(prompt, tokens, finish, stop, body)


def answer_of(
    prompt: list[int], tokens: list[int], finish: str, stop: int | None, body: dict[str, Any],
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    wants = bool(body.get("return_token_ids"))
    choice = {
        "index": 0, "text": "".join(map(text_of, tokens)), "logprobs": None, "finish_reason": finish,
        "stop_reason": stop, "token_ids": tokens if wants else None, "prompt_logprobs": None,
        "prompt_token_ids": prompt if wants else None,
    }  # fmt: skip
    usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(tokens), "completion_tokens": len(tokens)}
    return {
        "id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "m", "choices": [choice],
        "usage": usage, "kv_transfer_params": params,
    }  # fmt: skip


class FakeInstance:
    """One fake vLLM server (see the module docstring)."""

    def __init__(
        self, *, params: dict[str, Any] | None = None, producer: kvrt.Producer | None = None,
        arrivals: asyncio.Queue[FakeInstance] | None = None,
    ) -> None:  # fmt: skip
        self.params = params
        """The `kv_transfer_params` it answers a request that asks for a remote decode."""
        self.producer = producer
        """Where it publishes the prompt's KV when asked for a remote decode (a real producer)."""
        self.asked: list[dict[str, Any]] = []
        self.drop_after: int | None = None
        self.finish_apart = False
        self.status: int | None = None
        self.hold: asyncio.Event | None = None
        self.hold_at = 0
        self.started = asyncio.Event()
        """Set once a request came."""
        self.holding = asyncio.Event()
        """Set once a request is held."""
        self.arrivals = arrivals
        """Where each request it gets puts the instance (one queue for several: who got what)."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.status else 200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def _faults(self, request: web.Request) -> web.Response | None:
        self.started.set()
        if self.arrivals is not None:
            self.arrivals.put_nowait(self)
        if self.hold is not None and not (request_streams(request) and self.hold_at):
            self.holding.set()
            await self.hold.wait()
        if self.status is not None:
            return web.json_response({"error": {"message": "failing"}}, status=self.status)
        if self.drop_after == 0:
            drop(request)
            await asyncio.sleep(0)
            return web.Response()
        return None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.asked.append(body)
        failed = await self._faults(request)
        if failed is not None:
            return failed
        return web.json_response({"choices": [{"message": {"content": "chat"}}], "kv_transfer_params": self.params})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        request[STREAMS] = bool(body.get("stream"))
        self.asked.append(body)
        failed = await self._faults(request)
        if failed is not None:
            return failed
        prompt = body["prompt"]
        assert isinstance(prompt, list), "the fake takes prompts as token ids"
        if prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch: the fake answers its first prompt
        tokens, finish, stop = generate(prompt, body)
        params = None
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            params = self.params
            if self.producer is not None:
                shape = (1, len(prompt), 2, 4)
                await self.producer.insert(torch.tensor(prompt), None, torch.zeros(shape), torch.zeros(shape))
        if not body.get("stream"):
            return web.json_response(answer_of(prompt, tokens, finish, stop, body, params))
        return await self._stream(request, body, prompt, tokens, finish, stop)

    async def _stream(
        self, request: web.Request, body: dict[str, Any], prompt: list[int], tokens: list[int], finish: str,
        stop: int | None,
    ) -> web.StreamResponse:  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        wants = bool(body.get("return_token_ids"))
        options = body.get("stream_options") or {}
        for index, token in enumerate(tokens):
            if self.hold is not None and self.hold_at and index == self.hold_at:
                self.holding.set()
                await self.hold.wait()
            if self.drop_after is not None and index == self.drop_after:
                drop(request)
                return response
            last = index == len(tokens) - 1 and not self.finish_apart
            choice = {
                "index": 0, "text": text_of(token), "logprobs": None, "finish_reason": finish if last else None,
                "stop_reason": stop if last else None, "prompt_token_ids": prompt if wants and index == 0 else None,
                "token_ids": [token] if wants else None,
            }  # fmt: skip
            chunk: dict[str, Any] = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "m",
                                     "choices": [choice]}  # fmt: skip
            if options.get("include_usage") and options.get("continuous_usage_stats"):
                chunk["usage"] = usage(prompt, index + 1)
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if self.finish_apart:
            if self.drop_after == len(tokens):
                drop(request)
                return response
            choice = {
                "index": 0, "text": "", "logprobs": None, "finish_reason": finish, "stop_reason": stop,
                "prompt_token_ids": None, "token_ids": [] if wants else None,
            }  # fmt: skip
            end = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
            await response.write(f"data: {json.dumps(end)}\n\n".encode())
        if options.get("include_usage"):
            end = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "m", "choices": [],
                   "usage": usage(prompt, len(tokens))}  # fmt: skip
            await response.write(f"data: {json.dumps(end)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def request_streams(request: web.Request) -> bool:
    return bool(request.get(STREAMS))


def usage(prompt: list[int], generated: int) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + generated, "completion_tokens": generated}


def drop(request: web.Request) -> None:
    """Close the request's connection at once (an instance killed mid-request)."""
    assert request.transport is not None
    request.transport.close()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def events(text: str) -> list[dict[str, Any] | str]:
    """The data of each event of a streamed answer (`[DONE]` as the string)."""
    found: list[dict[str, Any] | str] = []
    for event in text.split("\n\n"):
        if event.startswith("data: "):
            data = event[len("data: ") :]
            found.append(data if data == "[DONE]" else json.loads(data))
    return found


def streamed_tokens(text: str) -> tuple[list[int], str, str | None]:
    """The tokens, text and finish reason of a streamed answer (asked with `return_token_ids`)."""
    tokens: list[int] = []
    words = ""
    finish = None
    for event in events(text):
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            tokens += choice.get("token_ids") or []
            words += choice["text"]
            finish = choice["finish_reason"] or finish
    return tokens, words, finish
