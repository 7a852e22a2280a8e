"""`kvrt.Client`: the control endpoint from outside the engine (routers, operators, monitors).

It speaks only the protocol in docs/protocol.md, over the same link as a consumer (hello,
heartbeats, request ids), and never takes an item:

    async with kvrt.Client("tcp://prefill-0:5555") as client:
        (await client.probe(tokens)).matched   # route the request to the longest prefix
        await client.probe_many([tokens_a, tokens_b])   # a scheduler step's lookups, one message
        await client.stats()
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Self, TypeVar

import torch
import zmq

from kvrt import _arguments
from kvrt import _messages as m
from kvrt._auth import CurveKeys
from kvrt._consumer import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_REPLY_TIMEOUT_S, LinkSession, _Link
from kvrt._errors import ClosedError, InvalidInputError, RemoteProtocolError
from kvrt._item import query_bytes
from kvrt._protocol import DEFAULT_HEARTBEAT_S
from kvrt._service import AsyncService
from kvrt.transports.tcp import TcpReceiver

_Reply = TypeVar("_Reply", bound=m.Message)


class Client(AsyncService):
    """Health, stats, probe, list and evict on one producer's control endpoint."""

    def __init__(
        self,
        endpoint: str,
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        name: str | None = None,
        curve: CurveKeys | None = None,
        reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S,
    ) -> None:
        self.endpoint = _arguments.endpoint(endpoint, "endpoint", binding=False)
        self._connect_timeout_s = connect_timeout_s
        checked = _arguments.seconds(reply_timeout_s, "reply_timeout_s")
        assert checked is not None  # not `none=True`: None is refused
        self._reply_timeout_s = checked
        """How long the producer may take to answer a question (`KVRTTimeoutError` past it)."""
        self._heartbeat_s = heartbeat_s
        self._curve = curve
        self._name = name or f"client-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._link: _Link | None = None
        self._closed = False
        self.device = torch.device("cpu")
        """Where the replies' tensors would live: a client takes none, and speaks over TCP."""

    async def start(self) -> Self:
        if self._context is not None or self._closed:
            raise ClosedError("a client starts once; create a new one")
        self._context = zmq.Context()
        self._link = _Link(LinkSession(
            self.endpoint,
            context=self._context,
            name=self._name,
            heartbeat_s=self._heartbeat_s,
            transports={"tcp": TcpReceiver("cpu")},
            connect_timeout_s=self._connect_timeout_s,
            curve=self._curve,
            reply_timeout_s=self._reply_timeout_s,
        ))  # fmt: skip
        try:
            await self._link.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._link is not None:
            await self._link.aclose()
        if self._context is not None:
            self._context.term()

    async def health(self) -> m.HealthReply:
        """Whether the producer serves: its id, uptime and transports."""
        return await self._ask(lambda request_id: m.Health(request_id=request_id), m.HealthReply)

    async def stats(self) -> m.StatsReply:
        """Items, bytes, in-flight, waiting requests, peers, and totals since start."""
        return await self._ask(lambda request_id: m.Stats(request_id=request_id), m.StatsReply)

    async def probe(self, input_tokens: torch.Tensor | None, roi: torch.Tensor | None = None) -> m.ProbeReply:
        """What a drop_select with these tokens would take, without taking it (`matched` 0: nothing)."""
        tokens = query_bytes(input_tokens, roi, what="probe")
        return await self._ask(lambda request_id: m.Probe(request_id=request_id, tokens=tokens), m.ProbeReply)

    async def probe_many(self, queries: Sequence[torch.Tensor | None]) -> list[m.Probed]:
        """`probe` for each query (input tokens, roi applied already; None: the oldest item),
        in one message: at most `MAX_BATCH` (256). A producer of an older release, which does
        not answer `probe_many`, is asked one `probe` per query, all in flight together."""
        if not 1 <= len(queries) <= m.MAX_BATCH:
            raise InvalidInputError(f"probe_many takes 1 to {m.MAX_BATCH} queries, got {len(queries)}")
        tokens = [query_bytes(query, None, what="probe_many") for query in queries]
        if self._link is not None and m.Capability.PROBE_MANY not in self._link.core.producer_capabilities:
            replies = await asyncio.gather(*(self.probe(query) for query in queries))
            return [m.Probed(reply.matched, reply.item_id) for reply in replies]
        reply = await self._ask(lambda request_id: m.ProbeMany(request_id=request_id, queries=tokens), m.ProbeManyReply)
        if len(reply.answers) != len(queries):
            raise RemoteProtocolError(f"probe_many: {len(reply.answers)} answers to {len(queries)} queries")
        return reply.answers

    async def list_items(self, limit: int = 100) -> m.ItemList:
        """The oldest buffered items (at most `limit`), and how many there are in all."""
        if not 0 <= limit <= 10_000:
            raise InvalidInputError(f"limit must be between 0 and 10000, got {limit}")
        return await self._ask(lambda request_id: m.ListItems(request_id=request_id, limit=limit), m.ItemList)

    async def evict(self, item_id: int) -> m.Evicted:
        """Drop a buffered item; `NotFoundError` if it is not buffered."""
        return await self._ask(lambda request_id: m.Evict(request_id=request_id, item_id=item_id), m.Evicted)

    async def _ask(self, build: Callable[[int], m.Message], expected: type[_Reply]) -> _Reply:
        if self._closed or self._link is None:
            raise ClosedError("the client is closed" if self._closed else "the client is not started")
        reply = await self._link.call(build)
        if not isinstance(reply.message, expected):
            raise RemoteProtocolError(f"expected {expected.__name__}, got {type(reply.message).__name__}")
        return reply.message
