"""The embedded API in one file: a producer (prefill side) and a consumer (decode side).

Run it with `python docs/examples/embedded.py`. In a real deployment the two halves live in
different processes (or hosts); only `producer.endpoint` has to travel from one to the other.

With `--serve` the producer then stays up, holding a few prompts' KV, for the `kvrt` command
to look at from another shell (`kvrt stat`, `probe`, `list`, `evict`) until Ctrl-C (or for
`--serve SECONDS`); `--bind` names its address (default: a free port, printed).
"""

from __future__ import annotations

import argparse
import asyncio
import math

import torch

import kvrt

LAYERS, HEADS, HEAD_DIM, HIDDEN = 4, 8, 64, 512


def prefill(prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stand-in for the model: KV [layers, tokens, heads, head_dim] and hidden [tokens, hidden]."""
    tokens = len(prompt)
    key = torch.randn(LAYERS, tokens, HEADS, HEAD_DIM, dtype=torch.float16)
    value = torch.randn(LAYERS, tokens, HEADS, HEAD_DIM, dtype=torch.float16)
    hidden = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
    return key, value, hidden


async def main(bind: str, serve_s: float | None) -> None:
    async with kvrt.Producer(bind=bind, buffer_bytes=256 << 20) as producer:
        prompt = torch.arange(100, 164)  # 64 token ids
        key, value, hidden = prefill(prompt)
        await producer.insert(prompt, None, key, value, hidden)  # roi None: every token counts

        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            # The decode side asks with the tokens it was given: a prefix of the prompt matches.
            item = await consumer.drop_select(prompt[:48], None, timeout=0.0)
            assert item is not None and item.matched == 48
            assert torch.equal(item.key, key) and torch.equal(item.value, value)
            print(f"got KV for {len(item.input_tokens)} tokens, {item.matched} matched")

            # Nothing buffered for these tokens: wait up to 50 ms for a prefill to insert it.
            missing = await consumer.drop_select(torch.arange(5000, 5010), None, timeout=0.05)
            print("second lookup:", "miss" if missing is None else "hit")

            # Bad input is refused with a typed error that says what is wrong.
            try:
                await consumer.drop_select(torch.arange(4.0))
            except kvrt.InvalidInputError as error:
                print("refused:", error)

        if serve_s is not None:
            await serve(producer, serve_s)


async def serve(producer: kvrt.Producer, serve_s: float) -> None:
    """Hold three prompts' KV (tokens 200-263, 300-363, 400-463) and serve them for `serve_s`."""
    for first in (200, 300, 400):
        prompt = torch.arange(first, first + 64)
        key, value, hidden = prefill(prompt)
        await producer.insert(prompt, None, key, value, hidden)
    endpoint = producer.endpoint
    print(f"serving at {endpoint}, 3 items buffered; from another shell try:", flush=True)
    print(f"  kvrt stat {endpoint} --once", flush=True)
    print(f"  kvrt probe {endpoint} --tokens 200,201,202", flush=True)
    print(f"  kvrt list {endpoint}", flush=True)
    print("Ctrl-C stops it", flush=True)
    await asyncio.sleep(serve_s)  # until Ctrl-C (or the time given): the producer serves meanwhile


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", default="tcp://127.0.0.1:0", help="the producer's address (default: a free port)")
    parser.add_argument(
        "--serve", nargs="?", type=float, const=math.inf, metavar="SECONDS",
        help="then keep the producer up, holding three prompts' KV, until Ctrl-C (or for SECONDS)",
    )  # fmt: skip
    args = parser.parse_args()
    try:
        asyncio.run(main(args.bind, args.serve))
    except KeyboardInterrupt:
        print("stopped")
