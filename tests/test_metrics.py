"""Prometheus metrics, scraped from the real HTTP endpoint."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from typing import Any

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


def families(registry: Any) -> dict[str, Any]:
    """The metric families of a registry, as Prometheus would parse its page."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(generate_latest(registry).decode())}


def sample(family: Any, suffix: str = "", **labels: str) -> float:
    for each in family.samples:
        if each.name == family.name + suffix and all(each.labels.get(key) == val for key, val in labels.items()):
            return float(each.value)
    raise AssertionError(f"no sample {family.name}{suffix}{labels}")


async def test_metrics_go_into_the_registry_the_engine_serves_once_however_often_they_are_added() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    kvrt.register_metrics(registry)
    kvrt.register_metrics(registry)  # no second collector: each sample once
    async with kvrt.Producer(buffer_bytes=1 << 20, name="prefill-0") as producer:
        await insert_tokens(producer, torch.arange(8))
        found = families(registry)
    labels = {"producer": "prefill-0", "endpoint": producer.endpoint}
    assert sample(found["kvrt_producer_buffer_limit_bytes"], **labels) == 1 << 20
    assert sample(found["kvrt_producer_buffer_bytes"], **labels) > 0
    assert found["kvrt_producer_items"].type == "counter"


async def test_two_consumers_of_one_process_are_told_apart_and_their_lookups_counted_by_outcome(
    producer: kvrt.Producer,
) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    kvrt.register_metrics(registry)
    await insert_tokens(producer, torch.arange(8))
    async with (
        kvrt.Consumer(connect=producer.endpoint, name="decode-a") as first,
        kvrt.Consumer(connect=producer.endpoint, name="decode-b") as second,
    ):
        assert await first.drop_select(torch.arange(8)) is not None
        assert await second.drop_select(torch.arange(100, 108)) is None
        assert await second.drop_select(torch.arange(200, 208), timeout=0.01) is None
        lookups = families(registry)["kvrt_consumer_lookups"]
    assert sample(lookups, "_total", consumer="decode-a", outcome="hit") == 1
    assert sample(lookups, "_total", consumer="decode-a", outcome="miss") == 0
    assert sample(lookups, "_total", consumer="decode-b", outcome="miss") == 1
    assert sample(lookups, "_total", consumer="decode-b", outcome="timeout") == 1
    assert sample(lookups, "_total", consumer="decode-b", outcome="hit") == 0


async def test_transfer_time_and_size_are_histograms_kept_apart_from_the_wait_for_a_prefill(
    producer: kvrt.Producer,
) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    kvrt.register_metrics(registry)
    async with kvrt.Consumer(connect=producer.endpoint, name="decode-wait") as consumer:
        waiting = asyncio.create_task(consumer.drop_select(torch.arange(16), None, timeout=None))
        assert await consumer.drop_select(torch.tensor([-1])) is None  # the lookup waits on the producer now
        await insert_tokens(producer, torch.arange(16))  # the prefill it waited for
        assert await waiting is not None
        found = families(registry)
    labels = {"consumer": "decode-wait"}
    wait, seconds, sizes = (
        found[name] for name in
        ("kvrt_consumer_lookup_wait_seconds", "kvrt_consumer_transfer_seconds", "kvrt_consumer_transfer_bytes")
    )  # fmt: skip
    assert wait.type == seconds.type == sizes.type == "histogram"
    assert sample(wait, "_count", **labels) == 2  # the waiting lookup and the miss
    assert sample(seconds, "_count", transport="tcp", **labels) == 1
    assert sample(sizes, "_sum", transport="tcp", **labels) == producer.stats().totals.inserted_bytes  # the one item
    assert sample(sizes, "_bucket", transport="tcp", le="+Inf", **labels) == 1


def test_a_metrics_port_in_use_is_refused_with_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrt import _metrics

    monkeypatch.setattr(_metrics, "_server", None)  # as in a process that serves none yet
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(kvrt.InvalidInputError, match=f"metrics port 127.0.0.1:{port} is already in use"):
            kvrt.serve_metrics(port)
    finally:
        taken.close()
