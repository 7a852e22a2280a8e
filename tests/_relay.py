"""A producer that answers late: a ZeroMQ relay in front of a real one that holds each of its
answers for `delay_s` (a producer whose loop shares its core with a prefill's forward pass)."""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType
from typing import Self

import zmq
import zmq.asyncio


class DelayingRelay:
    """Clients connect to `endpoint`; every message reaches the producer at once, and every
    answer comes back `delay_s` later. One client at a time (the producer sees the relay)."""

    def __init__(self, producer: str, *, delay_s: float) -> None:
        self._producer = producer
        self._delay_s = delay_s
        self._context = zmq.asyncio.Context()
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), name="delaying-relay", daemon=True)
        self.endpoint = ""

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the relay did not start")
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)
        self._context.term()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        front = self._context.socket(zmq.ROUTER)
        back = self._context.socket(zmq.DEALER)
        for socket in (front, back):
            socket.setsockopt(zmq.LINGER, 0)
        port = front.bind_to_random_port("tcp://127.0.0.1")
        back.connect(self._producer)
        self.endpoint = f"tcp://127.0.0.1:{port}"
        client: list[bytes] = []
        late: set[asyncio.TimerHandle] = set()

        async def forward() -> None:
            while True:
                identity, *frames = await front.recv_multipart()
                client[:] = [identity]
                await back.send_multipart(frames)

        def answer(frames: list[bytes]) -> None:
            if client:
                front.send_multipart([client[0], *frames])

        async def backward() -> None:
            while True:
                frames = await back.recv_multipart()
                late.add(self._loop.call_later(self._delay_s, answer, frames))  # type: ignore[union-attr]

        tasks = [asyncio.create_task(forward()), asyncio.create_task(backward())]
        self._ready.set()
        await self._stopped.wait()
        for task in tasks:
            task.cancel()
        for handle in late:
            handle.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        front.close()
        back.close()
