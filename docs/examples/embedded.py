"""The embedded API in one file: a producer (prefill side) and a consumer (decode side).

Run it with `python docs/examples/embedded.py`. In a real deployment the two halves live in
different processes (or hosts); only `producer.endpoint` has to travel from one to the other.
"""

from __future__ import annotations

import asyncio

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


async def main() -> None:
    async with kvrt.Producer(bind="tcp://127.0.0.1:0", buffer_bytes=256 << 20) as producer:
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


if __name__ == "__main__":
    asyncio.run(main())
