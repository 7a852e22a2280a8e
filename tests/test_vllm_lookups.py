"""The vLLM connector's scheduler-side lookups (no vLLM needed): answered whenever the producer
answers within the lookup timeout, never waited for by the scheduler's thread, and a producer
that does not answer backed off once per incident."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import kvrt.blocking
from kvrt.integrations.vllm._lookups import Lookups
from kvrt.integrations.vllm._scheduler import DecodeScheduler
from tests._relay import DelayingRelay

PROMPT = list(range(100, 170))


def free_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def producer() -> Iterator[kvrt.blocking.Producer]:
    with kvrt.blocking.Producer(bind=free_endpoint()) as started:
        shape = (1, len(PROMPT), 2, 4)
        started.insert(torch.tensor(PROMPT), None, torch.zeros(shape), torch.zeros(shape))
        yield started


@pytest.fixture
def lookups() -> Iterator[Lookups]:
    made = Lookups(timeout_s=5.0)
    yield made
    made.close()


def test_a_producer_slower_than_a_second_is_answered_within_the_lookup_timeout(
    producer: kvrt.blocking.Producer, lookups: Lookups
) -> None:
    # A producer whose loop shares its core with forward passes answers late: the lookup waits
    # for it as long as `lookup_timeout_s`, not kvrt's default reply timeout of a second.
    with DelayingRelay(producer.endpoint, delay_s=1.5) as relay:
        for index in range(3):  # batches of one step after the other, on one client
            lookups.ask(f"r{index}", relay.endpoint, PROMPT)
            lookups.send()
        assert lookups.answer("r0") is None  # on its way: the scheduler's thread never waits
        assert lookups.wait_settled(15)
        assert [lookups.answer(f"r{index}") for index in range(3)] == [len(PROMPT)] * 3
        assert lookups.asks(relay.endpoint)


def test_a_producer_that_is_gone_answers_nothing_and_is_backed_off_once(lookups: Lookups) -> None:
    gone = free_endpoint()
    quick = Lookups(timeout_s=0.3)
    try:
        for index in range(4):
            quick.ask(f"r{index}", gone, PROMPT)
        quick.send()
        assert quick.wait_settled(10)
        assert [quick.answer(f"r{index}") for index in range(4)] == [0] * 4
        assert not quick.asks(gone)
        assert quick._silent[gone][1] == 1.0  # one incident: the first backoff, not doubled per request
    finally:
        quick.close()


def test_a_producer_that_comes_back_after_its_backoff_is_asked_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvrt.integrations.vllm._lookups.SILENT_BACKOFF_S", (1e-3, 1e-3))
    endpoint = free_endpoint()
    quick = Lookups(timeout_s=0.5)
    try:
        quick.ask("before", endpoint, PROMPT)
        quick.send()
        assert quick.wait_settled(10) and quick.answer("before") == 0
        with kvrt.blocking.Producer(bind=endpoint) as producer:
            shape = (1, len(PROMPT), 2, 4)
            producer.insert(torch.tensor(PROMPT), None, torch.zeros(shape), torch.zeros(shape))
            assert quick.asks(endpoint)  # its backoff is over
            quick.ask("after", endpoint, PROMPT)
            quick.send()
            assert quick.wait_settled(10) and quick.answer("after") == len(PROMPT)
    finally:
        quick.close()


def test_kv_a_failed_lookup_may_have_missed_is_released_when_its_request_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # The lookup failed (the producer answered too late, or not yet): the request is computed,
    # and the KV its producer may hold all the same is released once the request ends.
    monkeypatch.setattr("kvrt.integrations.vllm._lookups.SILENT_BACKOFF_S", (1e-3, 1e-3))
    endpoint = free_endpoint()
    lookups = Lookups(timeout_s=0.5)
    try:
        decode = DecodeScheduler(lookups, block_size=16, default_endpoint=endpoint)
        assert decode.matched("r", PROMPT, None, 0) is None
        decode.step()  # the lookup leaves
        assert lookups.wait_settled(10) and decode.matched("r", PROMPT, None, 0) == 0
        with kvrt.blocking.Producer(bind=endpoint) as producer:
            shape = (1, len(PROMPT), 2, 4)
            producer.insert(torch.tensor(PROMPT), None, torch.zeros(shape), torch.zeros(shape))
            decode.finished("r", aborted=False)
            assert lookups.wait_settled(10)
            assert producer.stats().items == 0
    finally:
        lookups.close()


def test_kv_of_a_request_that_came_while_its_producer_was_backed_off_is_released_when_it_ends(
    producer: kvrt.blocking.Producer, lookups: Lookups
) -> None:
    # A load from the producer failed moments ago: the next request is not looked up there (it
    # is computed at once), but the router handed it KV that the prefill published all the
    # same; nobody else will take it.
    decode = DecodeScheduler(lookups, block_size=16, default_endpoint=producer.endpoint)
    decode.outcome(set(), set(), lost={producer.endpoint})
    assert not lookups.asks(producer.endpoint)
    assert decode.matched("r", PROMPT, None, 0) == 0
    decode.finished("r", aborted=False)
    assert lookups.wait_settled(10)
    assert producer.stats().items == 0


def test_kv_of_a_load_that_failed_is_released_at_once_not_when_its_request_ends(
    producer: kvrt.blocking.Producer, lookups: Lookups
) -> None:
    # The request computes its prompt and decodes on, for as long as its client asked: the KV
    # its load did not take leaves the producer now, whatever the failure was.
    decode = DecodeScheduler(lookups, block_size=16, default_endpoint=producer.endpoint)
    assert decode.matched("r", PROMPT, None, 0) is None
    decode.step()
    assert lookups.wait_settled(10) and decode.matched("r", PROMPT, None, 0) == len(PROMPT) - 1
    decode.allocated("r", list(range(5)), len(PROMPT) - 1)
    assert len(decode.step()) == 1  # the load leaves with the step
    decode.outcome({"r"}, {"r"})
    assert lookups.wait_settled(10)
    assert producer.stats().items == 0


def test_a_wait_for_an_answer_ends_at_once_while_one_came_and_is_not_read_yet(
    producer: kvrt.blocking.Producer, lookups: Lookups
) -> None:
    # An idle step waits for an answer (`wait_answer`); one that came between the step's
    # lookups and its end is for the next step, which must not wait behind a slower producer.
    with DelayingRelay(producer.endpoint, delay_s=2.0) as relay:
        lookups.ask("quick", producer.endpoint, PROMPT)
        lookups.ask("slow", relay.endpoint, PROMPT)
        lookups.send()
        lookups.wait_answer(5.0)  # the quick producer's answer is there, not read yet
        started = time.monotonic()
        lookups.wait_answer(1.0)
        assert time.monotonic() - started < 0.5
        assert lookups.answer("quick") == len(PROMPT) and lookups.answer("slow") is None
        assert lookups.wait_settled(10) and lookups.answer("slow") == len(PROMPT)


def test_a_lookup_whose_own_loop_stalled_past_its_timeout_takes_the_answer_that_came_meanwhile(
    producer: kvrt.blocking.Producer,
) -> None:
    # The scheduler's process starved (its lookups thread waited for a core, or for the GIL
    # held by the scheduler) past the lookup timeout, while the producer answered at once: the
    # answer sits unread, and the producer is not to blame.
    timeout_s = 0.5
    stalled = Lookups(timeout_s=timeout_s)
    try:
        stalled.ask("warm", producer.endpoint, PROMPT)  # the client's handshake, out of the way
        stalled.send()
        assert stalled.wait_settled(10) and stalled.answer("warm") == len(PROMPT)
        stalled.ask("r", producer.endpoint, PROMPT)
        stalled.send()  # its probe leaves on the lookups' loop, which then stalls

        async def stall() -> None:
            threading.Event().wait(3 * timeout_s)

        stalled._loop.submit(stall, "stall")
        assert stalled.wait_settled(10)
        assert stalled.answer("r") == len(PROMPT)
        assert stalled.asks(producer.endpoint)
    finally:
        stalled.close()
