"""`make demo-vllm`: a prefill and a decode vLLM instance on this host, prompts through both,
the KV through kvrt; a table of what each prompt's decode computed and produced."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.vllm.test_two_instances import INSTANCE_S, PROMPT_LENGTHS, free_endpoint, run_instance, wait_ready


def main() -> None:
    import random

    folder = Path(tempfile.mkdtemp(prefix="kvrt-vllm-demo-"))
    model = folder / "model"
    subprocess.run([sys.executable, "-m", "tests.vllm.instance", "make-model", str(model)], check=True, timeout=120)
    generator = random.Random(1)
    prompts = [[generator.randrange(3, 500) for _ in range(length)] for length in PROMPT_LENGTHS]
    endpoint = free_endpoint()
    (folder / "producer-in.json").write_text(json.dumps([{"prompt": prompt} for prompt in prompts]))
    print(f"prefill instance: kvrt producer at {endpoint}", flush=True)
    producer = subprocess.Popen(
        [sys.executable, "-m", "tests.vllm.instance", "run", "--model", str(model), "--role", "producer",
         "--bind", endpoint, "--max-tokens", "1", "--prompts", str(folder / "producer-in.json"),
         "--out", str(folder / "producer-out.json")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        if not wait_ready(producer):
            raise SystemExit("the prefill instance failed")
        prefilled = json.loads((folder / "producer-out.json").read_text())
        print("decode instance: loads each prompt's KV through kvrt", flush=True)
        requests = [{"prompt": p["prompt"], "kv_transfer_params": p["kv_transfer_params"]} for p in prefilled]
        decoded = run_instance(model, "consumer", requests, folder)
    finally:
        assert producer.stdin is not None
        producer.stdin.close()
        producer.wait(timeout=INSTANCE_S)
    print(f"{'prompt tokens':>13} {'computed by decode':>18}  output tokens")
    for done in decoded:
        computed = len(done["prompt"]) - done["num_cached_tokens"]
        print(f"{len(done['prompt']):>13} {computed:>18}  {done['tokens']}")


if __name__ == "__main__":
    main()
