"""One side of a release-skew test, in the API every release since 0.2 offers: run by the
test's kvrt in its own process, and as a program by the last release's kvrt
(`python -P tests/_release_peer.py produce | take ENDPOINT`, see `tests/test_release_skew.py`).

`produce` buffers the same items and one stream every time; `take` takes all of them in each
of the ways a decode instance does (one at a time, a batch, a piece of the heads, a stream), and
reports a digest of what came, which the test compares with `expected()`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from typing import Any

import torch

import kvrt

SINGLE = (0, 1)
"""Items taken one `drop_select` at a time."""
BATCH = (2, 3)
"""Items taken by one `drop_select_many` (with a query that finds nothing between them)."""
PIECE = 4
"""The item taken as a piece: heads [1, 3) of its 4."""
HEADS = slice(1, 3)
STREAMED = 5
"""Tokens of the stream (its layers put one by one)."""
LAYERS = 2


def tokens_of(index: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.int64) + 1000 * index


def item_tensors(index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    key = torch.randn((LAYERS, 24, 4, 8), generator=generator).to(torch.float16)
    value = torch.randn((LAYERS, 24, 4, 8), generator=generator).to(torch.bfloat16)
    hidden = torch.randn((24, 16), generator=generator)
    return tokens_of(index), key, value, hidden


def digest(*tensors: torch.Tensor | None) -> list[str]:
    """Per tensor: dtype, shape and a hash of its bytes."""
    out = []
    for tensor in tensors:
        if tensor is None:
            out.append("none")
            continue
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        out.append(f"{tensor.dtype}{list(tensor.shape)}:{hashlib.sha256(data).hexdigest()[:16]}")
    return out


def expected() -> dict[str, list[str]]:
    """What `take` must report."""
    report = {}
    for index in (*SINGLE, *BATCH):
        tokens, key, value, hidden = item_tensors(index)
        report[str(index)] = digest(tokens, key, value, hidden)
    tokens, key, value, hidden = item_tensors(PIECE)
    report[str(PIECE)] = digest(tokens, key[:, :, HEADS], value[:, :, HEADS], hidden)
    tokens, key, value, hidden = item_tensors(STREAMED)
    report["stream"] = [*digest(*key.unbind(0)), *digest(*value.unbind(0)), *digest(hidden)]
    report["miss"] = ["none"]
    return report


async def produce(producer: kvrt.Producer) -> None:
    """Buffer every item `take` asks for, and a stream whose layers are all put."""
    for index in (*SINGLE, *BATCH, PIECE):
        await producer.insert(*_with_no_roi(item_tensors(index)))
    tokens, key, value, hidden = item_tensors(STREAMED)
    stream = await producer.open_stream(tokens, layers=LAYERS)
    for layer in range(LAYERS):
        await stream.put_layer(key[layer], value[layer])
    await stream.finish(hidden)


def _with_no_roi(
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, key, value, hidden = tensors
    return tokens, None, key, value, hidden


async def take(consumer: kvrt.Consumer) -> dict[str, list[str]]:
    """Take everything `produce` buffered; a digest of each."""
    report: dict[str, list[str]] = {}
    for index in SINGLE:
        item = await consumer.drop_select(tokens_of(index), timeout=10.0)
        assert item is not None, f"item {index} was not found"
        report[str(index)] = digest(item.input_tokens, item.key, item.value, item.hidden)
    first, missing, second = await consumer.drop_select_many([tokens_of(BATCH[0]), tokens_of(99), tokens_of(BATCH[1])])
    assert first is not None and second is not None, "a batch's item was not found"
    report[str(BATCH[0])] = digest(first.input_tokens, first.key, first.value, first.hidden)
    report[str(BATCH[1])] = digest(second.input_tokens, second.key, second.value, second.hidden)
    report["miss"] = digest(None if missing is None else missing.input_tokens)
    piece = await consumer.drop_select(tokens_of(PIECE), timeout=10.0, heads=HEADS)
    assert piece is not None, "the piece was not found"
    report[str(PIECE)] = digest(piece.input_tokens, piece.key, piece.value, piece.hidden)
    reader = await consumer.open_stream(tokens_of(STREAMED), timeout=10.0)
    assert reader is not None, "the stream was not found"
    keys, values = [], []
    async for _, key, value in reader:
        keys.append(key)
        values.append(value)
    report["stream"] = [*digest(*keys), *digest(*values), *digest(await reader.finished())]
    return report


def whoami() -> dict[str, Any]:
    return {"release": kvrt.__version__, "protocol": kvrt.PROTOCOL_VERSION, "module": kvrt.__file__}


async def _produce_until_stdin_closes() -> None:
    async with kvrt.Producer(bind="tcp://127.0.0.1:0") as producer:
        await produce(producer)
        print(json.dumps({**whoami(), "endpoint": producer.endpoint}), flush=True)
        await asyncio.to_thread(sys.stdin.read)


async def _take_from(endpoint: str) -> None:
    async with kvrt.Consumer(connect=endpoint) as consumer:
        report = await take(consumer)
    print(json.dumps({**whoami(), "report": report}), flush=True)


def main(argv: list[str]) -> None:
    match argv:
        case ["produce"]:
            asyncio.run(_produce_until_stdin_closes())
        case ["take", endpoint]:
            asyncio.run(_take_from(endpoint))
        case _:
            raise SystemExit("usage: _release_peer.py produce | take ENDPOINT")


if __name__ == "__main__":
    main(sys.argv[1:])
