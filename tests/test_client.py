"""kvrt.Client: the control endpoint's operations against a real producer."""

from __future__ import annotations

import pytest
import torch

import kvrt
from tests.conftest import insert_tokens


@pytest.fixture
async def client(producer: kvrt.Producer) -> kvrt.Client:
    async with kvrt.Client(producer.endpoint) as started:
        yield started  # type: ignore[misc]


async def test_health_names_the_producer_and_its_transports(producer: kvrt.Producer, client: kvrt.Client) -> None:
    health = await client.health()
    assert health.producer_id and health.transports == ["tcp"] and health.uptime_s >= 0


async def test_stats_count_items_bytes_and_totals(producer: kvrt.Producer, client: kvrt.Client) -> None:
    await insert_tokens(producer, torch.arange(8))
    stats = await client.stats()
    assert (stats.items, stats.buffer_bytes) == (1, producer.stats().buffer_bytes)
    assert stats.buffer_limit_bytes == producer.buffer_bytes
    assert stats.totals["inserted_items"] == 1 and stats.peers == 1  # the client itself


async def test_probe_reports_the_match_without_taking_the_item(producer: kvrt.Producer, client: kvrt.Client) -> None:
    await insert_tokens(producer, torch.arange(10))
    probe = await client.probe(torch.arange(6))
    assert probe.matched == 6 and probe.item_id is not None
    assert (await client.probe(torch.tensor([99]))).matched == 0
    assert producer.stats().items == 1


async def test_probe_many_answers_every_query_in_order_in_one_request(
    producer: kvrt.Producer, client: kvrt.Client
) -> None:
    await insert_tokens(producer, torch.arange(10))
    await insert_tokens(producer, torch.arange(4) + 100)
    before = (await client.stats()).totals
    answers = await client.probe_many([torch.arange(6), torch.tensor([99]), torch.arange(4) + 100, None])
    assert [answer.matched for answer in answers] == [6, 0, 4, 10]
    assert answers[1].item_id is None and answers[0].item_id == answers[3].item_id != answers[2].item_id
    assert producer.stats().items == 2
    assert (await client.stats()).totals.get("errors", 0) == before.get("errors", 0)


async def test_probe_many_asks_a_producer_that_does_not_answer_it_one_probe_per_query(
    producer: kvrt.Producer, client: kvrt.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A producer of an older release lists no `probe_many` in its welcome.
    link = client._link
    assert link is not None and "probe_many" in link.core.producer_capabilities
    monkeypatch.setattr(link.core, "producer_capabilities", frozenset({"tcp"}))
    await insert_tokens(producer, torch.arange(10))
    answers = await client.probe_many([torch.arange(3), torch.tensor([7])])
    assert [answer.matched for answer in answers] == [3, 0]


@pytest.mark.parametrize("count", [0, 257])
async def test_probe_many_refuses_no_queries_or_more_than_a_batch(client: kvrt.Client, count: int) -> None:
    with pytest.raises(kvrt.InvalidInputError, match="1 to 256 queries"):
        await client.probe_many([torch.arange(2)] * count)


async def test_list_items_shows_the_oldest_first_with_a_total(producer: kvrt.Producer, client: kvrt.Client) -> None:
    for index in range(3):
        await insert_tokens(producer, torch.arange(4) + 10 * index)
    listing = await client.list_items(limit=2)
    assert listing.total == 3 and len(listing.items) == 2
    assert listing.items[0].item_id < listing.items[1].item_id and listing.items[0].tokens == 4


async def test_evict_drops_an_item_and_a_second_evict_is_not_found(
    producer: kvrt.Producer, client: kvrt.Client
) -> None:
    await insert_tokens(producer, torch.arange(4))
    (item,) = (await client.list_items()).items
    evicted = await client.evict(item.item_id)
    assert evicted.item_id == item.item_id and evicted.nbytes > 0
    assert producer.stats().items == 0 and producer.stats().buffer_bytes == 0
    with pytest.raises(kvrt.NotFoundError, match="not buffered"):
        await client.evict(item.item_id)


async def test_a_client_never_takes_items(
    producer: kvrt.Producer, client: kvrt.Client, consumer: kvrt.Consumer
) -> None:
    await insert_tokens(producer, torch.arange(4))
    await client.probe(None)
    assert await consumer.drop_select(torch.arange(4)) is not None
