"""`kvrt bench nixl`: kvrt over NIXL on one device, beside raw NIXL READs of the same bytes, in
the same run. The device is cuda:0 where there is a GPU (both processes on it: UCX moves the
bytes with CUDA IPC), else the host (UCX's `cma`, or TCP with `UCX_TLS=tcp`).

* raw NIXL: two agents, the server's buffers registered once, the client READing item after
  item into a buffer it registered once, each READ made, posted and asked after until done
  (then, on a GPU, the device synchronized);
* kvrt, items: the producer holds the items (inserted before the clock); the consumer takes
  each with `drop_select` by its tokens, one at a time, on `transport="nixl"`;
* kvrt, paged pull: the producer published each request from paged pools (`register_pools`,
  `publish`: gathered into an item before the clock); the consumer `pull`s it into pools of
  its own, the device synchronized. Token-major pools (LightLLM: a 2 KiB row a token and
  layer) take the READ into kvrt's memory, then the scatter; block pools of 16-slot pages
  (vLLM), the request's pages in shuffled order, take one READ with a descriptor a page,
  layer and part, straight into the pages.

Goal: at 16 MiB and above, kvrt's rate (bytes over its p50) at least 90% of raw NIXL's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing.connection
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import torch

from kvrt._bench._timing import Timed, markdown_table, timed_pair

RATE_GOAL: Final = 0.9
GOAL_FROM_BYTES: Final = 16 << 20
WARMUP: Final = 4
LAYERS: Final = 32
HEADS: Final = 8
DIM: Final = 128
TOKEN_BYTES: Final = LAYERS * 2 * HEADS * DIM * 2
"""K and V of one token over every layer, bf16: 128 KiB."""


@dataclass(frozen=True)
class Case:
    label: str
    kind: str
    """"item" (drop_select) or "pull" (publish, then pull into pools)."""
    item_bytes: int
    requests: int
    layout: str = "token_major"
    """A pull's pools: "token_major" or "block" (16-slot pages)."""

    @property
    def tokens(self) -> int:
        return self.item_bytes // TOKEN_BYTES


CASES: Final = (
    Case("16 MiB item", "item", 16 << 20, 30),
    Case("64 MiB item", "item", 64 << 20, 20),
    Case("256 MiB item", "item", 256 << 20, 10),
    Case("16 MiB pull, token rows", "pull", 16 << 20, 30),
    Case("64 MiB pull, token rows", "pull", 64 << 20, 20),
    Case("16 MiB pull, 16-slot pages", "pull", 16 << 20, 30, "block"),
    Case("64 MiB pull, 16-slot pages", "pull", 64 << 20, 20, "block"),
)
QUICK_CASES: Final = (
    Case("16 MiB item", "item", 16 << 20, 8),
    Case("16 MiB pull, 16-slot pages", "pull", 16 << 20, 8, "block"),
)
PAGE_SLOTS: Final = 16


def _device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _request_tokens(index: int, case: Case) -> torch.Tensor:
    return torch.arange(case.tokens) + 1_000_000 * (index + 1)


