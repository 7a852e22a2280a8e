"""Shared fixtures: every test fails if it leaks a ZeroMQ socket; every async test fails if it
blocks its event loop; and a few builders for items."""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import os
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
import zmq
import zmq.sugar.context
import zmq.utils.garbage as zmq_garbage

import kvrt

SLOW_CALLBACK_S = 0.5
"""A callback or task step holding the loop longer than this fails the test (2-core CI)."""


@pytest.fixture(autouse=True)
def no_leaked_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    created: list[weakref.ref[zmq.Socket[bytes]]] = []
    original = zmq.sugar.context.Context.socket

    def tracking_socket(self: zmq.Context[zmq.Socket[bytes]], *args: object, **kwargs: object) -> zmq.Socket[bytes]:
        socket = original(self, *args, **kwargs)  # type: ignore[arg-type]
        if self is not zmq_garbage.gc._context:  # pyzmq's own zero-copy bookkeeping, not ours
            created.append(weakref.ref(socket))
        return socket

    monkeypatch.setattr(zmq.sugar.context.Context, "socket", tracking_socket)
    yield
    leaked = [socket for ref in created if (socket := ref()) is not None and not socket.closed]
    assert not leaked, f"test left {len(leaked)} ZeroMQ socket(s) open: close producers and consumers"


class _SlowCallbacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "took" in message and "Executing" in message:
            self.messages.append(message)


@pytest.fixture
async def loop_guard() -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = SLOW_CALLBACK_S
    handler = _SlowCallbacks()
    logging.getLogger("asyncio").addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert not handler.messages, "the event loop was blocked: " + "; ".join(handler.messages)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the session holds once collected (torch, vLLM's modules, every test item) leaves
    the garbage collector's view, as vLLM's engine does with what it holds after start-up: a
    full collection otherwise walks it every few hundred tests, a pause of up to half a second
    on a 2-core host, long enough to stall a test's loop past its guard or a pair of peers in
    one process past their heartbeats."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            needed = int(marker.kwargs.get("count", 1))
            if gpus < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA device(s), {gpus} visible"))
        function = getattr(item, "function", None)
        if function is not None and inspect.iscoroutinefunction(function):
            item.fixturenames.insert(0, "loop_guard")  # type: ignore[attr-defined]


TRITON_KERNEL_MARKS = [
    pytest.mark.kernels,
    pytest.mark.skipif(
        not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
        reason="Triton kernels need a GPU or TRITON_INTERPRET=1",
    ),
]
"""A kernel test's marks: it runs on a GPU, or on CPU under the Triton interpreter."""
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_kv(
    tokens: torch.Tensor,
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 4,
    dtype: torch.dtype = torch.float16,
    hidden_size: int | None = 8,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random key, value and hidden for `tokens`, in kvrt's shapes."""
    generator = torch.Generator().manual_seed(seed)
    shape = (layers, len(tokens), heads, head_dim)
    key = torch.randn(shape, generator=generator).to(dtype)
    value = torch.randn(shape, generator=generator).to(dtype)
    hidden = None if hidden_size is None else torch.randn((len(tokens), hidden_size), generator=generator).to(dtype)
    return key, value, hidden


async def insert_tokens(producer: kvrt.Producer, tokens: torch.Tensor, *, seed: int = 0) -> None:
    key, value, hidden = make_kv(tokens, seed=seed)
    await producer.insert(tokens, None, key, value, hidden)


@pytest.fixture
async def producer() -> AsyncIterator[kvrt.Producer]:
    async with kvrt.Producer(bind="tcp://127.0.0.1:0") as started:
        yield started


@pytest.fixture
async def consumer(producer: kvrt.Producer) -> AsyncIterator[kvrt.Consumer]:
    async with kvrt.Consumer(connect=producer.endpoint) as started:
        yield started


def give_up_when_its_reply_comes(
    monkeypatch: pytest.MonkeyPatch, consumer: kvrt.Consumer, call: asyncio.Task[Any], reply: type[Any]
) -> None:
    """Make `call` give up just before its link reads the `reply` it waits for, as if its
    caller cancelled it while that reply was on the way (the race, made certain): the reply
    then arrives for a request the link no longer waits for."""
    from kvrt import _messages as m

    link = consumer.link_for_tests()
    core_receive = link.core.receive

    def the_caller_gives_up_just_before(frame: bytes, now: float) -> object:
        message = m.decode(frame)
        if isinstance(message, reply) and not call.done():
            call.cancel()
            link.core.abandon(message.request_id)  # what its cancellation does, a moment early
        return core_receive(frame, now)

    monkeypatch.setattr(link.core, "receive", the_caller_gives_up_just_before)
