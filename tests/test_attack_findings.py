"""Promises the adversarial suite (`kvrt attack`) found broken, each as the smallest test that
shows it with real processes and sockets. A test marked xfail(strict) is a promise still broken;
its reason says what happens."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.connection
import os
import signal

import pytest
import torch

import kvrt
from tests._processes import child_process, run_waiting_consumer

HEARTBEAT_S = 0.1
"""Short heartbeats, so that a lease (10 heartbeats) ends within a second."""
TOKENS = (7, 8, 9)


def _checksum(tensor: torch.Tensor) -> float:
    return float(tensor.float().sum())


def run_consumer_that_holds_its_loop_after_a_take(
    endpoint: str, heartbeat_s: float, control: multiprocessing.connection.Connection
) -> None:
    """Take one item, then hold the event loop (as a forward pass or a GC pause right after the
    call returned does) until `control` says go; report what was taken."""

    async def main() -> None:
        async with kvrt.Consumer(connect=endpoint, heartbeat_s=heartbeat_s) as consumer:
            control.send("connected")
            item = await consumer.drop_select(torch.tensor(TOKENS), None, timeout=60)
            assert item is not None
            control.send(("took", _checksum(item.key)))
            control.recv()  # no await: the loop is held as long as the caller's own work takes
            await asyncio.to_thread(control.recv)

    asyncio.run(main())


async def test_an_item_handed_over_is_not_delivered_again_when_its_taker_then_holds_its_loop() -> None:
    key = torch.ones(1, len(TOKENS), 1, 4)
    async with kvrt.Producer(heartbeat_s=HEARTBEAT_S) as producer:
        args = (producer.endpoint, HEARTBEAT_S)
        async with child_process(run_consumer_that_holds_its_loop_after_a_take, args, "a consumer") as (
            said,
            _,
            control,
        ):
            assert said == "connected"
            await producer.insert(torch.tensor(TOKENS), None, key, key)
            assert await asyncio.to_thread(control.recv) == ("took", _checksum(key))
            producer._serving.peer_left.clear()
            async with asyncio.timeout(10 * HEARTBEAT_S * 10):  # its lease ends (its loop sends nothing)
                await producer._serving.peer_left.wait()
            async with kvrt.Consumer(connect=producer.endpoint) as other:
                assert await other.drop_select(torch.tensor(TOKENS)) is None, "the item was taken twice"
            control.send("go")
        stats = producer.stats()
        assert (stats.totals.delivered_items, stats.totals.returned_items, stats.items) == (1, 0, 0)


def run_producer_inserting_when_told(heartbeat_s: float, control: multiprocessing.connection.Connection) -> None:
    """A producer that sends its endpoint, then inserts the item of `TOKENS` each time `control`
    says "insert" (answering "inserted"), until it says "stop"."""

    async def main() -> None:
        async with kvrt.Producer(heartbeat_s=heartbeat_s) as producer:
            control.send(producer.endpoint)
            key = torch.ones(1, len(TOKENS), 1, 4)
            while await asyncio.to_thread(control.recv) == "insert":
                await producer.insert(torch.tensor(TOKENS), None, key, key)
                control.send("inserted")

    asyncio.run(main())


def _signal(process: object, signum: int) -> None:
    pid = getattr(process, "pid", None)
    assert pid is not None
    os.kill(pid, signum)


STALL_TRIALS = 5
"""The producer's wake-up raced libzmq's I/O thread (and a receipt could travel on a connection
that broke meanwhile): before the fix, one trial showed the fault about 5 times in 6."""


@pytest.mark.timeout(240)
async def test_an_item_handed_over_while_its_producer_is_stopped_is_not_delivered_again_when_it_wakes() -> None:
    lease_s = HEARTBEAT_S * 10
    for _ in range(STALL_TRIALS):
        async with (
            child_process(run_producer_inserting_when_told, (HEARTBEAT_S,), "a producer") as (endpoint, producer, told),
            child_process(run_waiting_consumer, (endpoint, HEARTBEAT_S, list(TOKENS)), "a consumer") as (
                asked,
                first,
                reported,
            ),
        ):
            assert asked == "asked"
            reported.send(("wait",))  # for its call, without holding its loop first
            _signal(first, signal.SIGSTOP)  # the delivery waits, unread, in the consumer's queue
            told.send("insert")
            assert await asyncio.to_thread(told.recv) == "inserted"
            async with kvrt.Client(endpoint) as client:
                assert (await client.stats()).in_flight == 1
            _signal(producer, signal.SIGSTOP)
            _signal(first, signal.SIGCONT)  # well inside its lease: it hands the item over, and confirms it
            assert await asyncio.to_thread(reported.recv) == ("item", _checksum(torch.ones(1, len(TOKENS), 1, 4)))
            await asyncio.sleep(2 * lease_s)  # how long the producer stays stopped (a duration, not an ordering)
            _signal(producer, signal.SIGCONT)
            async with kvrt.Consumer(connect=endpoint, heartbeat_s=HEARTBEAT_S) as other:
                again = await other.drop_select(torch.tensor(TOKENS), None, timeout=lease_s)
            assert again is None, "the item was taken twice"


STORM_CONNECTIONS = 4000
STORM_S = 3.0
"""A few waves of connections (each wave stays a second, then closes)."""
STORM_ROUNDS = 2
"""Storms one after the other: what the first leaves behind grows less with each (it is kept, not leaked)."""
RSS_GROWTH_BOUND_BYTES = 64 << 20
LOOKUPS_PER_S = 100.0


def _rss_bytes(process: object) -> int:
    with open(f"/proc/{getattr(process, 'pid', None)}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


async def _peers_forgotten(endpoint: str) -> None:
    """Until the producer serves no peer but the asking client (the storm's are forgotten)."""
    async with kvrt.Client(endpoint) as client:
        for _ in range(FORGOTTEN_WITHIN_HEARTBEATS):
            if (await client.stats()).peers <= 1:
                return
            await asyncio.sleep(HEARTBEAT_S)  # another process's state: asked again each heartbeat
    raise AssertionError("the producer still serves the storm's peers")


FORGOTTEN_WITHIN_HEARTBEATS = 600


@pytest.mark.timeout(180)
async def test_a_connection_storm_leaves_the_producers_memory_where_it_was() -> None:
    from kvrt._attack import connects_main
    from tests._processes import run_producer

    async with child_process(run_producer, (0, HEARTBEAT_S), "a producer") as (endpoint, producer, _):
        await _peers_forgotten(endpoint)
        before = _rss_bytes(producer)
        for _ in range(STORM_ROUNDS):
            async with child_process(connects_main, (endpoint, STORM_CONNECTIONS, STORM_S), "a storm") as (
                opened,
                _,
                _,
            ):
                assert opened[1] >= STORM_CONNECTIONS
            await _peers_forgotten(endpoint)
        grown = _rss_bytes(producer) - before
        assert grown <= RSS_GROWTH_BOUND_BYTES, f"RSS grew {grown >> 20} MiB"


async def _lookup_durations(consumer: kvrt.Consumer, until: asyncio.Event) -> list[float]:
    """Lookups that answer at once (misses), LOOKUPS_PER_S a second until `until`: how long each took."""
    loop = asyncio.get_running_loop()
    durations = []
    while not until.is_set():
        started = loop.time()
        assert await consumer.drop_select(torch.tensor([-1])) is None
        durations.append(loop.time() - started)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(until.wait(), max(0.0, started + 1 / LOOKUPS_PER_S - loop.time()))
    return durations


def _p99(durations: list[float]) -> float:
    return sorted(durations)[int(len(durations) * 0.99)]


@pytest.mark.xfail(
    strict=True,
    reason="during waves of 4000 new connections another consumer's lookups wait 20-150 ms, p99 6-36x what it "
    "was; the producer's loop is mostly idle meanwhile (a profile: 1 s of Python in 6 s), the wait is in libzmq "
    "(one I/O thread: every handshake, and ZMTP heartbeats for every connection) and the host's CPU",
)
@pytest.mark.timeout(180)
async def test_a_connection_storm_does_not_slow_another_consumers_lookups_past_5x() -> None:
    from kvrt._attack import connects_main
    from tests._processes import run_producer

    async with (
        child_process(run_producer, (0, HEARTBEAT_S), "a producer") as (endpoint, _, _),
        kvrt.Consumer(connect=endpoint, heartbeat_s=HEARTBEAT_S) as consumer,
    ):
        baseline_over = asyncio.Event()
        measuring = asyncio.create_task(_lookup_durations(consumer, baseline_over))
        await asyncio.sleep(STORM_S)  # the baseline's length
        baseline_over.set()
        baseline = await measuring
        storm_over = asyncio.Event()
        measuring = asyncio.create_task(_lookup_durations(consumer, storm_over))
        async with child_process(connects_main, (endpoint, STORM_CONNECTIONS, STORM_S), "a storm"):
            storm_over.set()
        during = await measuring
        assert _p99(during) <= 5 * _p99(baseline), f"p99 {_p99(during) * 1e3:.1f} ms, {_p99(baseline) * 1e3:.1f} before"


HOARDED_ITEMS = 4
HOARDED_BYTES = 256 << 10
"""An item's K and V together: the hoarder's four fill the buffer."""


@pytest.mark.timeout(120)
async def test_a_live_peer_that_never_confirms_what_it_takes_does_not_keep_inserts_waiting() -> None:
    from kvrt._attack import hoarder_main

    lease_s = HEARTBEAT_S * 10
    shape = (1, len(TOKENS), 1, HOARDED_BYTES // 2 // len(TOKENS) // 4)  # float32 K and V
    async with kvrt.Producer(heartbeat_s=HEARTBEAT_S, buffer_bytes=HOARDED_ITEMS * HOARDED_BYTES) as producer:
        args = (producer.endpoint, TOKENS[0], HEARTBEAT_S)
        async with child_process(hoarder_main, args, "a hoarder") as (asked, _, reports):
            assert asked == "asked"
            for _ in range(HOARDED_ITEMS):  # every one is for the hoarder's lookups
                await producer.insert(torch.tensor(TOKENS), None, torch.ones(shape), torch.ones(shape))
            got = await asyncio.to_thread(reports.recv)
            while await asyncio.to_thread(reports.poll, 2 * lease_s):  # until it is served no more
                got = reports.recv()
            held = got[1]
            assert 0 < held < HOARDED_ITEMS and producer.stats().in_flight == held  # at most its share
            async with kvrt.Consumer(connect=producer.endpoint) as legit:  # the rest is for the others
                for _ in range(HOARDED_ITEMS - held):
                    assert await legit.drop_select(torch.tensor(TOKENS)) is not None
                other = torch.tensor([-7, -8])  # and inserts go on
                await producer.insert(other, None, torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), timeout=5 * lease_s)
                assert await legit.drop_select(other) is not None
