"""The decode scheduler's questions to producers, asked without ever holding its work for them.

vLLM's scheduler thread runs every request of the instance: a lookup that held it for a round
trip would hold them all. So `Lookups` queues each request's probe (`ask`), sends a step's
probes to each producer as one `probe_many` message once the step is planned (`send`), and
reads the answer at a later step (`answer`: None while it is on its way, vLLM's "ask again
next step"). Releases of KV that no load will take (`release`) go the same way and are never
waited for. Only a step that scheduled nothing, every request waiting for a lookup, waits
briefly for the first answer (`wait_answer`): the engine has no other work then. All network
work runs on one kvrt loop thread that this object owns; the scheduler's thread only posts
work there (`LoopThread.post`: it never waits for that thread, however busy) and looks at
futures.

A producer that does not answer within `timeout_s` (gone, stalled, unreachable; its first
lookup's handshake has as long again, counted apart) answers 0 for the requests it was asked
about, and is not asked again for a while (`SILENT_BACKOFF_S`): its requests are computed at
once meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Final

import anyio
import torch

import kvrt
from kvrt._loop_thread import LoopThread
from kvrt._loop_watch import WatchIntervals, fail_after_listening
from kvrt._messages import MAX_BATCH
from kvrt._protocol import DEFAULT_HEARTBEAT_S

log = logging.getLogger("kvrt.integrations.vllm")

SILENT_BACKOFF_S: Final = (1.0, 30.0)
"""A producer that did not answer is not asked again for the first figure, doubled at each
failure up to the second."""

MAX_SILENT_PRODUCERS: Final = 1024
"""Silent producers remembered at most (endpoints come with the requests)."""

MAX_RELEASES: Final = 4096
"""Releases on their way at most (to a producer that is gone each waits for its connect
timeout): past it, what a release would free leaves with its item's TTL."""


@dataclass(slots=True)
class _Batch:
    """One `probe_many` on its way: its producer and its future (the matched tokens, in order)."""

    endpoint: str
    answers: concurrent.futures.Future[list[int]]
    settled: bool = False
    """Its outcome was counted (a failure backs its producer off once, not once a request)."""


CONTINUED_TOKENS: Final = 1
"""Tokens a decode's prompt may hold past its prefill's: a router that answered the prefill's
first token at once asks the decode to go on from the prompt plus that token."""


async def evict_prompt(client: kvrt.Client, prompt: list[int], *, shorter_by: int = 0) -> None:
    """Evict the item of exactly `prompt` on `client`'s producer, or, failing that, of `prompt`
    less up to `shorter_by` last tokens, if it holds one (taken or evicted meanwhile: nothing to
    do). A probe answers the longest item that is a prefix of the prompt, or that the prompt
    begins: `matched` is the shorter one's length."""
    (found,) = await client.probe_many([torch.tensor(prompt, dtype=torch.int64)])
    if found.item_id is not None and len(prompt) - shorter_by <= found.matched <= len(prompt):
        with contextlib.suppress(kvrt.NotFoundError):
            await client.evict(found.item_id)


