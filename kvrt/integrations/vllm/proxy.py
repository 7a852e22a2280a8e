"""A router for disaggregated vLLM with `KvrtConnector`: OpenAI-compatible, each request's
prompt to a prefill instance, then the request to a decode instance with the prefill's
`kv_transfer_params` (which name the kvrt producers holding its KV).

    python -m kvrt.integrations.vllm.proxy --prefill http://p0:8100 --prefill http://p1:8100 \\
        --decode http://d0:8200 --decode http://d1:8200 [--port 8000] [--first-token prefill|decode]
    kvrt proxy --prefill ... --decode ...      (the same)

For each `POST /v1/completions` (and `/v1/chat/completions`):

1. The body goes to the least busy prefill instance with `max_tokens` 1, not streamed: its
   forward pass computes the prompt, kvrt publishes the KV, and it samples the first token.
   One that fails (refuses or drops the connection, times out, answers a 5xx) is taken out and
   the body goes to another, once. With none answering, the decode computes the prompt.
2. The first token at once (`--first-token prefill`, the default): the router answers the
   prefill's first token to the client as soon as it has it (the first event of a stream; the
   beginning of a whole answer's text and tokens), then asks the least busy decode instance to
   go on from the prompt plus that token, with one token fewer to generate and the prefill's
   `kv_transfer_params`: the decode finds the prompt's KV by its tokens and computes from the
   first token on (`_first_token`). A first token that ends the request (`max_tokens` 1, an end
   of sequence, a stop token) ends it there: no decode, and the prompt's KV is released on its
   producers. Requests whose answer cannot be made so (chat, `n` > 1, logprobs, echo,
   structured output, stop strings, seeded sampling, output penalties: `_first_token.Fallback`)
   take the plain path: the decode gets the request as the client sent it, with the prefill's
   `kv_transfer_params`, and computes every output token.
3. A decode that fails is taken out. One that failed before the client got anything, or mid-
   answer on the first-token path, is replaced by the least busy other decode, which goes on
   from what the client has (each decode is tried once a request); on the plain path a decode
   that fails mid-answer closes the client's connection. With no decode left: a 502 naming
   the last one, or, mid-stream, an error event.

Instances out are asked for their `/health` until they answer, then take requests again
(`_instances`). `GET /health` tells each instance's state (200 while a decode is up, else
503); `GET /metrics` the router's Prometheus metrics (`_router_metrics`); `GET /v1/models` is a
decode's.

A request sent on a kept-alive connection that the instance closes without an answer goes
again, once, on a new connection: an instance's server closes a connection idle for its
keep-alive time (vLLM's: 5 s), and a request sent as it does was never read.

A client that leaves mid-request closes the decode's request too (vLLM aborts it and the
connector releases its KV on the producer). A hand-off that does not end in a decode's whole
answer (the client left, every decode failed, the first token ended it) has the router
release the prompt's KV on the producers the prefill named: the decode may never have seen
the request, and then nobody else would. A prefill whose client leaves runs to its answer for
that reason. Needs aiohttp and prometheus-client (dependencies of vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Final

import aiohttp
from aiohttp import web

import kvrt
from kvrt._errors import InvalidInputError
from kvrt.integrations.vllm._first_token import (
    Continuation,
    Fallback,
    event_bytes,
    fallback,
    prefill_body,
    prompt_tokens,
)
from kvrt.integrations.vllm._instances import Instance, Instances
from kvrt.integrations.vllm._lookups import evict_prompt
from kvrt.integrations.vllm._router_metrics import CONTENT_TYPE, RouterMetrics

log = logging.getLogger("kvrt.integrations.vllm.proxy")

TIMEOUT_S: Final = 600.0
"""The longest a request to an instance may take (a long decode)."""

RELEASE_TIMEOUT_S: Final = 10.0
"""The longest a release of a prompt's KV on one producer may take (it is never waited for)."""

