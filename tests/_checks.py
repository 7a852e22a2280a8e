"""Checks the tests share: tensors equal bit for bit, a consumer's producers caught up, a
full garbage collection that does not count as the event loop blocked, a link made deaf or
its lease ended, a raw exchange with a producer, and a receive that flips a byte it landed."""

from __future__ import annotations

import asyncio
import gc
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio

import kvrt
from kvrt import _messages as m

MISS: torch.Tensor = torch.tensor([-1])
"""Tokens no test inserts: a query of them is a miss."""


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same_bits(actual: torch.Tensor | None, expected: torch.Tensor) -> bool:
    """`actual` is `expected` bit for bit: the same dtype, the same shape and the same bytes,
    whatever the devices and strides of either (NaNs and -0.0 compare by their bits). A missing
    `actual` (None) is not."""
    return (
        actual is not None
        and actual.dtype == expected.dtype
        and actual.shape == expected.shape
        and torch.equal(_bytes(actual), _bytes(expected))
    )


async def caught_up(consumer: kvrt.Consumer) -> None:
    """Return once every producer of `consumer` has handled everything it sent before.

    ZeroMQ keeps one connection's messages in order and a producer answers them in order, so
    the answer to a fresh request (a miss, asserted) comes after every earlier one was
    handled: receipts, releases and requests alike. In a TP group every rank must call it at
    the same point, as any lookup (it takes part in the group's agreement)."""
    assert await consumer.drop_select(MISS, None, timeout=0.0) is None


async def collected() -> None:
    """A full garbage collection, from an async test: run in a thread, so that collecting the
    heap of a whole test run (it takes longer than a loop step may) is not the test's own
    loop step that the loop guard reports as blocked."""
    await asyncio.to_thread(gc.collect)


class DeafLink:
    """A consumer's link made to hear nothing from its producer until `deaf` is cleared:
    `lost` is set once the link gave the producer up (its heartbeat timeout)."""

    def __init__(self, link: Any) -> None:
        self.deaf = True
        self.lost = asyncio.Event()
        core_receive, core_expire = link.core.receive, link.core.expire

        def noting_the_loss(now: float) -> Any:
            due, gone = core_expire(now)
            if gone is not None:
                self.lost.set()
            return due, gone

        link.core.receive = lambda frame, now: core_receive(frame, now) if not self.deaf else None
        link.core.expire = noting_the_loss


def lease_ends_with_the_next_delivery(link: Any, monkeypatch: Any) -> None:
    """From the next Deliver a link receives on, its lease no longer holds (as after a stall
    of the consumer's process as long as the lease)."""
    core_receive = link.core.receive

    def stalled_until_the_lease_ended(frame: bytes, now: float) -> object:
        event = core_receive(frame, now)
        if isinstance(m.decode(frame), m.Deliver):
            monkeypatch.setattr(link.session, "lease_holds", lambda: False)
        return event

    monkeypatch.setattr(link.core, "receive", stalled_until_the_lease_ended)


async def raw_exchange(endpoint: str, frames: list[bytes]) -> m.Message:
    """Send `frames` to a producer from a raw DEALER; its one answer, decoded."""
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint)
        await socket.send_multipart(frames)
        async with asyncio.timeout(10):
            reply = await socket.recv_multipart()
        return m.decode(reply[0])
    finally:
        socket.close()
        context.term()


def damage_the_first(
    monkeypatch: pytest.MonkeyPatch, damage: Callable[[m.AnyMessage], m.AnyMessage | None]
) -> list[m.AnyMessage]:
    """Have this process decode messages through `damage` until it damages one, as the way
    from the producer might: what it returns stands in for the message (None: not this one),
    and what it raises is raised as for a message that no longer decodes. Later messages come
    as they are. The list returned gets the damaged message as it came."""
    decode = m.decode
    damaged: list[m.AnyMessage] = []

    def damaging(frame: bytes | memoryview) -> m.AnyMessage:
        message = decode(frame)
        if damaged:
            return message
        try:
            replaced = damage(message)
        except kvrt.KVRTError:
            damaged.append(message)
            raise
        if replaced is None:
            return message
        damaged.append(message)
        return replaced

    monkeypatch.setattr(m, "decode", damaging)
    return damaged


def unreadable(message: m.AnyMessage) -> m.AnyMessage:
    """For `damage_the_first`: a message damaged past decoding."""
    raise kvrt.RemoteProtocolError(f"invalid control message: (a damaged {type(message).__name__})")


def flip_one_landed_byte(monkeypatch: pytest.MonkeyPatch, receiver: type) -> list[int]:
    """Make the next receive of `receiver` (a transport's receiving class whose `_post` lands a
    `payload` and runs an optional `check` once it landed) flip a byte in the middle of what it
    landed, after the landing and before the check; the producer's bytes are never touched.
    The list returned gets the byte's offset when it flipped."""
    flipped: list[int] = []
    post = receiver._post  # type: ignore[attr-defined]
    signature = inspect.signature(post)

    def flipping(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        payload: torch.Tensor = bound.arguments["payload"]
        check: Callable[[], None] | None = bound.arguments.get("check")

        def flip_then_check() -> None:
            if not flipped and payload.numel():
                payload.view(torch.uint8)[payload.numel() // 2] ^= 0x10  # where the check runs (its stream)
                flipped.append(payload.numel() // 2)
            if check is not None:
                check()

        bound.arguments["check"] = flip_then_check
        return post(*bound.args, **bound.kwargs)

    monkeypatch.setattr(receiver, "_post", flipping)
    return flipped


async def read_as_published(
    producer: kvrt.Producer,
    consumer: kvrt.Consumer,
    tokens: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    hidden: torch.Tensor | None = None,
) -> kvrt.ConsumerStream:
    """A stream of `key` and `value` ([layers, ...]) whose reader opened before its first layer
    was put: its layers travel one by one, as a prefill publishes them. Returns the reader."""
    writer = await producer.open_stream(tokens, layers=key.shape[0])
    reader = await consumer.open_stream(tokens)
    assert reader is not None
    for layer in range(key.shape[0]):
        await writer.put_layer(key[layer], value[layer])
    await writer.finish(hidden)
    return reader


async def read_whole(reader: kvrt.ConsumerStream | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer of a stream, its keys and its values each stacked [layers, ...], once the
    stream is finished (a loop over it ends only then)."""
    assert reader is not None
    layers = [(key, value) async for _, key, value in reader]
    return torch.stack([key for key, _ in layers]), torch.stack([value for _, value in layers])


async def reads_whole_again(
    consumer: kvrt.Consumer, tokens: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """The stream of `tokens` opens again on `consumer` (within 10 s) and every layer reads
    bit for bit as `key` and `value` (stacked [layers, ...]): it came back whole."""
    keys, values = await read_whole(await asyncio.wait_for(consumer.open_stream(tokens), 10))
    assert torch.equal(keys, key) and torch.equal(values, value)