class Lookups:
    """Probes and releases of requests' KV on their producers (see the module docstring).

    Called from one thread (vLLM's scheduler): `ask`, `send`, `answer`, `forget`, `release`,
    each returning at once; `close` once, at shutdown."""

    def __init__(self, *, timeout_s: float, heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._loop = LoopThread("kvrt-lookups", "scheduler's lookups")
        self._loop_intervals = WatchIntervals(self._loop.watch, "lookups_")
        self._queued: dict[str, dict[str, list[int]]] = {}
        """Per producer, the probes of this step not sent yet: request id -> prompt."""
        self._asked: dict[str, tuple[_Batch, int]] = {}
        """Per request sent, its batch and its place in it."""
        self._silent: dict[str, tuple[float, float]] = {}
        """Per producer that did not answer: when it may be asked again (monotonic), and the
        backoff that led there; oldest first."""
        self._unanswered: set[str] = set()
        """Requests whose lookup failed (answered 0), until forgotten."""
        self._releases: set[concurrent.futures.Future[None]] = set()
        """Releases on their way (a done one removes itself, on kvrt's thread)."""
        self._clients: dict[str, kvrt.Client] = {}
        """On the loop thread only: one control client per producer, kept while it answers."""
        self._started: dict[str, asyncio.Future[kvrt.Client]] = {}
        """On the loop thread only: the handshakes of clients not yet started."""

    # -- the scheduler's thread --------------------------------------------------------------

    def asks(self, endpoint: str) -> bool:
        """Whether `endpoint` may be asked now: not while it is in its backoff after failing."""
        silent = self._silent.get(endpoint)
        return silent is None or time.monotonic() >= silent[0]

    def ask(self, request_id: str, endpoint: str, prompt: list[int]) -> None:
        """Queue a probe of `prompt` on `endpoint`, sent with the step's others by `send`."""
        self._queued.setdefault(endpoint, {})[request_id] = prompt

    def send(self) -> None:
        """Send the queued probes: one `probe_many` per producer (per 256 probes)."""
        queued, self._queued = self._queued, {}
        for endpoint, probes in queued.items():
            request_ids = list(probes)
            for start in range(0, len(request_ids), MAX_BATCH):
                chosen = request_ids[start : start + MAX_BATCH]
                prompts = [probes[request_id] for request_id in chosen]
                batch = _Batch(endpoint, self._loop.post(functools.partial(self._probe, endpoint, prompts), "lookup"))
                for index, request_id in enumerate(chosen):
                    self._asked[request_id] = (batch, index)

    def answer(self, request_id: str) -> int | None:
        """The tokens the request's producer holds (0: none, or it did not answer), or None
        while the answer is on its way or not sent yet."""
        asked = self._asked.get(request_id)
        if asked is None:
            return None
        batch, index = asked
        if not batch.answers.done():
            return None
        del self._asked[request_id]
        try:
            matched = batch.answers.result()[index]
        except Exception as exc:  # any failure of the lookup means: compute it here
            self._unanswered.add(request_id)
            if not batch.settled:
                batch.settled = True
                if not isinstance(exc, kvrt.ClosedError) or not self._silent.get(batch.endpoint):
                    self._failed(batch.endpoint, exc)  # once an incident, not once a batch it ended
            return 0
        if not batch.settled:
            batch.settled = True
            self._silent.pop(batch.endpoint, None)
        return matched

    def wait_answer(self, timeout_s: float) -> None:
        """Block until an answer not read yet is there or `timeout_s` passed: at once when one
        is there already, or none is on its way (the GIL is released meanwhile)."""
        answers = {batch.answers for batch, _ in self._asked.values()}
        if answers and not any(answer.done() for answer in answers):
            concurrent.futures.wait(answers, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def wait_settled(self, timeout_s: float) -> bool:
        """Block until every probe and release sent so far has ended (or `timeout_s` passed):
        for a caller that must see their effect, such as a test playing the scheduler's steps."""
        futures: list[concurrent.futures.Future[Any]] = [batch.answers for batch, _ in self._asked.values()]
        futures += list(self._releases)
        _, pending = concurrent.futures.wait(futures, timeout=timeout_s)
        return not pending

    def unanswered(self, request_id: str) -> bool:
        """Whether the request's lookup failed (its producer may hold its KV all the same)."""
        return request_id in self._unanswered

    def forget(self, request_id: str) -> None:
        """The request is gone: its answer, if one comes, is dropped."""
        self._asked.pop(request_id, None)
        self._unanswered.discard(request_id)
        for probes in self._queued.values():
            probes.pop(request_id, None)

    def release(self, endpoint: str, prompt: list[int], *, shorter_by: int = 0) -> None:
        """Evict the item of exactly `prompt` from `endpoint`, or of `prompt` less up to
        `shorter_by` last tokens, if it is there (a request that will never take it); not
        waited for (a producer in its backoff is told too: a release costs the scheduler
        nothing, and what it frees would otherwise wait for its TTL)."""
        if len(self._releases) >= MAX_RELEASES:
            log.warning("%d releases on their way already: this one is left to the item's TTL", len(self._releases))
            return
        release = self._loop.post(functools.partial(self._release, endpoint, prompt, shorter_by), "release")
        self._releases.add(release)
        release.add_done_callback(self._releases.discard)

    def take_counters(self, every_s: float) -> dict[str, float]:
        """The loop's figures since the last call, once `every_s` passed since it (`lookups_loop_*`)."""
        return self._loop_intervals.take(every_s)

    def close(self) -> None:
        """Close the clients and stop the loop thread (what is in flight is cancelled)."""
        try:
            self._loop.call(self._close_clients, "close", timeout_s=self._timeout_s + 1.0)
        except Exception as exc:  # closing goes on whatever a client does
            log.debug("closing the lookups' clients: %s", exc)
        self._loop.stop()

    def silence(self, endpoint: str, why: str) -> None:
        """Ask `endpoint` nothing for a while (a load from it failed): its backoff, as after a
        lookup it did not answer."""
        if self.asks(endpoint):
            self._failed(endpoint, RuntimeError(why))

    def _failed(self, endpoint: str, error: BaseException) -> None:
        first, longest = SILENT_BACKOFF_S
        _, backoff = self._silent.pop(endpoint, (0.0, first / 2))
        backoff = min(2 * backoff, longest)
        self._silent[endpoint] = (time.monotonic() + backoff, backoff)
        while len(self._silent) > MAX_SILENT_PRODUCERS:
            del self._silent[next(iter(self._silent))]
        why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        log.warning("the producer at %s did not answer a lookup (%s): not asked for %.0f s", endpoint, why, backoff)

    # -- kvrt's loop thread -------------------------------------------------------------------

    async def _client(self, endpoint: str) -> kvrt.Client:
        """The producer's client: one per producer, whose handshake every batch to it waits for."""
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = kvrt.Client(
                endpoint,
                connect_timeout_s=self._timeout_s,
                reply_timeout_s=self._timeout_s,
                heartbeat_s=self._heartbeat_s,
            )
            handshake = self._started[endpoint] = asyncio.ensure_future(client.start())
            handshake.add_done_callback(functools.partial(self._handshake_ended, endpoint, client))
        started = self._started.get(endpoint)
        if started is not None:
            await asyncio.shield(started)  # a batch that gives up leaves the handshake to the others
        return client

    def _handshake_ended(self, endpoint: str, client: kvrt.Client, started: asyncio.Future[kvrt.Client]) -> None:
        """A client's handshake ended: a failed one (its client closed itself) is forgotten, so
        that the next batch to that producer connects afresh."""
        if self._started.get(endpoint) is started:
            del self._started[endpoint]
        if (started.cancelled() or started.exception() is not None) and self._clients.get(endpoint) is client:
            del self._clients[endpoint]

    async def _drop_client(self, endpoint: str) -> None:
        client = self._clients.pop(endpoint, None)
        started = self._started.pop(endpoint, None)
        if started is not None and not started.done():
            started.cancel()
        if client is not None:
            await client.aclose()

    async def _probe(self, endpoint: str, prompts: list[list[int]]) -> list[int]:
        try:
            # The handshake is bounded by the client's connect timeout; the lookup's own timeout
            # counts from there: a producer's first lookup is not held to one bound for both.
            client = await self._client(endpoint)
            with fail_after_listening(self._timeout_s):
                answers = await client.probe_many([torch.tensor(prompt, dtype=torch.int64) for prompt in prompts])
        except (kvrt.PeerLostError, kvrt.ClosedError):
            # The connection is gone: a new client reconnects. A producer that is only slow keeps
            # its client (the other batches on their way to it still get their answers).
            with anyio.CancelScope(shield=True):
                await self._drop_client(endpoint)
            raise
        return [answer.matched for answer in answers]

    async def _release(self, endpoint: str, prompt: list[int], shorter_by: int) -> None:
        try:
            client = await self._client(endpoint)
            with fail_after_listening(self._timeout_s):
                await evict_prompt(client, prompt, shorter_by=shorter_by)
        except (kvrt.PeerLostError, kvrt.ClosedError) as exc:
            log.warning("could not release KV at %s: %s", endpoint, exc)
            with anyio.CancelScope(shield=True):
                await self._drop_client(endpoint)
        except (kvrt.KVRTError, TimeoutError) as exc:
            log.warning("could not release KV at %s: %s", endpoint, exc)

    async def _close_clients(self) -> None:
        for endpoint in list(self._clients):
            await self._drop_client(endpoint)
