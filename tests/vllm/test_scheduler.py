"""`KvrtConnector` in vLLM's own `Scheduler` (no model runs): what the scheduler computes and
plans to load for external hits, partial hits and misses, what it releases on the producer
when a request finishes, fails its load or is aborted on either side, and that a lookup never
holds the scheduler."""

from __future__ import annotations

import functools
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
from kvrt.integrations.vllm import _scheduler as decode_scheduler
from kvrt.integrations.vllm._config import DEFAULT_ITEM_TTL_S
from kvrt.integrations.vllm._scheduler import IDLE_WAIT_S
from kvrt.integrations.vllm._word import Word, tokens_digest
from kvrt.integrations.vllm.connector import KvrtConnectorMetadata
from tests._relay import DelayingRelay
from tests.vllm.scheduler import (
    ANSWER_S,
    connector,
    loads_of,
    make_request,
    make_scheduler,
    run_step,
    schedule_answered,
)
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

    def make(role: str, **kwargs: Any) -> Scheduler:
        made.append(make_scheduler(model, role, **kwargs))
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


def released(scheduler: Scheduler, producer: kvrt.blocking.Producer, items: int) -> bool:
    """Whether the producer holds `items` items once the scheduler's releases ended (it never
    waits for them: they land a round trip later)."""
    lookups = connector(scheduler)._lookups
    assert lookups is not None and lookups.wait_settled(ANSWER_S)
    return holds(producer) == items


def loads(output: object) -> list[tuple[str, int]]:
    return [(load.request_id, len(load.tokens)) for load in loads_of(output)]  # type: ignore[arg-type]


def assert_empty(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished_requests() and not scheduler.requests
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block


def finish(scheduler: Scheduler, output: object, **kwargs: Any) -> list[object]:
    """Steps until every request finished: what the engine handed back for them."""
    done = run_step(scheduler, output, **kwargs)  # type: ignore[arg-type]
    while scheduler.has_unfinished_requests():
        done += run_step(scheduler, schedule_answered(scheduler))
    return [out for out in done if out.finished]


def test_a_prompt_the_producer_holds_is_loaded_but_its_last_token_which_the_decode_computes(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, PROMPT)
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("hit", PROMPT, producer.endpoint))
    output = schedule_answered(scheduler)
    assert output.num_scheduled_tokens == {"hit": 1}
    assert output.scheduled_new_reqs[0].num_computed_tokens == len(PROMPT) - 1
    (load,) = loads_of(output)
    assert (load.request_id, len(load.tokens), load.skip, len(load.slots)) == ("hit", len(PROMPT) - 1, 0, 69)
    finish(scheduler, output)
    assert_empty(scheduler)


def test_a_prefix_the_producer_holds_is_loaded_and_the_rest_computed(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, PROMPT[:40])
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("partial", PROMPT, producer.endpoint))
    output = schedule_answered(scheduler)
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
    output = schedule_answered(scheduler)
    assert output.num_scheduled_tokens == {"miss": len(PROMPT)} and loads(output) == []
    finish(scheduler, output)
    assert holds(producer) == 1  # another prompt's KV is not touched
    assert_empty(scheduler)


def test_a_prompt_whose_producer_does_not_answer_is_computed(schedulers: Callable[..., Scheduler]) -> None:
    scheduler = schedulers("kv_consumer", lookup_timeout_s=0.2)
    scheduler.add_request(make_request("gone", PROMPT, free_endpoint()))
    output = schedule_answered(scheduler)
    assert output.num_scheduled_tokens == {"gone": len(PROMPT)} and loads(output) == []
    finish(scheduler, output)
    assert_empty(scheduler)


def test_a_producer_that_did_not_answer_is_not_asked_again_for_a_while(schedulers: Callable[..., Scheduler]) -> None:
    scheduler = schedulers("kv_consumer", lookup_timeout_s=0.2)
    endpoint = free_endpoint()
    scheduler.add_request(make_request("first", PROMPT, endpoint))
    finish(scheduler, schedule_answered(scheduler))
    scheduler.add_request(make_request("second", [token + 1000 for token in PROMPT], endpoint))
    output = scheduler.schedule()  # no lookup: computed at once
    assert output.num_scheduled_tokens == {"second": len(PROMPT)} and loads(output) == []
    finish(scheduler, output)
    assert_empty(scheduler)


