"""Prometheus metrics, scraped from the real HTTP endpoint."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
import torch

import kvrt
from tests._checks import caught_up
from tests.conftest import insert_tokens


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text: str = response.read().decode()
        return text


def value(text: str, name: str, **labels: str) -> float:
    """The sample `name{labels...}` in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{key}="{val}"' in line for key, val in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{labels} in the page")


async def test_a_scrape_shows_moved_items_buffer_gauges_latency_and_errors(
    producer: kvrt.Producer, consumer: kvrt.Consumer
) -> None:
    port = kvrt.serve_metrics(0)
    await insert_tokens(producer, torch.arange(8))
    await insert_tokens(producer, torch.arange(100, 104))
    assert await consumer.drop_select(torch.arange(8)) is not None
    with pytest.raises(kvrt.InvalidInputError):
        await consumer.drop_select(torch.arange(3.0))
    await caught_up(consumer)  # the receipt went before this: settled
    page = await asyncio.to_thread(scrape, port)
    endpoint = producer.endpoint
    assert value(page, "kvrt_producer_items_total", endpoint=endpoint, event="inserted") == 2
    assert value(page, "kvrt_producer_buffer_items", endpoint=endpoint) == 1
    assert value(page, "kvrt_producer_buffer_bytes", endpoint=endpoint) == producer.stats().buffer_bytes
    assert value(page, "kvrt_consumer_items_total", endpoint=endpoint) == 1
    assert value(page, "kvrt_operation_seconds_count", op="drop_select") >= 1
    assert value(page, "kvrt_operation_seconds_count", op="insert") >= 2


async def test_refusals_are_counted_by_error_code(producer: kvrt.Producer, consumer: kvrt.Consumer) -> None:
    port = kvrt.serve_metrics(0)
    async with kvrt.Client(producer.endpoint) as client:
        with pytest.raises(kvrt.NotFoundError):
            await client.evict(12345)
    page = await asyncio.to_thread(scrape, port)
    assert value(page, "kvrt_producer_refusals_total", endpoint=producer.endpoint, code="not_found") == 1
