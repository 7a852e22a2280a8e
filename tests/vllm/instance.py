"""One vLLM instance in a process of its own, for the connector's end-to-end tests and
`make demo-vllm`: greedy decoding of the prompts in a JSON file, the outputs to another.

    python -m tests.vllm.instance make-model DIR
    python -m tests.vllm.instance run --model DIR --role single|producer|consumer --prompts IN --out OUT
        [--bind EP | --connect EP]

A producer prints "ready" once its outputs are written, then serves its KV until its standard
input closes. Each output: the prompt, its tokens, the request's kv_transfer_params and vLLM's
own per-request counter of prompt tokens it did not compute (`num_cached_tokens`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MAX_MODEL_LEN = 512
BLOCK_SIZE = 32


def make_model(folder: Path, arch: str = "opt") -> None:
    """A tiny model with random weights (head_dim 64, as vLLM's CPU attention needs), saved once
    so that every instance loads the same weights: an OPT (2 heads, each its own KV head) or a
    Llama with grouped KV heads (4 query heads sharing 2 KV heads). Its weights are large
    enough that the greedy tokens depend on every token of the context."""
    import torch
    import transformers

    torch.manual_seed(0)
    if arch == "llama":
        llama = transformers.LlamaConfig(
            vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN, initializer_range=0.2, bos_token_id=2,
            eos_token_id=2, pad_token_id=1, tie_word_embeddings=False,
        )  # fmt: skip
        transformers.LlamaForCausalLM(llama).save_pretrained(folder)
        return
    config = transformers.OPTConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=3, ffn_dim=256, num_attention_heads=2,
        max_position_embeddings=MAX_MODEL_LEN, word_embed_proj_dim=128, init_std=0.2, bos_token_id=2,
        eos_token_id=2, pad_token_id=1,
    )  # fmt: skip
    transformers.OPTForCausalLM(config).save_pretrained(folder)


def run(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = None
    connector = {"kv_connector": "KvrtConnector", "kv_connector_module_path": "kvrt.integrations.vllm"}
    extra: dict[str, Any] = {}
    if args.record:
        connector = {"kv_connector": "RecordingKvrtConnector", "kv_connector_module_path": "tests.vllm.recording"}
        extra = {"record": args.record}
    if args.role == "producer":
        transfer = KVTransferConfig(
            **connector, kv_role="kv_producer", kv_connector_extra_config={"bind": args.bind, **extra}
        )
    elif args.role == "consumer":
        transfer = KVTransferConfig(
            **connector, kv_role="kv_consumer", kv_load_failure_policy="recompute",
            kv_connector_extra_config={**({"connect": args.connect} if args.connect else {}), **extra},
        )  # fmt: skip
    llm = LLM(
        model=args.model, skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE, enforce_eager=True, max_num_seqs=4, kv_cache_memory_bytes=64 << 20,
        kv_transfer_config=transfer, seed=0,
    )  # fmt: skip
    requests: list[dict[str, Any]] = json.loads(Path(args.prompts).read_text())
    prompts = [{"prompt_token_ids": request["prompt"]} for request in requests]
    params = []
    for request in requests:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        # A prefill's requests ask for a remote decode, as a router's do.
        asked = request.get("kv_transfer_params") or ({"do_remote_decode": True} if args.role == "producer" else None)
        sampling.extra_args = {"kv_transfer_params": asked}
        params.append(sampling)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    results = [
        {
            "prompt": list(output.prompt_token_ids or []),
            "tokens": list(output.outputs[0].token_ids),
            "kv_transfer_params": output.kv_transfer_params,
            "num_cached_tokens": output.num_cached_tokens,
        }
        for output in outputs
    ]
    Path(args.out).write_text(json.dumps(results))
    print("ready", flush=True)
    if args.role == "producer":
        sys.stdin.read()  # serve the KV until the test closes our standard input


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-model")
    make.add_argument("folder", type=Path)
    make.add_argument("--arch", choices=["opt", "llama"], default="opt")
    run_parser = sub.add_parser("run")
    run_parser.add_argument("--model", required=True)
    run_parser.add_argument("--role", choices=["single", "producer", "consumer"], required=True)
    run_parser.add_argument("--prompts", required=True)
    run_parser.add_argument("--out", required=True)
    run_parser.add_argument("--bind")
    run_parser.add_argument("--connect")
    run_parser.add_argument("--max-tokens", type=int, default=8)
    run_parser.add_argument("--record", help="write the pages the connector moved into this folder")
    args = parser.parse_args()
    if args.command == "make-model":
        make_model(args.folder, args.arch)
    else:
        run(args)


if __name__ == "__main__":
    main()
