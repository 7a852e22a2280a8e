"""Checks the tests share: tensors equal bit for bit, a consumer's producers caught up, and a
full garbage collection that does not count as the event loop blocked."""

from __future__ import annotations

import asyncio
import gc

import torch

import kvrt

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
