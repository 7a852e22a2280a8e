"""`make demo-vllm`: two `vllm serve` instances on this host, a prefill and a decode, with
KvrtConnector in both and kvrt's router in front; prompts through the router, their KV moved
by kvrt, against the decode instance computing them alone; a table of what each prompt's decode
computed and produced, and the connector's counters as vLLM exports them."""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kvrt.blocking
from tests.vllm.served import complete, connector_config, free_port, metrics, router, server

PROMPT_LENGTHS = (40, 70, 33, 100, 150, 64, 31, 200)


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="kvrt-vllm-demo-"))
    model = folder / "model"
    print(f"a tiny model with random weights in {model}", flush=True)
    subprocess.run([sys.executable, "-m", "tests.vllm.instance", "make-model", str(model)], check=True, timeout=120)
    generator = random.Random(1)
    prompts = [[generator.randrange(3, 500) for _ in range(length)] for length in PROMPT_LENGTHS]
    bind = f"tcp://127.0.0.1:{free_port()}"
    print("starting a prefill and a decode instance (vllm serve) and the router (about a minute)", flush=True)
    started = time.monotonic()
    with (
        server(model, folder, "prefill", transfer=connector_config("producer", bind=bind)) as prefill,
        server(model, folder, "decode", transfer=connector_config("consumer", lookup_timeout_s=30)) as decode,
        router([prefill.url], [decode.url], folder) as routed,
    ):
        print(f"ready in {time.monotonic() - started:.0f} s: prefill {prefill.url}, decode {decode.url}, "
              f"router {routed.url}", flush=True)  # fmt: skip
        through_kvrt = complete(routed.url, prompts, in_flight=4)
        alone = complete(decode.url, prompts, in_flight=4)
        counted = metrics(decode.url)  # after those: their steps carry the last loads' counts
        with kvrt.blocking.Client(bind) as client:
            held = client.stats().items
    print(f"\n{'prompt tokens':>13} {'same as decode alone':>21}  output tokens")
    for prompt, done, single in zip(prompts, through_kvrt, alone, strict=True):
        print(f"{len(prompt):>13} {'yes' if done == single else 'NO':>21}  {done}")
    print(f"\nthe decode instance loaded {counted.get('loads', 0):.0f} prompts through kvrt "
          f"({counted.get('loaded_tokens', 0):.0f} tokens; it computes each prompt's last token itself: its logits "
          f"give the first output token), {counted.get('failed_loads', 0):.0f} loads failed; "
          f"the producer holds {held} items after")  # fmt: skip
    print(f"logs in {folder}")


if __name__ == "__main__":
    main()
