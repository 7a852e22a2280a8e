"""Decode ranks of another TP size than prefill, for tests/test_heterogeneous_tp.py (spawned).

Every rank of one gloo world runs every scenario in order: a scenario of D decode ranks uses
the group of ranks 0..D-1 (made by every rank, as torch asks), the others sit it out. Each
rank connects to the producers that hold its heads, takes its head range of the request, and
reports whether its key and value are the reference slice of the full KV, which it rebuilds
from the scenario's seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import multiprocessing
import os
import queue
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import kvrt
import kvrt.blocking
from tests._checks import caught_up

LAYERS = 2
TOKENS = 16
HEAD_DIM = 4
LATENT_DIM = 32


@dataclass(frozen=True)
class Scenario:
    name: str
    kv_heads: int
    """0: MLA (one latent per token, the same on every prefill rank)."""
    prefill: int
    decode: int
    seed: int
    endpoints: tuple[str, ...] = ()
    """One per prefill rank, filled in by the parent once its producers are up."""
    transport: str = "tcp"
    device: str = "cpu"
    """Where producers and consumers keep the KV (cuda:0 for every process on one GPU)."""
    late_rank: int | None = None
    """A prefill rank that inserts the request only after the decode ranks missed it once."""

    def heads_of(self, rank: int) -> tuple[int, int]:
        """The KV heads decode rank `rank` holds, as engines shard them (replicated when the
        decode TP is larger than the number of KV heads)."""
        if self.kv_heads == 0:
            return (0, 1)
        first = rank * self.kv_heads // self.decode
        return (first, first + max(1, self.kv_heads // self.decode))

    def prefill_heads(self, prefill_rank: int) -> tuple[int, int] | None:
        """The heads a prefill rank holds (None for MLA: every rank has the whole latent)."""
        if self.kv_heads == 0:
            return None
        per_rank = self.kv_heads // self.prefill
        return (prefill_rank * per_rank, (prefill_rank + 1) * per_rank)

    def producers_of(self, rank: int) -> list[int]:
        """The prefill ranks decode rank `rank` reads from: those holding its heads."""
        if self.kv_heads == 0:
            return [rank * self.prefill // self.decode]
        first, end = self.heads_of(rank)
        return [
            p for p in range(self.prefill)
            if (held := self.prefill_heads(p)) is not None and held[0] < end and first < held[1]
        ]  # fmt: skip


def tokens() -> torch.Tensor:
    return torch.arange(100, 100 + TOKENS, dtype=torch.int64)


def full_kv(scenario: Scenario) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The request's whole KV (every head) and hidden states."""
    generator = torch.Generator().manual_seed(scenario.seed)
    if scenario.kv_heads == 0:
        latent = torch.randn((LAYERS, TOKENS, 1, LATENT_DIM), generator=generator)
        return latent, torch.empty((LAYERS, TOKENS, 0, LATENT_DIM)), torch.randn((TOKENS, 8), generator=generator)
    shape = (LAYERS, TOKENS, scenario.kv_heads, HEAD_DIM)
    key = torch.randn(shape, generator=generator)
    value = torch.randn(shape, generator=generator)
    return key, value, torch.randn((TOKENS, 8), generator=generator)


