"""Programs the process tests start in their own interpreters (importable by `spawn`), and
how a test runs one."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch
import zmq

import kvrt
from tests._gpu_processes import run_gpu_producer
from tests._gpus import PRODUCER_DEVICE


@asynccontextmanager
async def child_process(
    target: Callable[..., None], args: Sequence[Any], what: str, *, start_s: float = 180, stop_s: float = 30
) -> AsyncIterator[tuple[Any, multiprocessing.process.BaseProcess, multiprocessing.connection.Connection]]:
    """`target(*args, control)` in a spawned process: its first message (an endpoint), the
    process and the control pipe; told "stop" at the end, killed if it does not stop within
    `stop_s`. Starting and joining it happen off the event loop."""
    control, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(target=target, args=(*args, child), daemon=True)
    await asyncio.to_thread(process.start)
    try:
        assert await asyncio.to_thread(control.poll, start_s), f"{what} did not start"
        yield control.recv(), process, control
    finally:
        with contextlib.suppress(OSError):
            control.send("stop")
        await asyncio.to_thread(process.join, stop_s)
        if process.is_alive():
            process.kill()
            await asyncio.to_thread(process.join)


async def killed_and_forgotten(process: Any, producer: kvrt.Producer, heartbeat_s: float) -> None:
    """Kill a consumer's process and wait until `producer` forgot it (its heartbeat timeout)."""
    assert process.pid is not None
    producer._serving.peer_left.clear()
    os.kill(process.pid, signal.SIGKILL)
    await asyncio.to_thread(process.join)
    await asyncio.wait_for(producer._serving.peer_left.wait(), 4 * heartbeat_s + 5.0)