def _pools(case: Case, device: str, fill: bool) -> Any:
    """Pools of one replica for `case.tokens` slots, `LAYERS` layers, bf16: token-major
    [slots, 2 * HEADS, DIM] or blocks [2, pages, PAGE_SLOTS, HEADS, DIM]."""
    from kvrt import Layout, PoolTable

    layout = Layout(case.layout)
    if layout is Layout.BLOCK:
        shape: tuple[int, ...] = (2, case.tokens // PAGE_SLOTS, PAGE_SLOTS, HEADS, DIM)
    else:
        shape = (case.tokens, 2 * HEADS, DIM)

    def layer(index: int) -> torch.Tensor:
        return torch.full(shape, float(index % 5) if fill else 0.0, dtype=torch.bfloat16, device=device)

    return PoolTable([[[layer(index) for index in range(LAYERS)]]], layout)


def _pull_slots(case: Case, device: str) -> torch.Tensor:
    """Where the consumer's pull lands the request: every slot, its pages in shuffled order
    (as an engine's block table hands them out) where the pools are paged."""
    if case.layout != "block":
        return torch.arange(case.tokens, device=device)
    pages = torch.randperm(case.tokens // PAGE_SLOTS, generator=torch.Generator().manual_seed(0))
    return (pages[:, None] * PAGE_SLOTS + torch.arange(PAGE_SLOTS)).flatten().to(device)


# -- kvrt -------------------------------------------------------------------------------------


def _kvrt_producer(case: Case, device: str, control: multiprocessing.connection.Connection) -> None:
    import kvrt

    torch.set_num_threads(1)

    async def main() -> None:
        async with kvrt.Producer(device=device, transport="nixl", buffer_bytes=1 << 40) as producer:
            count = WARMUP + case.requests
            if case.kind == "pull":
                producer.register_pools(_pools(case, device, fill=True))
                slots = torch.arange(case.tokens, device=device)
                for index in range(count):
                    await producer.publish(_request_tokens(index, case), slots)
            else:
                shape = (LAYERS, case.tokens, HEADS, DIM)
                for index in range(count):
                    key = torch.full(shape, float(index % 7), dtype=torch.bfloat16, device=device)
                    await producer.insert(_request_tokens(index, case), None, key, key)
            _synchronize(device)
            control.send(producer.endpoint)
            assert await asyncio.to_thread(control.recv) == "mark"
            assert await asyncio.to_thread(control.recv) == "done"
            control.send(0.0)
            await asyncio.to_thread(control.recv)

    asyncio.run(main())


def _kvrt_consumer(
    endpoint: str, case: Case, in_flight: int, device: str, control: multiprocessing.connection.Connection
) -> None:
    import kvrt

    torch.set_num_threads(1)

    async def main() -> None:
        async with kvrt.Consumer(connect=endpoint, device=device, transport="nixl") as consumer:
            assert consumer.transports == {endpoint: "nixl"}, consumer.transports
            target = _pools(case, device, fill=False) if case.kind == "pull" else None
            slots = _pull_slots(case, device)

            async def take(index: int) -> None:
                tokens = _request_tokens(index, case)
                if target is not None:
                    item = await consumer.pull(tokens, into=target, slots=slots)
                else:
                    item = await consumer.drop_select(tokens)
                _synchronize(device)
                assert item is not None and item.key.shape[1] == case.tokens

            for index in range(WARMUP):
                await take(index)
            control.send("ready")
            assert control.recv() == "go"
            latencies: list[float] = []
            wall = time.perf_counter()
            for index in range(WARMUP, WARMUP + case.requests):
                started = time.perf_counter()
                await take(index)
                latencies.append(time.perf_counter() - started)
            if target is not None:  # the last request landed where the pull was told
                assert float(target.pools[0][0][LAYERS - 1].flatten()[-1]) == float((LAYERS - 1) % 5)
            control.send(Timed(latencies, time.perf_counter() - wall, 0.0))

    asyncio.run(main())


# -- raw NIXL READs ----------------------------------------------------------------------------


def raw_nixl_server(item_bytes: int, device: str, control: multiprocessing.connection.Connection) -> None:
    """An agent with the bytes registered once (as kvrt's producer: a progress thread of its own)."""
    from kvrt.transports._nixl_agent import Agent

    torch.set_num_threads(1)
    agent = Agent("raw-nixl-server", progress_thread=True, thread_safe=False)
    payloads = [torch.full((item_bytes,), index, dtype=torch.uint8, device=device) for index in range(2)]
    _synchronize(device)
    registrations = [agent.register(p.data_ptr(), item_bytes, p.device) for p in payloads]
    control.send((agent.metadata(registrations[0], connection=True), [agent.metadata(r, connection=False)
                  for r in registrations], [p.data_ptr() for p in payloads]))  # fmt: skip
    assert control.recv() == "mark"
    started = time.process_time()
    assert control.recv() == "done"
    control.send(time.process_time() - started)
    control.recv()


def raw_nixl_client(
    endpoint: tuple[bytes, list[bytes], list[int]], item_bytes: int, requests: int, device: str,
    control: multiprocessing.connection.Connection,
) -> None:  # fmt: skip
    """An agent that READs the server's bytes into memory it registered once, one at a time:
    each READ made, posted, and asked after until done (as kvrt's consumer: no progress thread)."""
    from kvrt.transports._nixl_agent import Agent, TransferState

    torch.set_num_threads(1)
    connection, regions, addresses = endpoint
    agent = Agent("raw-nixl-client", progress_thread=False, thread_safe=False)
    remote = agent.load(connection)
    for region in regions:
        agent.load(region)
    landing = torch.empty(item_bytes, dtype=torch.uint8, device=device)
    agent.register(landing.data_ptr(), item_bytes, landing.device)

    def read(index: int) -> None:
        transfer = agent.read(remote, [(landing.data_ptr(), addresses[index % len(addresses)], item_bytes)],
                              local=landing.device, peer=landing.device)  # fmt: skip
        state = transfer.post()
        while state is TransferState.PENDING:
            state = transfer.state()
        transfer.release()
        _synchronize(device)
        assert state is TransferState.DONE

    for index in range(WARMUP):
        read(index)
    control.send("ready")
    assert control.recv() == "go"
    latencies: list[float] = []
    cpu_started, wall = time.process_time(), time.perf_counter()
    for index in range(requests):
        started = time.perf_counter()
        read(index)
        latencies.append(time.perf_counter() - started)
    control.send(Timed(latencies, time.perf_counter() - wall, time.process_time() - cpu_started))


def _raw_client(endpoint: Any, case: Case, in_flight: int, device: str, control: Any) -> None:
    raw_nixl_client(endpoint, case.item_bytes, case.requests, device, control)


# -- the run ------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    from kvrt.transports._nixl_agent import nixl_unavailable

    if nixl_unavailable() is not None:
        print(f"bench nixl: {nixl_unavailable()}", file=sys.stderr)
        return 2
    device = _device()
    rows: list[list[str]] = []
    record: list[dict[str, Any]] = []
    met_all = True
    for case in QUICK_CASES if args.quick else CASES:
        print(f"{case.label} on {device}: raw NIXL READs, then kvrt", file=sys.stderr, flush=True)
        raw = timed_pair(raw_nixl_server, (case.item_bytes, device), _raw_client, case, 1, (device,))
        ours = timed_pair(_kvrt_producer, (case, device), _kvrt_consumer, case, 1, (device,))
        raw_rate = case.item_bytes / (raw.p50_ms() / 1e3)
        ours_rate = case.item_bytes / (ours.p50_ms() / 1e3)
        ratio = ours_rate / raw_rate
        goal = case.item_bytes >= GOAL_FROM_BYTES
        met = ratio >= RATE_GOAL if goal else None
        met_all = met_all and met is not False
        rows.append([
            case.label, f"{raw.p50_ms():.3f} ms, {raw_rate / 1e9:.2f} GB/s",
            f"{ours.p50_ms():.3f} / {ours.p99_ms():.3f} ms, {ours_rate / 1e9:.2f} GB/s", f"{ratio:.0%}",
            f">= {RATE_GOAL:.0%}" if goal else "", "" if met is None else ("met" if met else "not met"),
        ])  # fmt: skip
        record.append({"case": asdict(case), "device": device, "raw_p50_ms": raw.p50_ms(),
                       "kvrt_p50_ms": ours.p50_ms(), "kvrt_p99_ms": ours.p99_ms(), "ratio": ratio})  # fmt: skip
    print(f"kvrt over nixl on {device}, one request at a time, beside raw NIXL READs of the same bytes")
    header = ["request", "raw NIXL READ p50, rate", "kvrt p50 / p99, rate", "kvrt vs raw", "goal", "met"]
    print(markdown_table(header, rows))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0 if met_all or args.quick else 1