def shard(scenario: Scenario, prefill_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What prefill rank `prefill_rank` inserts: its heads of the request."""
    key, value, hidden = full_kv(scenario)
    held = scenario.prefill_heads(prefill_rank)
    if held is None:
        return key, value, hidden
    return key[:, :, held[0] : held[1]].clone(), value[:, :, held[0] : held[1]].clone(), hidden


def checked(scenario: Scenario, rank: int, item: kvrt.KVItem | None) -> tuple[Any, ...]:
    """What a rank reports: a miss, or whether its bytes are the reference slice, and how many."""
    if item is None:
        return ("miss",)
    key, value, hidden = full_kv(scenario)
    first, end = scenario.heads_of(rank)
    if scenario.kv_heads:
        key, value = key[:, :, first:end], value[:, :, first:end]
    item = kvrt.KVItem(
        item.input_tokens.cpu(), None, item.key.cpu(), item.value.cpu(),
        None if item.hidden is None else item.hidden.cpu(), item.matched,
    )  # fmt: skip
    equal = (
        torch.equal(item.key, key) and torch.equal(item.value, value) and torch.equal(item.input_tokens, tokens())
        and item.hidden is not None and torch.equal(item.hidden, hidden)
    )  # fmt: skip
    return ("item", equal, item.key.nbytes + item.value.nbytes)


async def take(scenario: Scenario, rank: int, group: Any, results: Any, inserted: Any) -> None:
    endpoints = [scenario.endpoints[p] for p in scenario.producers_of(rank)]
    first, end = scenario.heads_of(rank)
    consumer = kvrt.Consumer(endpoints, scenario.device, group=group, transport=scenario.transport)
    async with consumer:
        item = await consumer.drop_select(tokens(), heads=slice(first, end))
        await caught_up(consumer)  # its receipts and releases were read: the parent may count the producers' items
        results.put((scenario.name, rank, "first", checked(scenario, rank, item)))
        if scenario.late_rank is not None:
            await asyncio.to_thread(inserted.wait, 60)
            item = await consumer.drop_select(tokens(), heads=slice(first, end), timeout=30)
            results.put((scenario.name, rank, "after", checked(scenario, rank, item)))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclasses.dataclass
class Run:
    producers: dict[str, list[kvrt.blocking.Producer]]
    reports: dict[tuple[str, int, str], tuple[Any, ...]]
    before_late_insert: list[int]
    """The late scenario's producers' stats once every rank had missed."""


def run_world(scenarios_asked: list[Scenario], world: int) -> Iterator[Run]:
    """Producers for every scenario (here, one per prefill rank, in this process), `world`
    decode ranks spawned, every report collected; yields the run, closes everything after."""
    producers: dict[str, list[kvrt.blocking.Producer]] = {}
    scenarios = []
    for scenario in scenarios_asked:
        ranks = []
        for prefill_rank in range(scenario.prefill):
            held = scenario.prefill_heads(prefill_rank)
            producer = kvrt.blocking.Producer(
                device=scenario.device,
                transport=None if scenario.transport == "tcp" else scenario.transport,
                heads=None if held is None else slice(*held),
            )
            if prefill_rank != scenario.late_rank:
                producer.insert(tokens(), None, *shard(scenario, prefill_rank))
            ranks.append(producer)
        producers[scenario.name] = ranks
        scenarios.append(dataclasses.replace(scenario, endpoints=tuple(p.endpoint for p in ranks)))
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    inserted = spawn.Event()
    port = free_port()
    processes = [
        spawn.Process(target=run_rank, args=(rank, world, port, scenarios, results, inserted)) for rank in range(world)
    ]
    for process in processes:
        process.start()
    reports: dict[tuple[str, int, str], tuple[Any, ...]] = {}
    before: list[int] = []
    expected = sum(s.decode * (1 if s.late_rank is None else 2) for s in scenarios_asked)
    late = next((s for s in scenarios_asked if s.late_rank is not None), None)
    try:
        while len(reports) < expected:
            try:
                report = results.get(timeout=120)
            except queue.Empty:
                text = f"the decode ranks reported {len(reports)} of {expected} results in time"
                raise AssertionError(text) from None
            if report[0] == "failed":
                raise AssertionError(f"decode rank {report[1]} failed: {report[2]}: {report[3]}")
            name, rank, phase, outcome = report
            reports[(name, rank, phase)] = outcome
            if late is not None and name == late.name and sum(1 for key in reports if key[0] == name) == late.decode:
                # Every rank missed: what the others hold is still there, whole.
                assert late.late_rank is not None
                before = [p.stats().items for p in producers[name]]
                producers[name][late.late_rank].insert(tokens(), None, *shard(late, late.late_rank))
                inserted.set()
        for process in processes:
            process.join(60)
        yield Run(producers, reports, before)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for ranks in producers.values():
            for producer in ranks:
                producer.close()


def run_rank(rank: int, world: int, port: int, scenarios: list[Scenario], results: Any, inserted: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    groups = [dist.new_group(list(range(scenario.decode))) for scenario in scenarios]  # every rank, in order
    try:
        for scenario, group in zip(scenarios, groups, strict=True):
            if rank < scenario.decode:
                asyncio.run(take(scenario, rank, group, results, inserted))
            dist.barrier()  # the next scenario's consumers start together
    except BaseException as error:
        results.put(("failed", rank, type(error).__name__, str(error)))
        raise
    finally:
        dist.destroy_process_group()