async def fails_with_peer_lost_in_time(call: asyncio.Task[Any], producer: Any, heartbeat_s: float) -> None:
    """Kill the producer's process: `call` must fail with PeerLostError within the heartbeat timeout."""
    assert producer.pid is not None
    os.kill(producer.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(kvrt.PeerLostError):
        await call
    assert time.monotonic() - killed_at < 4 * heartbeat_s + 1.0


def item_tensors(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    tokens = torch.arange(32, dtype=torch.int64) + 1000 * index
    key = torch.randn((2, 32, 4, 16), generator=generator).to(torch.float16)
    value = torch.randn((2, 32, 4, 16), generator=generator).to(torch.bfloat16)
    hidden = torch.randn((32, 64), generator=generator)
    return tokens, key, value, hidden


def _wait_for_stop(control: multiprocessing.connection.Connection) -> None:
    try:
        control.recv()
    except EOFError:
        pass


def run_producer(items: int, heartbeat_s: float, control: multiprocessing.connection.Connection) -> None:
    """Insert `items` items, send the endpoint on `control`, then serve until `control` says stop or closes.

    A pipe, not a multiprocessing Event: a process killed while waiting on an Event leaves
    its condition variable waiting for a sleeper that will never wake.
    """

    async def main() -> None:
        async with kvrt.Producer(heartbeat_s=heartbeat_s) as producer:
            for index in range(items):
                tokens, key, value, hidden = item_tensors(index)
                await producer.insert(tokens, None, key, value, hidden)
            control.send(producer.endpoint)
            await asyncio.to_thread(_wait_for_stop, control)

    asyncio.run(main())


def run_waiting_consumer(
    endpoint: str, heartbeat_s: float, tokens: list[int], control: multiprocessing.connection.Connection
) -> None:
    """Post one waiting drop_select for `tokens`, say "asked" once the producer holds it; told
    ("hold", seconds), say "holding" and hold the event loop's thread that long (a forward
    pass: libzmq still receives meanwhile, the loop reads nothing); then report how the call
    ended: ("item", its key's sum) or ("error", the error's class name)."""

    async def main() -> None:
        async with kvrt.Consumer(connect=endpoint, heartbeat_s=heartbeat_s) as consumer:
            call = asyncio.create_task(consumer.drop_select(torch.tensor(tokens), None, timeout=None))
            await asyncio.sleep(0)  # a yield: the call runs up to its wait for the answer (no time passes)
            assert consumer.pending_requests == 1
            # Answered in order: once this miss is back, the producer holds the waiting request.
            assert await consumer.drop_select(torch.tensor([-1]), None, timeout=0.0) is None
            control.send("asked")
            command = await asyncio.to_thread(control.recv)
            if command[0] == "hold":
                control.send("holding")
                until = time.monotonic() + command[1]
                while time.monotonic() < until:  # pure Python: the loop and the GIL are held
                    pass
            try:
                item = await asyncio.wait_for(call, 60)
            except kvrt.KVRTError as exc:
                control.send(("error", type(exc).__name__))
            else:
                assert item is not None
                control.send(("item", float(item.key.float().sum())))
            await asyncio.to_thread(_wait_for_stop, control)

    asyncio.run(main())


def run_consumer_stopping_before_its_receipt(
    endpoint: str, heartbeat_s: float, tokens: list[int], control: multiprocessing.connection.Connection
) -> None:
    """Post a waiting drop_select for `tokens`, say "asked" once the producer holds it; the moment
    the item is handed over, before its receipt is queued, the whole process stops itself
    (SIGSTOP: the receipt waits for a SIGCONT). Then, once the producer has read the receipt,
    report ("item", its key's sum), ("none",) or ("error", the error's class name)."""

    async def main() -> None:
        async with kvrt.Consumer(connect=endpoint, heartbeat_s=heartbeat_s) as consumer:
            sends = consumer.link_for_tests().sends
            send_receipts = sends.send_receipts
            stopped = False

            def stop_before_the_receipt_leaves() -> None:
                nonlocal stopped
                if sends._receipts and not stopped:
                    stopped = True
                    os.kill(os.getpid(), signal.SIGSTOP)
                send_receipts()

            sends.send_receipts = stop_before_the_receipt_leaves  # type: ignore[method-assign]
            call = asyncio.create_task(consumer.drop_select(torch.tensor(tokens), None, timeout=60))
            await asyncio.sleep(0)  # a yield: the call runs up to its wait for the answer
            assert await consumer.drop_select(torch.tensor([-1]), None, timeout=0.0) is None  # answered in order
            control.send("asked")
            try:
                item = await call
                try:  # answered after what this link sent before it: the receipt is read
                    assert await consumer.drop_select(torch.tensor([-1]), None, timeout=0.0) is None
                except kvrt.PeerLostError:  # woken past its lease: it says hello again, after its receipt
                    await asyncio.wait_for(consumer.link_for_tests().connected.wait(), 30)
            except kvrt.KVRTError as exc:
                control.send(("error", type(exc).__name__))
            else:
                control.send(("none",) if item is None else ("item", float(item.key.float().sum())))
            await asyncio.to_thread(_wait_for_stop, control)

    asyncio.run(main())


def run_non_reader(endpoint: str, requests: int, control: multiprocessing.connection.Connection) -> None:
    """A peer that says hello, sends `requests` stats requests and never reads a reply; told
    ("more", n), it sends n more. It says how many it sent each time."""
    from kvrt import _messages as m

    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 16)
    socket.setsockopt(zmq.SNDTIMEO, 5000)
    socket.connect(endpoint)
    socket.send(m.encode(m.Hello(version=m.PROTOCOL_VERSION, name="non-reader")))
    request_ids = itertools.count(1)
    more: object = ("more", requests)
    while isinstance(more, tuple) and more[0] == "more":
        sent = 0
        for _ in range(more[1]):
            try:
                socket.send(m.encode(m.Stats(request_id=next(request_ids))))
                sent += 1
            except zmq.Again:
                break
        control.send(sent)
        try:
            more = control.recv()
        except EOFError:
            break
    socket.close()
    context.term()


def run_busy_producer(heartbeat_s: float, control: multiprocessing.connection.Connection) -> None:
    """Serve; on ("busy", seconds, tokens) hold the event loop's thread (and the GIL) that long,
    as an engine's forward pass does, then insert an item for `tokens` and say "inserted"."""

    async def main() -> None:
        async with kvrt.Producer(heartbeat_s=heartbeat_s) as producer:
            control.send(producer.endpoint)
            while True:
                command = await asyncio.to_thread(control.recv)
                if command == "stop":
                    return
                _, seconds, tokens = command
                until = time.monotonic() + seconds
                while time.monotonic() < until:  # pure Python: the GIL is held throughout
                    pass
                key = torch.ones(1, len(tokens), 1, 4)
                await producer.insert(torch.tensor(tokens), None, key, key)
                control.send("inserted")

    asyncio.run(main())


def producer_process(items: int, heartbeat_s: float = 1.0) -> Any:
    """A CPU producer in its own process holding `items` items (`item_tensors`): a
    `child_process` context giving (endpoint, process, control)."""
    return child_process(run_producer, (items, heartbeat_s), "producer process", start_s=60, stop_s=10)


def gpu_producer_process(
    items: list[tuple[int, int, str]], heartbeat_s: float = 1.0, transport: str | None = None
) -> Any:
    """A producer on `PRODUCER_DEVICE` in its own process holding `items` ((index, tokens,
    dtype) each, `tests._gpu_processes.kv_item`): a `child_process` context giving (endpoint,
    process, control)."""
    return child_process(run_gpu_producer, (PRODUCER_DEVICE, transport, heartbeat_s, items), "GPU producer")