MAX_RELEASES: Final = 1024
"""Releases on their way at most; past it, what one would free leaves with the item's TTL."""

STREAM_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

PREFILL_TRIES: Final = 2
"""Prefill instances a request is sent to at most: one, and another if that one failed."""


def _json(answer: dict[str, Any], status: int = 200) -> web.Response:
    """`answer` as JSON, compact as vLLM's server writes it."""
    return web.json_response(answer, status=status, dumps=_compact)


def _compact(answer: Any) -> str:
    return json.dumps(answer, separators=(",", ":"))


def _error(message: str, status: int) -> web.Response:
    """An error as OpenAI's API (and vLLM's server) writes one, which clients know how to read."""
    return _json({"error": {"message": message}}, status=status)


class _InstanceError(Exception):
    """An instance answered in a way that counts as its failure: a 5xx, or a stream cut short."""

    def __init__(self, message: str, label: str) -> None:
        super().__init__(message)
        self.label = label


class _ClientGone(Exception):
    """The client's connection closed as the router wrote to it."""


@dataclass(slots=True)
class Prefilled:
    """A prefill's outcome: its answer (None: none answered, `reason` says why), the
    `kv_transfer_params` it gave, the prompt's tokens, when it answered."""

    answer: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    prompt: tuple[int, ...] = ()
    answered_at: float = 0.0
    reason: Fallback | None = None


