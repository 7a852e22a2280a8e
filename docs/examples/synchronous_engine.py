"""kvrt in a synchronous engine: plain threads, no asyncio in sight.

Run it with `python docs/examples/synchronous_engine.py`. A prefill thread inserts the KV of
the prompts it finished; four decode threads each wait for the KV of their own prompt;
closing the consumer ends the one call still waiting; the metrics land in a
prometheus-client registry, as an engine's /metrics would serve them. Then the same through
the drop-in for code written against vLLM's lookup buffer.
"""

from __future__ import annotations

import threading

import torch
from prometheus_client import CollectorRegistry, generate_latest

import kvrt
import kvrt.blocking
from kvrt.compat.vllm import KVLookupBuffer

LAYERS, HEADS, HEAD_DIM = 2, 4, 64
PROMPTS = [torch.arange(100 * n, 100 * n + 32) for n in range(4)]


def prefill(prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for the model's forward pass: K and V [layers, tokens, heads, head_dim]."""
    shape = (LAYERS, len(prompt), HEADS, HEAD_DIM)
    return torch.full(shape, float(prompt[0]), dtype=torch.float16), torch.zeros(shape, dtype=torch.float16)


def main() -> None:
    registry = CollectorRegistry()
    kvrt.register_metrics(registry)  # into the registry the engine serves: no second port

    with (
        kvrt.blocking.Producer(bind="tcp://127.0.0.1:0", buffer_bytes=64 << 20) as producer,
        kvrt.blocking.Consumer(connect=producer.endpoint, name="decode-0") as consumer,
    ):
        results: dict[int, str] = {}

        def decode(index: int) -> None:
            # Waits (timeout=None: until the prefill inserts it, or the consumer closes).
            item = consumer.drop_select(PROMPTS[index], None, timeout=None)
            assert item is not None
            results[index] = f"decode {index}: {item.matched} tokens, K starts {int(item.key[0, 0, 0, 0])}"

        decoders = [threading.Thread(target=decode, args=(index,)) for index in range(4)]
        for thread in decoders:
            thread.start()

        def prefill_engine() -> None:
            for prompt in PROMPTS:
                key, value = prefill(prompt)
                producer.insert(prompt, None, key, value)  # returns once buffered

        engine = threading.Thread(target=prefill_engine)
        engine.start()
        engine.join()
        for thread in decoders:
            thread.join()
        print("\n".join(results[index] for index in range(4)))

        # A call still waiting when the consumer closes ends with ClosedError, at once.
        outcome: list[str] = []

        def waits_for_ever() -> None:
            try:
                consumer.drop_select(torch.arange(9000, 9008), None, timeout=None)
            except kvrt.ClosedError:
                outcome.append("closed while waiting: ClosedError")

        waiting = threading.Thread(target=waits_for_ever)
        waiting.start()
        page = generate_latest(registry).decode()
        consumer.close()
        waiting.join()
        print(outcome[0])

    hits = next(line for line in page.splitlines() if line.startswith("kvrt_consumer_lookups_total") and "hit" in line)
    print("metrics:", hits.split("{")[0], "hit =", hits.rsplit(" ", 1)[1])

    # Code written against vLLM's KVLookupBufferBase (its SimpleBuffer), unchanged.
    with KVLookupBuffer("producer", 1e9) as prefill_side:
        with KVLookupBuffer("consumer", 1e9, endpoint=prefill_side.endpoint) as decode_side:
            tokens = torch.tensor([1, 2, 3])
            prefill_side.insert(tokens, tokens > 0, 2.0 * torch.ones(5, 6), 3.0 * torch.ones(5, 6), None)
            _, _, key, value, _ = decode_side.drop_select(tokens, tokens > 0)
            assert key is not None and value is not None
            print(f"drop-in: key {tuple(key.shape)} of {float(key[0, 0])}, value of {float(value[0, 0])}")
            print("drop-in miss:", decode_side.drop_select(tokens, tokens > 0))


if __name__ == "__main__":
    main()
