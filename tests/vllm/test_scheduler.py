"""`KvrtConnector` in vLLM's own `Scheduler` (no model runs): what the scheduler computes and
plans to load for external hits, partial hits and misses, and what it releases on the
producer when a request finishes or is aborted on either side."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

import kvrt.blocking
from kvrt.integrations.vllm import KvrtConnectorMetadata
from tests.vllm.scheduler import NUM_BLOCKS, make_request, make_scheduler, run_step
from tests.vllm.test_two_instances import free_endpoint

PROMPT = list(range(10, 80))
"""70 tokens: two full blocks of 32 and a partial one."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model"
    subprocess.run([sys.executable, "-m", "tests.vllm.instance", "make-model", str(path)], check=True, timeout=120)
    return path


@pytest.fixture
def schedulers(model: Path) -> Iterator[Callable[..., Scheduler]]:
    """`make_scheduler` of the tiny model; each one shut down after the test (its connector's sockets)."""
    made: list[Scheduler] = []

    def make(role: str, *, num_blocks: int = NUM_BLOCKS, **extra: Any) -> Scheduler:
        made.append(make_scheduler(model, role, num_blocks=num_blocks, **extra))
        return made[-1]

    yield make
    for scheduler in made:
        scheduler.shutdown()


@pytest.fixture
def producer() -> Iterator[kvrt.blocking.Producer]:
    with kvrt.blocking.Producer(bind=free_endpoint()) as producer:
        yield producer


def hold(producer: kvrt.blocking.Producer, tokens: list[int]) -> None:
    """The producer holds KV for `tokens` (what a prefill instance's worker publishes)."""
    shape = (1, len(tokens), 2, 4)
    producer.insert(torch.tensor(tokens), None, torch.zeros(shape), torch.zeros(shape))


def holds(producer: kvrt.blocking.Producer) -> int:
    return producer.stats().items


def loads(output: object) -> list[tuple[str, int]]:
    meta = output.kv_connector_metadata  # type: ignore[attr-defined]
    assert isinstance(meta, KvrtConnectorMetadata)
    return [(load.request_id, len(load.tokens)) for load in meta.loads]


def assert_empty(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished_requests() and not scheduler.requests
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block


def finish(scheduler: Scheduler, output: object) -> list[object]:
    """Steps until every request finished: what the engine handed back for them."""
    done = run_step(scheduler, output)  # type: ignore[arg-type]
    while scheduler.has_unfinished_requests():
        done += run_step(scheduler, scheduler.schedule())
    return [out for out in done if out.finished]


def test_a_prompt_the_producer_holds_is_loaded_but_its_last_token_which_the_decode_computes(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, PROMPT)
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("hit", PROMPT, producer.endpoint))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"hit": 1}
    assert output.scheduled_new_reqs[0].num_computed_tokens == len(PROMPT) - 1
    assert loads(output) == [("hit", len(PROMPT) - 1)]
    finish(scheduler, output)
    assert_empty(scheduler)


def test_a_prefix_the_producer_holds_is_loaded_and_the_rest_computed(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, PROMPT[:40])
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("partial", PROMPT, producer.endpoint))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"partial": len(PROMPT) - 40}
    assert loads(output) == [("partial", 40)]
    finish(scheduler, output)
    assert_empty(scheduler)


def test_a_prompt_the_producer_does_not_hold_is_computed(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, [1, 2, 3])
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("miss", PROMPT, producer.endpoint))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"miss": len(PROMPT)} and loads(output) == []
    finish(scheduler, output)
    assert holds(producer) == 1  # another prompt's KV is not touched
    assert_empty(scheduler)


def test_a_prompt_whose_producer_does_not_answer_is_computed(schedulers: Callable[..., Scheduler]) -> None:
    scheduler = schedulers("kv_consumer", lookup_timeout_s=0.2)
    scheduler.add_request(make_request("gone", PROMPT, free_endpoint()))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"gone": len(PROMPT)} and loads(output) == []
    finish(scheduler, output)
    assert_empty(scheduler)


def test_a_producer_that_does_not_answer_holds_the_scheduler_once_not_for_every_request(
    schedulers: Callable[..., Scheduler],
) -> None:
    # Each lookup holds vLLM's scheduler (every request of the instance) for up to the lookup
    # timeout: the next requests naming a silent producer are computed at once for a while.
    timeout_s = 0.5
    scheduler = schedulers("kv_consumer", lookup_timeout_s=timeout_s)
    endpoint = free_endpoint()
    took = []
    for index in range(3):
        prompt = [token + 1000 * index for token in PROMPT]
        scheduler.add_request(make_request(f"r{index}", prompt, endpoint))
        started = time.monotonic()
        output = scheduler.schedule()
        took.append(time.monotonic() - started)
        assert output.num_scheduled_tokens == {f"r{index}": len(PROMPT)} and loads(output) == []
        finish(scheduler, output)
    assert took[0] >= timeout_s * 0.9  # asked, and waited for its answer
    assert max(took[1:]) < timeout_s / 2, took  # not asked again within its backoff
    assert_empty(scheduler)


def test_a_request_aborted_on_the_decode_before_it_loaded_releases_its_kv_on_the_producer(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, PROMPT)
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("aborted", PROMPT, producer.endpoint))
    scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    assert holds(producer) == 0
    assert_empty(scheduler)


def test_a_request_aborted_on_the_decode_while_it_waits_for_blocks_releases_its_kv_on_the_producer(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    other = [token + 100 for token in PROMPT]
    hold(producer, PROMPT)
    hold(producer, other)
    scheduler = schedulers("kv_consumer", num_blocks=4)  # 3 blocks of 32 tokens: one prompt at a time
    scheduler.add_request(make_request("first", other, producer.endpoint))
    scheduler.add_request(make_request("waiting", PROMPT, producer.endpoint))
    output = scheduler.schedule()
    assert loads(output) == [("first", len(PROMPT) - 1)] and holds(producer) == 2  # "waiting" found its KV
    scheduler.finish_requests("waiting", RequestStatus.FINISHED_ABORTED)
    assert holds(producer) == 1
    finish(scheduler, output)
    assert_empty(scheduler)


def test_a_finished_prefill_names_its_producer_and_keeps_the_kv_for_the_decode(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    scheduler = schedulers("kv_producer", bind=producer.endpoint)
    scheduler.add_request(make_request("prefill", PROMPT, max_tokens=1))
    output = scheduler.schedule()
    meta = output.kv_connector_metadata
    assert isinstance(meta, KvrtConnectorMetadata) and [save.tokens for save in meta.saves] == [PROMPT]
    hold(producer, PROMPT)  # what the worker publishes in that step
    (done,) = finish(scheduler, output)
    assert done.kv_transfer_params == {"kvrt_endpoint": producer.endpoint}  # type: ignore[attr-defined]
    assert holds(producer) == 1
    assert_empty(scheduler)


def test_a_prefill_aborted_after_it_published_releases_its_kv_on_the_producer(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    scheduler = schedulers("kv_producer", bind=producer.endpoint)
    scheduler.add_request(make_request("prefill", PROMPT, max_tokens=4))
    output = scheduler.schedule()
    hold(producer, PROMPT)
    run_step(scheduler, output)
    scheduler.finish_requests("prefill", RequestStatus.FINISHED_ABORTED)
    assert holds(producer) == 0
    assert_empty(scheduler)
