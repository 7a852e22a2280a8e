"""One consumer, several producers: a lookup asks them all and takes the best."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import torch

import kvrt
from tests._checks import caught_up
from tests.conftest import insert_tokens


@pytest.fixture
async def producers() -> AsyncIterator[list[kvrt.Producer]]:
    started = [await kvrt.Producer().start() for _ in range(3)]
    try:
        yield started
    finally:
        for producer in started:
            await producer.aclose()


@pytest.fixture
async def consumer(producers: list[kvrt.Producer]) -> AsyncIterator[kvrt.Consumer]:
    async with kvrt.Consumer(connect=[producer.endpoint for producer in producers]) as started:
        yield started


async def test_the_longest_match_over_all_producers_wins_and_the_others_keep_theirs(
    producers: list[kvrt.Producer], consumer: kvrt.Consumer
) -> None:
    await insert_tokens(producers[0], torch.arange(3), seed=0)
    await insert_tokens(producers[1], torch.arange(8), seed=1)
    await insert_tokens(producers[2], torch.arange(5), seed=2)
    item = await consumer.drop_select(torch.arange(10))
    assert item is not None and item.matched == 8
    await caught_up(consumer)
    assert [producer.stats().items for producer in producers] == [1, 0, 1]
    assert [producer.stats().in_flight for producer in producers] == [0, 0, 0]


async def test_a_tie_goes_to_the_first_endpoint(producers: list[kvrt.Producer], consumer: kvrt.Consumer) -> None:
    await insert_tokens(producers[2], torch.arange(4), seed=2)
    await insert_tokens(producers[1], torch.arange(4), seed=1)
    item = await consumer.drop_select(torch.arange(4))
    assert item is not None
    await caught_up(consumer)
    assert [producer.stats().items for producer in producers] == [0, 0, 1]


async def test_a_waiting_lookup_takes_the_first_match_and_cancels_the_rest(
    producers: list[kvrt.Producer], consumer: kvrt.Consumer
) -> None:
    waiting = asyncio.create_task(consumer.drop_select(torch.arange(6), None, timeout=None))
    await caught_up(consumer)
    assert [producer.stats().waiting_requests for producer in producers] == [1, 1, 1]
    await insert_tokens(producers[2], torch.arange(6))
    item = await waiting
    assert item is not None and item.matched == 6
    await caught_up(consumer)
    assert [producer.stats().waiting_requests for producer in producers] == [0, 0, 0]


async def test_a_lost_producer_is_skipped_with_a_warning(
    producers: list[kvrt.Producer], consumer: kvrt.Consumer, caplog: pytest.LogCaptureFixture
) -> None:
    await insert_tokens(producers[1], torch.arange(4))
    await producers[0].aclose()
    await caught_up(consumer)  # the Bye has been read: the link knows its producer is gone
    with caplog.at_level(logging.WARNING, logger="kvrt"):
        item = await consumer.drop_select(torch.arange(4))
    assert item is not None
    assert any("skipped for this lookup" in record.getMessage() for record in caplog.records)


async def test_when_every_producer_is_lost_the_lookup_fails(producers: list[kvrt.Producer]) -> None:
    async with kvrt.Consumer(connect=[producer.endpoint for producer in producers[:2]]) as consumer:
        for producer in producers[:2]:
            await producer.aclose()
        with pytest.raises(kvrt.PeerLostError):
            # Each producer said bye as it closed: a request sent before the link read it fails
            # when it does; one sent after fails at once.
            await consumer.drop_select(torch.arange(2))
