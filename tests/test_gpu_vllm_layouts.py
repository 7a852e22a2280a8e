"""Every GPU KV cache layout of the pinned vLLM (`tests/data/vllm_kv_cache_layouts.json`, made by
vLLM's own code), built on the GPU as vLLM builds it and moved bit for bit from a prefill
process to a decode process through the connector's worker side, layer by layer: the same
layout, between layouts and block sizes, and prefill TP 2 -> decode TP 1 (a piece of the
heads from each prefill rank) and TP 1 -> 2, fetched (as the prefill's word plans a load) or
read as a stream (as a probe's). Over cuda_ipc and nixl, both processes on cuda:0 when the
host has one GPU; the Triton kernels gather and scatter the pages."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch

from kvrt.integrations.vllm._worker import WorkerSide
from tests._gpu_vllm import Scenario, blocks, run_prefills, slots
from tests._gpus import CONSUMER_DEVICE, PRODUCER_DEVICE, needs_nixl, one_gpu
from tests._vllm_layouts import CACHES, cache_id, cache_named, load, token_rows, worker

pytestmark = [one_gpu, pytest.mark.timeout(300, method="thread")]

spawn = multiprocessing.get_context("spawn")


def scenarios() -> list[Scenario]:
    same = [Scenario(f"same {cache_id(entry)}", [entry], [entry], entry["kv_heads"]) for entry in CACHES]
    conversions = [
        Scenario(f"{cache_id(source)} -> {cache_id(target)}", [source], [target], source["kv_heads"])
        for source, target in [
            (cache_named("FLASH_ATTN", "LBNHC"), cache_named("FLASH_ATTN", "LBHNC", block_size=32)),
            (cache_named("FLASH_ATTN", "BLHNC"), cache_named("FLASH_ATTN", "LHBNC")),
            (cache_named("FLASH_ATTN", "BHLNC"), cache_named("FLASH_ATTN", "LBNHC", block_size=32)),
            (cache_named("TRITON_MLA", "LBNHC"), cache_named("FLASHMLA", "LBNHC", block_size=64)),
        ]
    ]
    four, eight = cache_named("FLASH_ATTN", "LBNHC", kv_heads=4), cache_named("FLASH_ATTN", "LBNHC", kv_heads=8)
    eight_hnd = cache_named("FLASH_ATTN", "LBHNC", block_size=32, kv_heads=8)
    tp = [
        Scenario("TP 2 -> 1 (NHD 16 -> HND 32)", [four, four], [eight_hnd], 8),
        Scenario("TP 1 -> 2", [eight], [four, four], 8),
    ]
    return same + conversions + tp


def landed_rows(
    scenario: Scenario, decodes: list[tuple[WorkerSide, list[torch.Tensor]]], block_ids: list[int]
) -> torch.Tensor:
    entry = scenario.decode[0]
    parts = [token_rows(entry, caches, slots(entry, block_ids)) for _, caches in decodes]
    return parts[0] if entry["mla"] else torch.cat(parts, dim=2)


@pytest.mark.parametrize("transport", ["cuda_ipc", pytest.param("nixl", marks=needs_nixl)])
def test_every_vllm_gpu_layout_moves_bit_for_bit_through_the_connectors_worker_side(transport: str) -> None:
    plan = scenarios()
    parent, child = spawn.Pipe()
    prefill = spawn.Process(target=run_prefills, args=(plan, PRODUCER_DEVICE, transport, child), daemon=True)
    prefill.start()
    wrong: list[str] = []
    try:
        for index, scenario in enumerate(plan):
            assert parent.poll(120), f"the prefill process published nothing for {scenario.name}"
            name, tokens, endpoints, sent = parent.recv()
            assert name == scenario.name
            tp = len(scenario.decode)
            decodes = [
                worker(entry, CONSUMER_DEVICE, produces=False, rank=rank, tp=tp, total_heads=scenario.total_heads,
                       seed=1000 + 100 * index + rank, transport=transport)
                for rank, entry in enumerate(scenario.decode)
            ]  # fmt: skip
            try:
                entry = scenario.decode[0]
                block_ids = blocks(entry, 500 + index)
                # Every other scenario fetched as the prefill's word plans it, the others read as streams.
                failed = load([side for side, _ in decodes], endpoints, tokens, block_ids, entry["block_size"],
                              entry["layers"], published=index % 2 == 0)  # fmt: skip
                torch.cuda.synchronize(CONSUMER_DEVICE)
                if failed != [set()] * tp:
                    wrong.append(f"{scenario.name}: the load failed")
                elif not torch.equal(landed_rows(scenario, decodes, block_ids), sent):
                    wrong.append(f"{scenario.name}: the pages differ")
            finally:
                for side, _ in decodes:
                    side.close()
        parent.send("done")
        assert parent.poll(60)
        held: list[Any] = parent.recv()
        assert held == [0] * len(held), f"the prefill producers still hold items: {held}"
    finally:
        parent.send("stop")
        prefill.join(60)
        if prefill.is_alive():
            prefill.kill()
    assert not wrong, wrong
