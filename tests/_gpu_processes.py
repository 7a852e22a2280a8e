"""Programs the GPU tests start in their own processes (importable by `spawn`)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.connection
from typing import Any

import torch

import kvrt


def kv_tokens(index: int, tokens: int, device: str = "cpu") -> torch.Tensor:
    """The tokens of item `index` (cheap: no KV generated)."""
    return torch.arange(tokens, device=device) + 1_000_000 * index


def kv_item(index: int, tokens: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """Tokens, key, value, hidden of item `index`, generated on `device` from a seed."""
    generator = torch.Generator(device=device).manual_seed(index)
    input_tokens = kv_tokens(index, tokens, device)
    shape = (2, tokens, 8, 128)
    if dtype.is_floating_point and dtype.itemsize > 1:
        key = torch.randn(shape, generator=generator, device=device).to(dtype)
        value = torch.randn(shape, generator=generator, device=device).to(dtype)
    else:
        key = torch.randint(0, 2 if dtype == torch.bool else 127, shape, generator=generator, device=device).to(dtype)
        value = torch.randint(0, 2 if dtype == torch.bool else 127, shape, generator=generator, device=device).to(dtype)
    hidden = torch.randn((tokens, 64), generator=generator, device=device)
    return input_tokens, key, value, hidden


def run_gpu_producer(
    device: str, transport: str | None, heartbeat_s: float, items: list[tuple[int, int, str]],
    control: multiprocessing.connection.Connection,
) -> None:  # fmt: skip
    """Insert `items` (index, tokens, dtype name) on `device`, send the endpoint, serve until told to stop."""

    async def main() -> None:
        async with kvrt.Producer(
            device=device, transport=transport, heartbeat_s=heartbeat_s, buffer_bytes=1 << 40
        ) as producer:
            for index, tokens, dtype_name in items:
                input_tokens, key, value, hidden = kv_item(index, tokens, getattr(torch, dtype_name), device)
                await producer.insert(input_tokens, None, key, value, hidden)
            control.send(producer.endpoint)
            while True:
                command: Any = await asyncio.to_thread(_receive, control)
                if command is None or command == "stop":
                    return
                if command == "stats":
                    stats = producer.stats()
                    control.send((stats.items, stats.in_flight, stats.peers))

    asyncio.run(main())


def _receive(control: multiprocessing.connection.Connection) -> Any:
    with contextlib.suppress(EOFError):
        return control.recv()
    return None


def run_gpu_consumer_that_dies(
    endpoint: str, device: str, heartbeat_s: float, tokens: list[int],
    control: multiprocessing.connection.Connection,
) -> None:  # fmt: skip
    """Ask for an item and never confirm it: the parent kills this process mid-transfer."""
    from kvrt import _messages as m

    async def main() -> None:
        async with kvrt.Consumer(connect=endpoint, device=device, heartbeat_s=heartbeat_s) as consumer:
            query = m.tokens_to_bytes(torch.tensor(tokens).numpy())
            request = asyncio.create_task(
                consumer._links[0].call(
                    lambda request_id: m.DropSelect(request_id=request_id, tokens=query, timeout_s=None),
                    confirm=False,
                )
            )
            await asyncio.sleep(0)  # the request is on the wire once the task ran this far
            control.send("asked")
            await request
            control.send("arrived")
            await asyncio.to_thread(_receive, control)

    asyncio.run(main())
