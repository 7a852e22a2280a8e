"""Programs the process tests start in their own interpreters (importable by `spawn`)."""

from __future__ import annotations

import asyncio
import multiprocessing.connection

import torch

import kvrt


def item_tensors(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    tokens = torch.arange(32, dtype=torch.int64) + 1000 * index
    key = torch.randn((2, 32, 4, 16), generator=generator).to(torch.float16)
    value = torch.randn((2, 32, 4, 16), generator=generator).to(torch.bfloat16)
    hidden = torch.randn((32, 64), generator=generator)
    return tokens, key, value, hidden


def _wait_for_stop(control: multiprocessing.connection.Connection) -> None:
    try:
        control.recv()
    except EOFError:
        pass


def run_producer(items: int, heartbeat_s: float, control: multiprocessing.connection.Connection) -> None:
    """Insert `items` items, send the endpoint on `control`, then serve until `control` says stop or closes.

    A pipe, not a multiprocessing Event: a process killed while waiting on an Event leaves
    its condition variable waiting for a sleeper that will never wake.
    """

    async def main() -> None:
        async with kvrt.Producer(heartbeat_s=heartbeat_s) as producer:
            for index in range(items):
                tokens, key, value, hidden = item_tensors(index)
                await producer.insert(tokens, None, key, value, hidden)
            control.send(producer.endpoint)
            await asyncio.to_thread(_wait_for_stop, control)

    asyncio.run(main())
