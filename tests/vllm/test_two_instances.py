"""A prefill and a decode vLLM instance in processes of their own, KV through kvrt: the decode
instance takes every prompt's KV but the last token's, and decodes as one instance alone does."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvrt.blocking
from tests._checks import same_bits
from tests.vllm.recording import record_name

INSTANCE_S = 240
"""Bound on one instance's run (about 30 s on a 2-core host)."""

PROMPT_LENGTHS = (40, 70, 33, 100)


def wait_ready(process: subprocess.Popen[str]) -> bool:
    """Whether the instance said "ready" (vLLM writes its own lines to standard output too)."""
    assert process.stdout is not None
    return any(line.strip() == "ready" for line in process.stdout)


def free_endpoint() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


class Run:
    """An instance running its requests in a process of its own, started at once; `outputs`
    waits for it (bounded by `INSTANCE_S` from its start). Its prompts and outputs are files
    named after `name`."""

    def __init__(
        self, model: Path, role: str, name: str, requests: list[dict[str, Any]], folder: Path, *extra: str
    ) -> None:
        prompts, self._out = folder / f"{name}-in.json", folder / f"{name}-out.json"
        prompts.write_text(json.dumps(requests))
        self._deadline = time.monotonic() + INSTANCE_S
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.instance", "run", "--model", str(model), "--role", role,
             "--prompts", str(prompts), "--out", str(self._out), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def outputs(self) -> list[Any]:
        try:
            code = self._process.wait(timeout=max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        assert code == 0, f"the instance exited with {code}"
        return list(json.loads(self._out.read_text()))

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def run_instance(
    model: Path, role: str, name: str, requests: list[dict[str, Any]], folder: Path, *extra: str
) -> list[Any]:
    return Run(model, role, name, requests, folder, *extra).outputs()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model(folder: Path) -> Path:
    path = folder / "model"
    subprocess.run([sys.executable, "-m", "tests.vllm.instance", "make-model", str(path)], check=True, timeout=120)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = random.Random(1)
    return [[generator.randrange(3, 500) for _ in range(length)] for length in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def beside(model: Path, prompts: list[list[int]], folder: Path) -> Iterator[dict[str, Run]]:
    """The instances that need no prefill, started together with it (a 2-core host starts
    vLLM instances faster side by side than one after another): one alone, the reference
    ("single"), and a decode told of a producer that was never there ("gone")."""
    gone = {"kvrt_endpoint": free_endpoint()}
    runs = {
        "single": Run(model, "single", "single", [{"prompt": prompt} for prompt in prompts], folder),
        "gone": Run(model, "consumer", "gone", [{"prompt": p, "kv_transfer_params": gone} for p in prompts], folder),
    }
    try:
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.fixture(scope="module")
def single(beside: dict[str, Run]) -> list[Any]:
    return beside["single"].outputs()


def start_producer(
    model: Path, prompts: list[list[int]], folder: Path, name: str
) -> tuple[list[Any], subprocess.Popen[str]]:
    """A prefill instance that ran `prompts` (one output token each) and serves their KV until
    its standard input closes; its pages recorded under `folder / name`."""
    requests, out, pages = folder / f"{name}-in.json", folder / f"{name}-out.json", folder / name
    requests.write_text(json.dumps([{"prompt": prompt} for prompt in prompts]))
    pages.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.vllm.instance", "run", "--model", str(model), "--role", "producer",
         "--bind", free_endpoint(), "--max-tokens", "1", "--prompts", str(requests), "--out", str(out),
         "--record", str(pages)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    if not wait_ready(process):
        stop(process)
        raise AssertionError("the prefill instance did not finish its prompts")
    return json.loads(out.read_text()), process


def stop(process: subprocess.Popen[str]) -> None:
    if process.stdin is not None:
        process.stdin.close()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def pages(folder: Path, tokens: list[int]) -> torch.Tensor:
    """The pages [layers, tokens, K|V, heads, head_dim] an instance recorded for `tokens`."""
    record = torch.load(folder / record_name(tokens))
    assert record["tokens"] == tokens
    return record["pages"]


@pytest.fixture(scope="module")
def producer(
    model: Path, prompts: list[list[int]], folder: Path, beside: dict[str, Run]
) -> Iterator[tuple[list[Any], subprocess.Popen[str]]]:
    # `beside`: the instances that need no prefill start first, and run while it does.
    prefilled, process = start_producer(model, prompts, folder, "producer-pages")
    try:
        yield prefilled, process
    finally:
        stop(process)


@pytest.fixture(scope="module")
def decoded(producer: tuple[list[Any], subprocess.Popen[str]], model: Path, folder: Path) -> list[Any]:
    prefilled, _ = producer
    requests = [{"prompt": done["prompt"], "kv_transfer_params": done["kv_transfer_params"]} for done in prefilled]
    (folder / "consumer-pages").mkdir()
    return run_instance(model, "consumer", "decoded", requests, folder, "--record", str(folder / "consumer-pages"))


def test_the_prefill_instance_names_its_kvrt_endpoint_in_each_requests_transfer_params(
    producer: tuple[list[Any], subprocess.Popen[str]],
) -> None:
    prefilled, _ = producer
    assert all(done["kv_transfer_params"]["kvrt_endpoint"].startswith("tcp://127.0.0.1:") for done in prefilled)


def test_the_decode_instance_computes_only_the_last_prompt_token_of_each_prompt(decoded: list[Any]) -> None:
    # vLLM's own per-request counter: prompt tokens it did not compute. It always computes the
    # last one (its logits give the first output token), as after a hit in its own prefix cache.
    assert [done["num_cached_tokens"] for done in decoded] == [len(done["prompt"]) - 1 for done in decoded]


def test_the_pages_the_decode_instance_loaded_are_the_prefill_instances_bit_for_bit(
    decoded: list[Any], prompts: list[list[int]], folder: Path
) -> None:
    # Every layer, every block: the full ones, the last one partly filled, and the token just
    # before the one the decode instance computes.
    for prompt in prompts:
        computed = pages(folder / "producer-pages", prompt)
        loaded = pages(folder / "consumer-pages", prompt[:-1])
        assert same_bits(loaded, computed[:, : len(prompt) - 1]), f"the pages of the {len(prompt)}-token prompt differ"


def test_the_prefill_instance_holds_no_prompt_once_the_decode_instance_took_them(
    decoded: list[Any], producer: tuple[list[Any], subprocess.Popen[str]]
) -> None:
    prefilled, _ = producer
    with kvrt.blocking.Client(prefilled[0]["kv_transfer_params"]["kvrt_endpoint"]) as client:
        assert client.stats().items == 0


def test_the_decode_instance_decodes_every_prompt_as_a_single_instance(decoded: list[Any], single: list[Any]) -> None:
    assert [done["tokens"] for done in decoded] == [done["tokens"] for done in single]


def test_a_decode_instance_whose_producer_is_gone_computes_every_prompt_and_decodes_the_same(
    beside: dict[str, Run], prompts: list[list[int]], single: list[Any]
) -> None:
    decoded = beside["gone"].outputs()
    assert [done["num_cached_tokens"] for done in decoded] == [0] * len(prompts)
    assert [done["tokens"] for done in decoded] == [done["tokens"] for done in single]