def _failure(error: BaseException) -> tuple[str, str]:
    """An instance's failure: its metric label and its words."""
    if isinstance(error, _InstanceError):
        return error.label, str(error)
    if isinstance(error, aiohttp.ClientConnectorError):
        label = "connect"
    elif isinstance(error, TimeoutError):
        label = "timeout"
    else:
        label = "disconnected"
    return label, f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class Router:
    """The instances to route to and one HTTP session to reach them (see the module docstring)."""

    def __init__(self, prefills: Sequence[str], decodes: Sequence[str], *, first_token: bool = True) -> None:
        if not prefills or not decodes:
            raise InvalidInputError("the router needs at least one prefill and one decode instance")
        self.first_token = first_token
        """Whether the prefill's first token is the client's (`--first-token prefill`)."""
        self.metrics = RouterMetrics()
        self.prefills = Instances("prefill", prefills, on_change=self.metrics.instance_changed)
        self.decodes = Instances("decode", decodes, on_change=self.metrics.instance_changed)
        self._session: aiohttp.ClientSession | None = None
        self._fresh_session: aiohttp.ClientSession | None = None
        """For a request sent again: a new connection each (never one kept alive)."""
        self._releases: set[asyncio.Task[None]] = set()
        """Releases of KV on their way (each removes itself when done; cancelled at stop)."""
        self._prefills: set[asyncio.Future[Prefilled]] = set()
        """Prefills whose clients left, running to their answer (cancelled at stop)."""
        self._stopping = False

    async def start(self, _: web.Application) -> None:
        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(_note_reuse)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S), trace_configs=[reuse])
        self._fresh_session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S), connector=aiohttp.TCPConnector(force_close=True)
        )
        self.prefills.start(self._fresh_session)
        self.decodes.start(self._fresh_session)

    async def stop(self, _: web.Application) -> None:
        # No release starts now; those on their way get `RELEASE_TIMEOUT_S` to end (what they
        # free would wait for its TTL otherwise), then they and the prefills are cancelled.
        self._stopping = True
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=RELEASE_TIMEOUT_S)
        pending: list[asyncio.Future[Any]] = [*self._prefills, *self._releases]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self.prefills.aclose()
        await self.decodes.aclose()
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

    def _failed(self, instances: Instances, instance: Instance, error: BaseException) -> None:
        label, words = _failure(error)
        self.metrics.failures.labels(instance.kind, instance.url, label).inc()
        log.warning("%s at %s failed (%s)", instance.kind, instance.url, words)
        instances.failed(instance, words)

    # -- the prefill ----------------------------------------------------------------------------

    async def prefill(self, path: str, body: dict[str, Any]) -> Prefilled:
        """Run the prompt on the least busy prefill instance (on another, once, if that one
        failed): its answer, the `kv_transfer_params` it gave and the prompt's tokens (to
        release its KV should no decode take it)."""
        asked = prefill_body(body)
        tried: list[Instance] = []
        while len(tried) < PREFILL_TRIES and (instance := self.prefills.pick(tried, out_too=False)) is not None:
            if tried:
                self.metrics.retries.labels("prefill").inc()
            tried.append(instance)
            started = time.perf_counter()
            try:
                with self.prefills.using(instance):
                    async with self.post(instance.url + path, asked) as response:
                        if response.status >= 500:
                            raise _InstanceError(f"answered {response.status}", "status_5xx")
                        raw = await response.read()
            except (aiohttp.ClientError, TimeoutError, _InstanceError) as exc:
                self._failed(self.prefills, instance, exc)
                continue
            self.prefills.succeeded(instance)
            answered_at = time.perf_counter()
            self.metrics.prefill.observe(answered_at - started)
            try:
                answer = json.loads(raw) if response.status == 200 else None
            except json.JSONDecodeError:
                answer = None
            if not isinstance(answer, dict):
                # It refused the request (the decode will answer the client's error), or answered
                # what is no completion.
                log.info("prefill at %s answered %d: the decode computes the prompt", instance.url, response.status)
                return Prefilled(reason=Fallback.PREFILL_FAILED)
            params = answer.get("kv_transfer_params")
            params = params if isinstance(params, dict) else None
            return Prefilled(answer, params, tuple(prompt_tokens(answer)), answered_at)
        if not tried:
            log.warning("every prefill instance is out: the decode computes the prompt")
            return Prefilled(reason=Fallback.NO_PREFILL)
        log.warning("no prefill answered (%d tried): the decode computes the prompt", len(tried))
        return Prefilled(reason=Fallback.PREFILL_FAILED)

    # -- a request ------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error("the body is not JSON", 400)
        if not isinstance(body, dict):
            return _error("the body is not a JSON object", 400)
        reason = fallback(request.path, body) if self.first_token else Fallback.OFF
        # The prefill runs to its answer even when the client leaves meanwhile: a prefill that
        # finished as its client left has published KV that only its answer names, and that
        # answer is what lets the router release it.
        prefilling = asyncio.ensure_future(self.prefill(request.path, body))
        try:
            prefilled = await asyncio.shield(prefilling)
        except asyncio.CancelledError:
            self._release_when_answered(prefilling)
            raise
        going: Continuation | None = None
        if prefilled.answer is None:
            reason = prefilled.reason
        elif reason is None:
            going = Continuation.of(body, prefilled.answer)
            reason = Fallback.NO_TOKEN if going is None else None
        if going is not None:
            return await self._go_on(request, going, prefilled, arrived)
        if reason is not None:
            self.metrics.fallbacks.labels(reason.value).inc()
        return await self._decode(request, body, prefilled, arrived)

    async def _decode(
        self, request: web.Request, body: dict[str, Any], prefilled: Prefilled, arrived: float
    ) -> web.StreamResponse:
        """The plain path: the client's request to the least busy decode (with the prefill's
        `kv_transfer_params`), its answer the client's; another decode if one fails before
        the client got anything."""
        params = prefilled.params
        decode_body = {**body, "kv_transfer_params": params} if params else dict(body)
        self.metrics.requests.labels("decode").inc()
        response: web.StreamResponse | None = None
        answered = False
        tried: list[Instance] = []
        failure = ""
        try:
            while (instance := self.decodes.pick(tried)) is not None:
                if tried:
                    self.metrics.retries.labels("decode").inc()
                tried.append(instance)
                url = instance.url + request.path
                try:
                    with self.decodes.using(instance):
                        async with self.post(url, decode_body) as answer:
                            if answer.status >= 500:
                                raise _InstanceError(f"answered {answer.status}", "status_5xx")
                            content_type = answer.headers.get("Content-Type", "application/json")
                            response = web.StreamResponse(status=answer.status, headers={"Content-Type": content_type})
                            await _prepare(response, request)
                            first = True
                            async for chunk in answer.content.iter_any():
                                if first and prefilled.answer is not None:
                                    self.metrics.handoff.observe(time.perf_counter() - prefilled.answered_at)
                                if first and body.get("stream"):
                                    self.metrics.time_to_first_token.labels("decode").observe(
                                        time.perf_counter() - arrived
                                    )
                                first = False
                                await _write(response, chunk)
                            await _write_eof(response)
                except (aiohttp.ClientError, TimeoutError, _InstanceError) as exc:
                    self._failed(self.decodes, instance, exc)
                    failure = f"the decode instance at {url} failed: {_failure(exc)[1]}"
                    if response is not None:
                        raise  # its status went out already: the connection closes, the client sees the body cut short
                    continue
                self.decodes.succeeded(instance)
                answered = response.status == 200  # a refusal took no KV
                return response
            return _error(failure, 502)
        except _ClientGone:
            return response or web.Response()
        finally:
            if not answered and params:  # the client left, or the decodes failed: its KV may wait for nobody
                self._release(params, prefilled.prompt)

    async def _go_on(
        self, request: web.Request, going: Continuation, prefilled: Prefilled, arrived: float
    ) -> web.StreamResponse:
        """The first token at once: the prefill's first token to the client now, then the least
        busy decode goes on from it (another, from what the client has, if one fails)."""
        params = prefilled.params
        route = "first_token_only" if going.ended else "first_token"
        self.metrics.requests.labels(route).inc()
        response: web.StreamResponse | None = None
        answered = False
        tried: list[Instance] = []
        try:
            if going.streamed:
                response = web.StreamResponse(headers=STREAM_HEADERS)
                await _prepare(response, request)
                await _write(response, going.first_event())
                self.metrics.time_to_first_token.labels(route).observe(time.perf_counter() - arrived)
            if going.ended:  # no decode: what the prefill published is released below
                if response is None:
                    return _json(going.ended_answer())
                await _write_eof(response)
                return response
            failure = ""
            handed_at: float | None = prefilled.answered_at
            while (instance := self.decodes.pick(tried)) is not None:
                if tried:
                    self.metrics.retries.labels("decode").inc()
                    log.info("the answer goes on at decode %s from %d tokens", instance.url, len(going.tokens))
                tried.append(instance)
                try:
                    with self.decodes.using(instance):
                        if response is None:
                            whole, answered = await self._decode_whole(instance, request.path, going, params, handed_at)
                        else:
                            answered = await self._decode_stream(
                                instance, request.path, going, params, response, handed_at
                            )
                except (aiohttp.ClientError, TimeoutError, _InstanceError, json.JSONDecodeError) as exc:
                    self._failed(self.decodes, instance, exc)
                    failure = f"the decode instance at {instance.url} failed: {_failure(exc)[1]}"
                    handed_at = None
                    if response is not None and going.ends_at_its_length():
                        await _write(response, going.end_events())
                        await _write_eof(response)
                        return response
                    continue
                self.decodes.succeeded(instance)
                if response is None:
                    return whole
                await _write_eof(response)
                return response
            if response is None:
                return _error(failure, 502)
            await _write(response, event_bytes({"error": {"message": failure, "code": 502}}) + event_bytes("[DONE]"))
            await _write_eof(response)
            return response
        except _ClientGone:
            return response or web.Response()
        finally:
            # Released unless the first decode gave the whole answer: the first token ended the
            # request, the client left, every decode failed, or one failed and who took the KV
            # is not known (a later decode's lookup may have found it too).
            if params and (not answered or len(tried) > 1):
                self._release(params, prefilled.prompt)

    async def _decode_whole(
        self, instance: Instance, path: str, going: Continuation, params: dict[str, Any] | None,
        handed_at: float | None,
    ) -> tuple[web.Response, bool]:  # fmt: skip
        """A decode's answer, not streamed, going on from what the client has: the client's,
        and whether it is the whole completion (not the decode's refusal)."""
        async with self.post(instance.url + path, going.decode_body(params)) as answer:
            if answer.status >= 500:
                raise _InstanceError(f"answered {answer.status}", "status_5xx")
            raw = await answer.read()
        if handed_at is not None:
            self.metrics.handoff.observe(time.perf_counter() - handed_at)
        if answer.status != 200:  # it refused the request: its error is the client's
            return web.Response(status=answer.status, body=raw, content_type=answer.content_type), False
        decoded = json.loads(raw)
        if not isinstance(decoded, dict):
            raise _InstanceError("answered what is no completion", "disconnected")
        return _json(going.answer(decoded)), True

    async def _decode_stream(
        self, instance: Instance, path: str, going: Continuation, params: dict[str, Any] | None,
        response: web.StreamResponse, handed_at: float | None,
    ) -> bool:  # fmt: skip
        """A decode's stream, going on from what the client has, rewritten into the client's
        (its events after the first token's); whether it is the whole completion (not the
        decode's refusal). Raises `_InstanceError` if it ends short."""
        async with self.post(instance.url + path, going.decode_body(params)) as answer:
            if answer.status >= 500:
                raise _InstanceError(f"answered {answer.status}", "status_5xx")
            if answer.status != 200:  # it refused to go on: its error ends the client's stream
                error = {"message": (await answer.text())[:2000], "code": answer.status}
                await _write(response, event_bytes({"error": error}) + going.last_events())
                return False
            async for data in _events(answer.content):
                if handed_at is not None:
                    self.metrics.handoff.observe(time.perf_counter() - handed_at)
                    handed_at = None
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if isinstance(event, dict) and ("choices" in event or "usage" in event):
                    await _write(response, event_bytes(going.event(event)))
                else:  # an error the decode reported: the client's as it is
                    await _write(response, b"data: " + data + b"\n\n")
            else:
                if not going.ended:
                    raise _InstanceError("its stream ended before the answer did", "disconnected")
        await _write(response, going.last_events())
        return True

    # -- releases -------------------------------------------------------------------------------

    def _release_when_answered(self, prefilling: asyncio.Future[Prefilled]) -> None:
        """Release what a prefill whose client left publishes, once it answered (the prefill
        is one of the router's own tasks until then: cancelled at stop)."""

        def answered(done: asyncio.Future[Prefilled]) -> None:
            self._prefills.discard(done)
            if not done.cancelled() and done.exception() is None:
                prefilled = done.result()
                if prefilled.params:
                    self._release(prefilled.params, prefilled.prompt)

        self._prefills.add(prefilling)
        prefilling.add_done_callback(answered)

    def _release(self, params: dict[str, Any], prompt: Sequence[int]) -> None:
        """Evict the item of exactly `prompt` from every producer `params` name, in a task of
        the router's own (never waited for; what it cannot free leaves with the item's TTL)."""
        endpoints = params.get("kvrt_endpoints") or [params.get("kvrt_endpoint")]
        endpoints = [endpoint for endpoint in endpoints if isinstance(endpoint, str)]
        if len(prompt) < 2 or not endpoints or self._stopping:
            return
        if len(self._releases) >= MAX_RELEASES:
            log.warning("%d releases on their way already: this one is left to the item's TTL", len(self._releases))
            return
        self.metrics.releases.inc()
        release = asyncio.get_running_loop().create_task(_release_on(endpoints, list(prompt)))
        self._releases.add(release)
        release.add_done_callback(self._releases.discard)

    # -- the rest of the API ----------------------------------------------------------------------

    async def forward_get(self, request: web.Request) -> web.Response:
        """A GET (`/v1/models`) answered by the least busy decode (another if it fails)."""
        tried: list[Instance] = []
        failure = ""
        while (instance := self.decodes.pick(tried)) is not None:
            tried.append(instance)
            try:
                async with self.session.get(instance.url + request.path) as answer:
                    if answer.status >= 500:
                        raise _InstanceError(f"answered {answer.status}", "status_5xx")
                    body = await answer.read()
                    return web.Response(status=answer.status, body=body, content_type=answer.content_type)
            except (aiohttp.ClientError, TimeoutError, _InstanceError) as exc:
                self._failed(self.decodes, instance, exc)
                failure = f"the decode instance at {instance.url} failed: {_failure(exc)[1]}"
        return _error(failure, 502)

    async def health(self, _: web.Request) -> web.Response:
        """Each instance's state; 200 while a decode is up (requests are answered), else 503."""
        serving = any(instance.up for instance in self.decodes.all)
        state = {"status": "ok" if serving else "no decode up", "prefill": self.prefills.view(),
                 "decode": self.decodes.view()}  # fmt: skip
        return _json(state, status=200 if serving else 503)

    async def metrics_page(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})


