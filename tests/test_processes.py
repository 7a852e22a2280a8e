"""Producer and consumer in two real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

import kvrt
from tests._processes import item_tensors, producer_process


async def test_items_from_a_producer_process_arrive_intact_in_this_one() -> None:
    async with producer_process(items=20) as (endpoint, _, _), kvrt.Consumer(connect=endpoint) as consumer:
        for index in reversed(range(20)):
            tokens, key, value, hidden = item_tensors(index)
            item = await consumer.drop_select(tokens)
            assert item is not None and item.matched == 32
            assert torch.equal(item.key, key) and torch.equal(item.value, value)
            assert item.hidden is not None and torch.equal(item.hidden, hidden)
        assert await consumer.drop_select(None) is None


async def test_a_killed_producer_fails_pending_calls_at_once_not_after_its_lease() -> None:
    # The connection closing (libzmq's I/O thread sees it) fails the calls, long before the
    # lease (10 s by default) of a producer that answers nothing would end.
    async with producer_process(items=0, heartbeat_s=1.0) as (endpoint, process, _):
        async with kvrt.Consumer(connect=endpoint) as consumer:
            assert await consumer.drop_select(torch.arange(4), None, timeout=0.0) is None  # connected and served
            waiting = asyncio.create_task(consumer.drop_select(torch.arange(4), None, timeout=None))
            assert await consumer.drop_select(torch.arange(5), None, timeout=0.0) is None  # the wait is posted
            killed_at = time.monotonic()
            assert process.pid is not None
            os.kill(process.pid, signal.SIGKILL)
            with pytest.raises(kvrt.PeerLostError, match="closed"):
                await waiting
            assert time.monotonic() - killed_at < 2.0
