"""The prefill instance of the GPU tests of vLLM's layouts, in a process of its own (importable
by `spawn`): for each scenario, its ranks' worker sides over caches vLLM's way, a request
published from them; what it sent goes back to the test over a pipe."""

from __future__ import annotations

import multiprocessing.connection
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrt.integrations.vllm._worker import WorkerSide
from tests._vllm_layouts import publish, token_rows, worker

TOKENS = 70


@dataclass(frozen=True)
class Scenario:
    """A request moved from `prefill` caches (one per prefill rank) into `decode` ones (one per
    decode rank), the model's `total_heads` KV heads shared as the ranks' counts say."""

    name: str
    prefill: list[dict[str, Any]]
    decode: list[dict[str, Any]]
    total_heads: int
    tokens: list[int] = field(default_factory=list)


def blocks(entry: dict[str, Any], seed: int) -> list[int]:
    return random.Random(seed).sample(range(entry["blocks"]), -(-TOKENS // entry["block_size"]))


def slots(entry: dict[str, Any], block_ids: list[int]) -> list[int]:
    size = entry["block_size"]
    return [block_ids[token // size] * size + token % size for token in range(TOKENS)]


def sent_rows(scenario: Scenario, caches: list[list[torch.Tensor]], block_ids: list[int]) -> torch.Tensor:
    """The request's rows [layers, tokens, heads, content] as the prefill ranks hold them, the
    model's heads side by side (a latent: rank 0's)."""
    entry = scenario.prefill[0]
    parts = [token_rows(entry, rank_caches, slots(entry, block_ids)) for rank_caches in caches]
    return parts[0] if entry["mla"] else torch.cat(parts, dim=2)


def run_prefills(
    scenarios: list[Scenario], device: str, transport: str | None, control: multiprocessing.connection.Connection
) -> None:
    """Publish each scenario's request; send (name, endpoints, rows sent, block ids); serve until told."""
    sides: list[WorkerSide] = []
    try:
        for index, scenario in enumerate(scenarios):
            tp = len(scenario.prefill)
            ranks = [
                worker(entry, device, produces=True, rank=rank, tp=tp, total_heads=scenario.total_heads,
                       seed=100 * index + rank, transport=transport)
                for rank, entry in enumerate(scenario.prefill)
            ]  # fmt: skip
            sides += [side for side, _ in ranks]
            entry = scenario.prefill[0]
            block_ids = blocks(entry, index)
            tokens = [10_000 * (index + 1) + token for token in range(TOKENS)]
            publish([side for side, _ in ranks], tokens, block_ids, entry["block_size"], entry["layers"])
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            endpoints = [side.endpoint or "tcp://127.0.0.1:1" for side, _ in ranks]
            control.send((scenario.name, tokens, endpoints, sent_rows(scenario, [c for _, c in ranks], block_ids)))
        control.recv()  # the test is done
        control.send([side._producer.stats().items if side._producer else 0 for side in sides])
        control.recv()
    finally:
        for side in sides:
            side.close()