async def _prepare(response: web.StreamResponse, request: web.Request) -> None:
    try:
        await response.prepare(request)
    except ConnectionError as exc:
        raise _ClientGone from exc


async def _write(response: web.StreamResponse, data: bytes) -> None:
    """`data` to the client (`_ClientGone` if it left: no instance's failure)."""
    try:
        await response.write(data)
    except ConnectionError as exc:
        raise _ClientGone from exc


async def _write_eof(response: web.StreamResponse) -> None:
    try:
        await response.write_eof()
    except ConnectionError as exc:
        raise _ClientGone from exc


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The data of each server-sent event of a stream, as it comes (an event of any size: a
    first one may carry a long prompt's tokens)."""
    pending = bytearray()
    async for chunk in content.iter_any():
        pending += chunk
        while (end := pending.find(b"\n\n")) >= 0:
            event = bytes(pending[:end])
            del pending[: end + 2]
            lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                yield b"\n".join(lines)


class _Sent:
    """One request's trace: whether it went on a kept-alive connection."""

    reused = False


async def _note_reuse(_: aiohttp.ClientSession, context: SimpleNamespace, __: object) -> None:
    sent = context.trace_request_ctx
    if isinstance(sent, _Sent):
        sent.reused = True


async def _release_on(endpoints: Sequence[str], prompt: list[int]) -> None:
    """Evict the item of exactly `prompt` on each producer, if it holds one (the decode may
    have taken it, or released it itself: then there is nothing to do)."""
    for endpoint in endpoints:
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                async with kvrt.Client(endpoint, connect_timeout_s=RELEASE_TIMEOUT_S) as client:
                    await evict_prompt(client, prompt)
        except (kvrt.KVRTError, TimeoutError) as exc:
            log.warning("could not release KV at %s: %s: %s", endpoint, type(exc).__name__, exc)


ROUTER: Final = web.AppKey("router", Router)
"""The application's router (its instances, its metrics)."""


def application(prefills: Sequence[str], decodes: Sequence[str], *, first_token: bool = True) -> web.Application:
    router = Router(prefills, decodes, first_token=first_token)
    app = web.Application()
    app[ROUTER] = router
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_post("/v1/completions", router.generate)
    app.router.add_post("/v1/chat/completions", router.generate)
    app.router.add_get("/v1/models", router.forward_get)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_page)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrt proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True, help="a prefill instance's URL (repeat for more)")
    parser.add_argument("--decode", action="append", required=True, help="a decode instance's URL (repeat for more)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--first-token", choices=["prefill", "decode"], default="prefill",
        help="where the client's first token comes from: the prefill's, at once (default), or the decode's",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # handler_cancellation: a client that leaves ends its handler, and so the decode's request.
    app = application(args.prefill, args.decode, first_token=args.first_token == "prefill")
    web.run_app(app, host=args.host, port=args.port, print=None, handler_cancellation=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