def lookup_times(scheduler: Scheduler, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds each of the scheduler's calls of `get_num_new_matched_tokens` takes, as made."""
    taken: list[float] = []
    kvrt_connector = connector(scheduler)
    original = kvrt_connector.get_num_new_matched_tokens

    def timed(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        started = time.perf_counter()
        try:
            return original(request, num_computed_tokens)
        finally:
            taken.append(time.perf_counter() - started)

    monkeypatch.setattr(kvrt_connector, "get_num_new_matched_tokens", timed)
    return taken


@pytest.mark.parametrize("producer_is", ["slow", "gone"])
def test_a_lookup_never_holds_the_scheduler_whether_its_producer_answers_late_or_not_at_all(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer, monkeypatch: pytest.MonkeyPatch,
    producer_is: str,
) -> None:  # fmt: skip
    # Every request of the instance waits while the scheduler does: a lookup answers None
    # ("ask again next step") until its producer did, however long that takes.
    prompts = [[token + 1000 * index for token in PROMPT] for index in range(64)]
    for prompt in prompts:
        hold(producer, prompt)
    with DelayingRelay(producer.endpoint, delay_s=0.05) as relay:
        endpoint = relay.endpoint if producer_is == "slow" else free_endpoint()
        scheduler = schedulers("kv_consumer", num_blocks=512, max_num_seqs=64, lookup_timeout_s=1.0)
        taken = lookup_times(scheduler, monkeypatch)
        for index, prompt in enumerate(prompts):
            scheduler.add_request(make_request(f"r{index}", prompt, endpoint, max_tokens=1))
        planned = []
        deadline = time.monotonic() + 30
        while scheduler.has_unfinished_requests() and time.monotonic() < deadline:
            output = scheduler.schedule()
            planned += loads(output)
            run_step(scheduler, output)
    assert not scheduler.has_unfinished_requests()
    taken.sort()
    assert taken[int(0.99 * (len(taken) - 1))] <= 1e-3, f"p99 {taken[int(0.99 * (len(taken) - 1))] * 1e3:.2f} ms"
    if producer_is == "slow":
        assert len(planned) == 64  # every request waited for its answer, and loaded
    else:
        assert planned == []
    assert_empty(scheduler)


def test_an_instance_with_only_lookups_on_their_way_waits_for_an_answer_instead_of_stepping(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    # vLLM's engine steps without a pause while it has requests, even when it schedules
    # nothing: with only lookups on their way, each empty step waits for the first answer
    # (bounded), not a spin of the engine and its workers over the host's cores while the
    # producer that must answer waits for one.
    hold(producer, PROMPT)
    with DelayingRelay(producer.endpoint, delay_s=0.5) as relay:
        scheduler = schedulers("kv_consumer", lookup_timeout_s=5.0)
        scheduler.add_request(make_request("slow", PROMPT, relay.endpoint))
        empty_steps, started = 0, time.monotonic()
        while not (output := scheduler.schedule()).num_scheduled_tokens:
            empty_steps += 1
            run_step(scheduler, output)
            assert time.monotonic() - started < 10, "the answer never came"
        waited = time.monotonic() - started
    assert loads(output) == [("slow", len(PROMPT) - 1)]
    assert waited >= 0.5
    assert empty_steps <= waited / IDLE_WAIT_S + 2, f"{empty_steps} empty steps in {waited:.2f} s"
    finish(scheduler, output)
    assert_empty(scheduler)


def test_an_empty_step_while_a_request_runs_waits_for_no_lookup(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With vLLM's async scheduling a step can schedule nothing while a batch runs: the engine
    # waits for that batch's output next, not for a lookup.
    monkeypatch.setattr(decode_scheduler, "IDLE_WAIT_S", 1.0)
    hold(producer, PROMPT)
    with DelayingRelay(producer.endpoint, delay_s=2.0) as relay:
        scheduler = schedulers("kv_consumer", lookup_timeout_s=5.0)
        scheduler.add_request(make_request("running", [token + 1000 for token in PROMPT], max_tokens=4))
        scheduler.add_request(make_request("slow", PROMPT, relay.endpoint))
        output = scheduler.schedule()
        assert output.num_scheduled_tokens == {"running": len(PROMPT)}
        decode = connector(scheduler)._decode
        assert decode is not None
        started = time.monotonic()
        assert decode.step(idle=True) == []
        assert time.monotonic() - started < 0.5
        finish(scheduler, output)
    assert_empty(scheduler)


def test_a_steps_lookups_reach_their_producer_in_one_message(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []
    original = kvrt.Client.probe_many

    async def counted(client: kvrt.Client, queries: Any) -> Any:
        asked.append(len(queries))
        return await original(client, queries)

    monkeypatch.setattr(kvrt.Client, "probe_many", counted)
    scheduler = schedulers("kv_consumer")
    for index in range(4):
        scheduler.add_request(make_request(f"r{index}", [token + 1000 * index for token in PROMPT], producer.endpoint))
    finish(scheduler, schedule_answered(scheduler))
    assert asked == [4]


def test_a_request_preempted_after_its_load_computes_its_prompt_and_is_not_loaded_twice(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    # Two requests whose prompts fill the cache: the first to need a new block while decoding
    # preempts the other, which loaded its KV (the producer's item is taken).
    first, second = PROMPT[:63], [token + 1000 for token in PROMPT[:63]]
    hold(producer, first)
    hold(producer, second)
    scheduler = schedulers("kv_consumer", num_blocks=5)  # 4 blocks of 32: two per prompt
    scheduler.add_request(make_request("first", first, producer.endpoint, max_tokens=40))
    scheduler.add_request(make_request("second", second, producer.endpoint, max_tokens=40))
    output = schedule_answered(scheduler)
    assert sorted(loads(output)) == [("first", 62), ("second", 62)]
    planned = loads(output)
    run_step(scheduler, output)
    preempted = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        planned += loads(output)
        preempted += sum(request.num_preemptions for request in scheduler.requests.values())
        run_step(scheduler, output)
    assert preempted > 0, "no request was preempted: the test did not test what it says"
    assert sorted(planned) == [("first", 62), ("second", 62)]  # no second load of a taken item
    assert_empty(scheduler)


def test_a_decode_that_holds_a_prefix_in_its_own_cache_loads_only_the_rest(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    scheduler = schedulers("kv_consumer", prefix_caching=True)
    shared = PROMPT[:64]  # two full blocks
    scheduler.add_request(make_request("computed", [*shared, 5, 6, 7], producer.endpoint))
    finish(scheduler, schedule_answered(scheduler))  # the producer holds nothing: computed, cached
    hold(producer, PROMPT)
    scheduler.add_request(make_request("loaded", PROMPT, producer.endpoint))
    output = schedule_answered(scheduler)
    (load,) = loads_of(output)
    assert (load.skip, len(load.tokens), len(load.slots)) == (64, 69, 5)
    assert len(load.block_ids) == 1  # the third block only: the prefix's two are the cache's
    finish(scheduler, output)
    assert_empty(scheduler)


def test_a_load_the_workers_report_failed_is_recomputed_and_its_kv_released_on_the_producer(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, PROMPT)
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("failed", PROMPT, producer.endpoint))
    output = schedule_answered(scheduler)
    assert loads(output) == [("failed", len(PROMPT) - 1)]
    finish(scheduler, output, failed={"failed"})
    assert released(scheduler, producer, 0)  # the item the load did not take is gone
    assert_empty(scheduler)


@pytest.mark.parametrize("ends", ["its load failed", "aborted before the scheduler saw it"])
def test_a_request_that_goes_on_from_the_prefills_first_token_loads_the_whole_prompt_and_releases_it_if_unloaded(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer, ends: str
) -> None:
    # The router answered the prefill's first token at once and asks for the prompt plus that
    # token: the producer's item (the prompt) is a prefix of it, loaded whole, and released by
    # the decode when no load took it, though its prompt is one token longer.
    hold(producer, PROMPT)
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("going-on", [*PROMPT, 7], producer.endpoint))
    if ends == "its load failed":
        output = schedule_answered(scheduler)
        assert loads(output) == [("going-on", len(PROMPT))]
        finish(scheduler, output, failed={"going-on"})
    else:
        scheduler.finish_requests("going-on", RequestStatus.FINISHED_ABORTED)
    assert released(scheduler, producer, 0)
    assert_empty(scheduler)


def test_a_load_that_landed_releases_nothing(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, PROMPT)
    hold(producer, [1, 2, 3])
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("landed", PROMPT, producer.endpoint, max_tokens=1))
    output = schedule_answered(scheduler)
    assert loads(output) == [("landed", len(PROMPT) - 1)]
    finish(scheduler, output)  # the workers report it landed
    assert released(scheduler, producer, 2)  # no worker took the item in this test, and nothing released it
    assert_empty(scheduler)


def test_a_request_aborted_on_the_decode_before_it_loaded_releases_its_kv_on_the_producer(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, PROMPT)
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("aborted", PROMPT, producer.endpoint))
    run_step(scheduler, scheduler.schedule())  # its lookup is out
    scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    assert released(scheduler, producer, 0)
    assert_empty(scheduler)


def test_a_request_aborted_on_the_decode_before_the_scheduler_saw_it_releases_its_kv_on_the_producer(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    # Its client left as it arrived (vLLM aborts it from the waiting queue): no lookup was
    # made, and nobody else will take the KV its prefill published.
    hold(producer, PROMPT)
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("aborted", PROMPT, producer.endpoint))
    scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    assert released(scheduler, producer, 0)
    assert_empty(scheduler)


def test_a_request_aborted_on_the_decode_while_it_waits_for_blocks_releases_its_kv_on_the_producer(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    other = [token + 100 for token in PROMPT]
    hold(producer, PROMPT)
    hold(producer, other)
    scheduler = schedulers("kv_consumer", num_blocks=4)  # 3 blocks of 32: one prompt at a time
    scheduler.add_request(make_request("first", other, producer.endpoint))
    scheduler.add_request(make_request("waiting", PROMPT, producer.endpoint))
    output = schedule_answered(scheduler)
    assert loads(output) == [("first", len(PROMPT) - 1)] and holds(producer) == 2  # "waiting" found its KV
    scheduler.finish_requests("waiting", RequestStatus.FINISHED_ABORTED)
    assert released(scheduler, producer, 1)
    finish(scheduler, output)
    assert_empty(scheduler)


def test_a_finished_prefill_names_its_producer_and_keeps_the_kv_for_the_decode(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    scheduler = schedulers("kv_producer", bind=producer.endpoint)
    scheduler.add_request(make_request("prefill", PROMPT, max_tokens=1, remote_decode=True))
    output = scheduler.schedule()
    meta = output.kv_connector_metadata
    assert isinstance(meta, KvrtConnectorMetadata) and [save.tokens for save in meta.saves] == [PROMPT]
    hold(producer, PROMPT)  # what the worker publishes in that step
    before = time.time()
    (done,) = finish(scheduler, output)
    params = done.kv_transfer_params  # type: ignore[attr-defined]
    word = params.pop("kvrt_published")
    assert params == {"kvrt_endpoint": producer.endpoint, "kvrt_endpoints": [producer.endpoint]}
    assert word.pop("held_until") >= before + DEFAULT_ITEM_TTL_S
    assert word == {"v": 1, "endpoints": [producer.endpoint], "tokens": len(PROMPT), "digest": tokens_digest(PROMPT)}
    assert holds(producer) == 1
    assert_empty(scheduler)


def test_a_decode_plans_the_load_a_prefills_word_names_in_the_step_that_first_sees_it_asking_nothing(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    prefill = schedulers("kv_producer", bind=producer.endpoint)
    prefill.add_request(make_request("prefill", PROMPT, max_tokens=1, remote_decode=True))
    output = prefill.schedule()
    hold(producer, PROMPT)
    (done,) = finish(prefill, output)
    decode = schedulers("kv_consumer")
    decode.add_request(make_request("decode", PROMPT, params=done.kv_transfer_params))  # type: ignore[attr-defined]
    first = decode.schedule()
    assert loads(first) == [("decode", len(PROMPT) - 1)]
    assert first.num_scheduled_tokens == {"decode": 1}  # the last prompt token, computed in this step
    assert connector(decode)._decode.counters["lookups"] == 0  # type: ignore[union-attr]
    assert producer.stats().peers == 0  # nobody asked it anything
    finish(decode, first)
    assert_empty(decode)


def test_a_word_for_a_prefix_of_the_prompt_loads_that_prefix(schedulers: Callable[..., Scheduler]) -> None:
    # The router's first token at once: the decode's prompt is the prefill's and its first token.
    word = Word.of(["tcp://127.0.0.1:9"], PROMPT, None)
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("longer", [*PROMPT, 5], params={"kvrt_published": word.params()}))
    assert loads(scheduler.schedule()) == [("longer", len(PROMPT))]


def forged(**changes: Any) -> dict[str, Any]:
    """The params of a word for `PROMPT` with `changes` made to it (None: the field removed)."""
    word = Word.of(["tcp://127.0.0.1:9"], PROMPT, 60.0).params()
    for name, value in changes.items():
        if value is None:
            del word[name]
        else:
            word[name] = value
    return {"kvrt_published": word}


@pytest.mark.parametrize(
    "params",
    [
        forged(digest=tokens_digest(PROMPT[:-1])),
        forged(tokens=len(PROMPT) + 1),
        forged(tokens=0),
        forged(tokens=True),
        forged(endpoints=["tcp://127.0.0.1:9"] * 257),
        forged(endpoints=["ipc:///tmp/x"]),
        forged(endpoints=[["tcp://127.0.0.1:9"]]),
        forged(held_until="soon"),
        forged(held_until=float("nan")),
        forged(v=0),
        forged(extra=1),
        forged(digest=None),
        {"kvrt_published": "x" * 100_000},
        {"kvrt_published": functools.reduce(lambda inner, _: {"v": inner}, range(500), {})},
    ],
    ids=[
        "another-prompts-digest", "more-tokens-than-the-prompt", "no-tokens", "a-bool-for-tokens",
        "too-many-endpoints", "not-tcp", "a-nested-endpoint", "a-string-for-held-until", "nan-held-until",
        "version-0", "an-unknown-field", "no-digest", "a-string-word", "deep-nesting",
    ],
)
def test_a_word_that_cannot_be_read_is_refused_and_its_prompt_computed_here(
    schedulers: Callable[..., Scheduler], params: dict[str, Any]
) -> None:
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("forged", PROMPT, params=params))
    output = scheduler.schedule()
    assert loads(output) == [] and output.num_scheduled_tokens == {"forged": len(PROMPT)}
    assert connector(scheduler)._decode.counters["refused_words"] == 1  # type: ignore[union-attr]
    finish(scheduler, output)
    assert_empty(scheduler)


def test_a_word_past_its_time_is_computed_here_and_releases_nothing(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, PROMPT)
    params = forged(endpoints=[producer.endpoint], held_until=time.time() - 1.0)
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("late", PROMPT, params=params, max_tokens=1))
    output = scheduler.schedule()
    assert loads(output) == [] and output.num_scheduled_tokens == {"late": len(PROMPT)}
    finish(scheduler, output)
    assert released(scheduler, producer, 1)
    assert producer.stats().peers == 0


def test_a_word_of_a_later_version_is_not_read_and_the_producer_is_asked(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    hold(producer, PROMPT)
    params = {**forged(v=2, extra="what a later release adds"), "kvrt_endpoint": producer.endpoint}
    scheduler = schedulers("kv_consumer")
    scheduler.add_request(make_request("later", PROMPT, params=params))
    assert loads(scheduler.schedule()) == []  # asked: answered next step
    assert loads(schedule_answered(scheduler)) == [("later", len(PROMPT) - 1)]


def test_a_prefill_request_that_asks_for_no_remote_decode_publishes_nothing(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    # A request served by the prefill instance itself (no router, a health check): its KV
    # would only take the producer's buffer until its TTL.
    scheduler = schedulers("kv_producer", bind=producer.endpoint)
    scheduler.add_request(make_request("alone", PROMPT, max_tokens=2))
    output = scheduler.schedule()
    meta = output.kv_connector_metadata
    assert isinstance(meta, KvrtConnectorMetadata) and meta.saves == []
    (done,) = finish(scheduler, output)
    assert done.kv_transfer_params is None  # type: ignore[attr-defined]
    assert_empty(scheduler)


def test_a_prefill_aborted_after_it_published_releases_its_kv_on_the_producer(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    scheduler = schedulers("kv_producer", bind=producer.endpoint)
    scheduler.add_request(make_request("prefill", PROMPT, max_tokens=4, remote_decode=True))
    output = scheduler.schedule()
    hold(producer, PROMPT)
    run_step(scheduler, output)
    scheduler.finish_requests("prefill", RequestStatus.FINISHED_ABORTED)
    assert released(scheduler, producer, 0)
    assert_empty(scheduler)



def test_the_blocks_of_a_failed_load_are_never_a_prefix_cache_hit(
    schedulers: Callable[..., Scheduler], producer: kvrt.blocking.Producer
) -> None:
    # vLLM caches a load's blocks as it allocates them and, with the recompute policy, leaves
    # them cached when the load fails: a request preempted before it recomputed them (or
    # another with the same prefix) would read their garbage as its own prefix. The
    # connector takes them out of the prefix cache once the workers report the failure.
    hold(producer, PROMPT)
    scheduler = schedulers("kv_consumer", prefix_caching=True)
    scheduler.add_request(make_request("failed", PROMPT, producer.endpoint, max_tokens=4))
    output = schedule_answered(scheduler)
    (load,) = loads_of(output)
    pool = scheduler.kv_cache_manager.block_pool
    full = [block for block in load.block_ids[: (len(PROMPT) - 1) // 32]]
    assert full and all(pool.blocks[block].block_hash is not None for block in full)  # cached at allocation
    run_step(scheduler, output, failed={"failed"})
    assert all(pool.blocks[block].block_hash is None for block in full)
    finish(scheduler, scheduler.schedule())
    assert_empty(scheduler)
