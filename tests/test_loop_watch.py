"""Where a kvrt loop's time goes: each loop's lag and its thread's time are metrics, and a turn
that came later than `LOOP_LAG_LOG_S` is logged with what the thread did meanwhile."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import torch

import kvrt
import kvrt.blocking
from kvrt._loop_thread import LoopThread
from kvrt._loop_watch import LOOP_LAG_LOG_S, LOOP_WATCH_INTERVAL_S, watches

pytestmark = pytest.mark.timeout(60)

HELD_S = 3 * LOOP_LAG_LOG_S
"""How long a test holds a loop: well past the logged bound."""
WATCHED = "kvrt-watched"


class _Lines(logging.Handler):
    """The watch's log lines about the tests' loop thread, with an event set at the first."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.first = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if f"{WATCHED!r}" in record.getMessage():
            self.lines.append(record.getMessage())
            self.first.set()


@pytest.fixture
def lines() -> Iterator[_Lines]:
    handler = _Lines()
    logger = logging.getLogger("kvrt.loop")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread(WATCHED, "watched loop")
    try:
        yield thread
    finally:
        thread.stop()


def hold(seconds: float, *, busy: bool) -> None:
    """Keep the calling thread (a loop's) from its loop: blocked for `seconds`, or running
    until it used `seconds` of CPU."""
    if not busy:
        threading.Event().wait(seconds)
        return
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_a_loop_held_by_a_blocked_call_logs_a_late_turn_that_its_thread_neither_ran_nor_waited_for_a_core(
    loop_thread: LoopThread, lines: _Lines
) -> None:
    async def blocked() -> None:
        hold(HELD_S, busy=False)

    loop_thread.call(blocked, "hold")
    assert lines.first.wait(10 * LOOP_WATCH_INTERVAL_S + HELD_S)
    line = lines.lines[0]
    assert f"(thread {loop_thread.watch.thread_id} of process {os.getpid()})" in line
    ran = float(line.split("its thread ran ")[1].split(" s")[0])
    neither = float(line.split(" s for neither")[0].rsplit(" ", 1)[1])
    assert ran < LOOP_LAG_LOG_S < neither
    assert loop_thread.watch.late_turns >= 1 and loop_thread.watch.max_lag_s >= HELD_S - LOOP_WATCH_INTERVAL_S


def test_a_loop_held_by_its_own_work_counts_the_threads_cpu_time(loop_thread: LoopThread, lines: _Lines) -> None:
    before = loop_thread.watch.cpu_s

    async def busy() -> None:
        hold(HELD_S, busy=True)

    loop_thread.call(busy, "hold")
    assert lines.first.wait(10 * LOOP_WATCH_INTERVAL_S + HELD_S)
    ran = float(lines.lines[0].split("its thread ran ")[1].split(" s")[0])
    assert ran >= round(HELD_S, 2)
    assert loop_thread.watch.cpu_s - before >= HELD_S


def test_the_metrics_show_each_loops_lag_late_turns_and_cpu(loop_thread: LoopThread, lines: _Lines) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    kvrt.register_metrics(registry)

    async def busy() -> None:
        hold(HELD_S, busy=True)

    loop_thread.call(busy, "hold")
    assert lines.first.wait(10 * LOOP_WATCH_INTERVAL_S + HELD_S)
    labels = {"loop": WATCHED, "thread": str(loop_thread.watch.thread_id)}
    late = registry.get_sample_value("kvrt_loop_late_turns_total", labels)
    assert late is not None and late >= 1
    turns = registry.get_sample_value("kvrt_loop_lag_seconds_count", labels)
    within = registry.get_sample_value("kvrt_loop_lag_seconds_bucket", {**labels, "le": "0.3"})
    assert turns is not None and within is not None and turns - within >= 1  # the turn held past 0.3 s
    cpu = registry.get_sample_value("kvrt_loop_cpu_seconds_total", labels)
    assert cpu is not None and cpu >= HELD_S


def test_a_stopped_loop_thread_is_watched_no_more() -> None:
    thread = LoopThread("kvrt-stopped", "stopped loop")
    watch = thread.watch
    assert watch in watches()
    thread.stop()
    assert watch not in watches()


async def test_a_producer_and_a_consumer_watch_the_applications_loop_while_they_run() -> None:
    assert not [watch for watch in watches() if watch.thread_id == threading.get_native_id()]
    async with kvrt.Producer(bind="tcp://127.0.0.1:0") as producer:
        async with kvrt.Consumer(connect=producer.endpoint):
            (watch,) = [watch for watch in watches() if watch.thread_id == threading.get_native_id()]
            assert watch.name == threading.current_thread().name
        assert watch in watches()  # the producer still runs on it
    assert watch not in watches()


def taken_by_a_stalled_consumer(load: Callable[[str, torch.Tensor], Awaitable[object]]) -> object:
    """`load(endpoint, tokens)` run on a loop thread of its own, against a producer holding one
    item of `tokens`: what it returned. The producer holds nothing afterwards (it was taken)."""
    tokens = torch.arange(64)
    with kvrt.blocking.Producer(bind="tcp://127.0.0.1:0") as producer:
        producer.insert(tokens, None, torch.zeros(2, 64, 2, 4), torch.zeros(2, 64, 2, 4))
        decode = LoopThread("kvrt-stalled", "stalled consumer")
        try:
            taken = decode.call(lambda: load(producer.endpoint, tokens), "load")
        finally:
            decode.stop()
        assert producer.stats().items == 0
    return taken


def test_a_load_whose_own_loop_stalled_past_its_reply_timeout_takes_the_answer_that_came_meanwhile() -> None:
    # A decode worker starved (its process waited for a core) past the load's reply timeout,
    # while the producer answered at once: the answer sits unread, and the producer is not to
    # blame. The item is taken, not left on the producer.
    timeout_s = 0.5

    async def load_through_a_stall(endpoint: str, tokens: torch.Tensor) -> kvrt.ConsumerStream | None:
        async with kvrt.Consumer(connect=endpoint, reply_timeout_s=timeout_s) as consumer:
            link, sent = consumer.link_for_tests(), asyncio.Event()
            send_nowait = link.session.io.send_nowait

            def sending(frames: list[bytes]) -> bool:
                done = send_nowait(frames)
                sent.set()
                return done

            link.session.io.send_nowait = sending  # type: ignore[method-assign]
            opening = asyncio.ensure_future(consumer.open_stream(tokens))
            await sent.wait()  # its request left
            threading.Event().wait(3 * timeout_s)  # the loop's thread does not run
            return await opening

    assert taken_by_a_stalled_consumer(load_through_a_stall) is not None


def test_a_consumer_whose_own_loop_stalled_past_its_connect_timeout_takes_the_welcome_that_came_meanwhile() -> None:
    # A decode worker's first load connects to its producer; its process waits for a core past
    # the connect timeout while the producer answered at once. The welcome sits unread, and the
    # producer is not to blame: the consumer connects, and its load goes on.
    timeout_s = 0.5

    async def connect_through_a_stall(endpoint: str, tokens: torch.Tensor) -> kvrt.ConsumerStream | None:
        consumer = kvrt.Consumer(connect=endpoint, connect_timeout_s=timeout_s)
        starting = asyncio.ensure_future(consumer.start())
        await asyncio.sleep(0)  # the start runs up to its wait for the welcome
        threading.Event().wait(3 * timeout_s)  # the loop's thread does not run
        try:
            await starting
            return await consumer.open_stream(tokens)
        finally:
            await consumer.aclose()

    assert taken_by_a_stalled_consumer(connect_through_a_stall) is not None
