"""`make demo-vllm`: a prefill and a decode vLLM instance on this host, prompts through both,
the KV through kvrt, against one instance alone; a table of what each prompt's decode
computed and produced."""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.vllm.test_two_instances import PROMPT_LENGTHS, run_instance, start_producer, stop


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="kvrt-vllm-demo-"))
    model = folder / "model"
    print(f"a tiny model with random weights in {model}", flush=True)
    subprocess.run([sys.executable, "-m", "tests.vllm.instance", "make-model", str(model)], check=True, timeout=120)
    generator = random.Random(1)
    prompts = [[generator.randrange(3, 500) for _ in range(length)] for length in PROMPT_LENGTHS]
    print("prefill instance: computes each prompt and publishes its KV through kvrt", flush=True)
    prefilled, producer = start_producer(model, prompts, folder, "producer-pages")
    try:
        print(f"decode instance: loads each prompt's KV from {prefilled[0]['kv_transfer_params']}", flush=True)
        requests = [{"prompt": p["prompt"], "kv_transfer_params": p["kv_transfer_params"]} for p in prefilled]
        decoded = run_instance(model, "consumer", requests, folder)
    finally:
        stop(producer)
    print("one instance alone, for comparison", flush=True)
    single = run_instance(model, "single", [{"prompt": prompt} for prompt in prompts], folder)
    print(f"\n{'prompt tokens':>13} {'computed by decode':>18} {'as one instance':>15}  output tokens")
    for done, alone in zip(decoded, single, strict=True):
        computed = len(done["prompt"]) - done["num_cached_tokens"]
        same = "yes" if done["tokens"] == alone["tokens"] else "NO"
        print(f"{len(done['prompt']):>13} {computed:>18} {same:>15}  {done['tokens']}")
    print("\n(the decode instance computes each prompt's last token itself: its logits give the first output token)")


if __name__ == "__main__":
    main()
