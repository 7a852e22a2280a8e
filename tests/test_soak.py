"""A bounded soak: 50 consumers, random sizes, random cancellations, backpressure.

It ends with every inserted item taken exactly once (zero lost, zero duplicated), nothing
held by the producer, and resident memory flat between the middle and the end.
KVRT_SOAK_S sets its length (default 40 seconds).
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time

import pytest
import torch

import kvrt

SOAK_S = float(os.environ.get("KVRT_SOAK_S", "40"))
CONSUMERS = 50
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def random_item(item_id: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = rng.randint(1, 64)
    shape = (rng.randint(1, 2), tokens, rng.randint(1, 4), rng.choice([8, 32, 64]))
    input_tokens = torch.cat([torch.tensor([item_id]), torch.randint(0, 1000, (tokens - 1,))])
    return input_tokens, torch.randn(shape), torch.randn(shape), torch.randn(tokens, 16)


@pytest.mark.timeout(SOAK_S * 3 + 60)
async def test_fifty_consumers_with_random_cancellations_lose_and_duplicate_nothing() -> None:
    rng = random.Random(2026)
    inserted: list[int] = []
    taken: collections.Counter[int] = collections.Counter()
    deadline = time.monotonic() + SOAK_S
    memory: dict[str, int] = {}

    async with kvrt.Producer(buffer_bytes=8 << 20, heartbeat_s=0.5) as producer:
        consumers = [await kvrt.Consumer(connect=producer.endpoint, heartbeat_s=0.5).start() for _ in range(CONSUMERS)]

        async def insert_until_deadline() -> None:
            item_id = 0
            while time.monotonic() < deadline:
                input_tokens, key, value, hidden = random_item(item_id, rng)
                await producer.insert(input_tokens, None, key, value, hidden)
                inserted.append(item_id)
                item_id += 1
                if item_id == 200:
                    memory["middle"] = resident_bytes()

        async def consume_until_deadline(consumer: kvrt.Consumer, seed: int) -> None:
            own = random.Random(seed)
            while time.monotonic() < deadline:
                wanted = own.choice([None, inserted[-1] if inserted else 0, own.randrange(max(1, len(inserted)))])
                query = None if wanted is None else torch.tensor([wanted])
                timeout = own.choice([0.0, 0.02, None])
                call = asyncio.create_task(consumer.drop_select(query, None, timeout=timeout))
                if timeout is None or own.random() < 0.2:
                    await asyncio.sleep(own.random() * 0.02)  # cancel at a random moment: that is the test
                    call.cancel()
                try:
                    item = await call
                except asyncio.CancelledError:
                    continue
                if item is not None:
                    taken[int(item.input_tokens[0])] += 1

        await asyncio.gather(
            insert_until_deadline(), *(consume_until_deadline(c, index) for index, c in enumerate(consumers))
        )
        drainer = consumers[0]
        await drainer.drop_select(torch.tensor([-1]))  # every consumer's receipts and releases have arrived
        while (item := await drainer.drop_select(None)) is not None:
            taken[int(item.input_tokens[0])] += 1
        for consumer in consumers:
            await consumer.aclose()
        stats = producer.stats()
        memory["end"] = resident_bytes()

    duplicated = {item_id: count for item_id, count in taken.items() if count > 1}
    lost = set(inserted) - set(taken)
    print(f"soak: {len(inserted)} items, {stats.totals.returned_items} returned after a cancel, "
          f"memory {memory['middle'] >> 20} -> {memory['end'] >> 20} MiB")  # fmt: skip
    assert len(inserted) > 500
    assert not duplicated and not lost
    assert (stats.items, stats.in_flight, stats.buffer_bytes) == (0, 0, 0)
    assert memory["end"] < memory["middle"] * 1.5 + (64 << 20)
