"""`kvrt bench ipc`: the cuda_ipc transport on two GPUs of one host, beside raw torch NCCL and a
plain peer copy (`copy_` from cuda:0 to cuda:1 in one process) of the same bytes, same run.

Two parts, each the matching NCCL benchmark run over `cuda_ipc` (see their docstrings for
how they time): contiguous items of 1 MiB to 1 GiB (`kvrt bench nccl`: goal >= 95% of the
peer copy at 1 GiB), and the paged 32k-token, 32-layer, 8-head, head_dim-128 bf16 request
from dp=4 pools into one pool (`kvrt bench pull`: goal >= 90% of the peer copy of its bytes).
A third part times the fused pool-to-pool kernel alone on the same request, in one process
(`fused`): what the paged path could reach if the pull used it (it does not yet).

On a host with one GPU it runs `kvrt._bench.ipc_one_gpu` instead: both processes on cuda:0,
beside two raw two-process IPC references (memory mapped once, a fresh mapping per item).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any, Final

import torch

from kvrt._bench import nccl, pull

ROUNDS: Final = 7


def main(args: argparse.Namespace) -> int:
    if torch.cuda.device_count() < 2:
        from kvrt._bench import ipc_one_gpu

        return ipc_one_gpu.main(args)
    over_ipc = copy.copy(args)
    over_ipc.transport = "cuda_ipc"
    json_path = getattr(args, "json", None)
    over_ipc.json = None if json_path is None else json_path.replace(".json", "-items.json")
    code = nccl.main(over_ipc)
    if code:
        return code
    over_ipc.json = None if json_path is None else json_path.replace(".json", "-paged.json")
    over_ipc.plot = None
    code = pull.main(over_ipc)
    if code:
        return code
    measured = fused()
    peer = measured["peer"]["best_s"]
    request = f"the same request ({pull.KV_BYTES >> 20} MiB)"
    print(f"fused pool-to-pool kernel alone, one process, {request}, best of {ROUNDS}:")
    for name, times in measured.items():
        label = "plain peer copy" if name == "peer" else f"move_between, {name}"
        rate = pull.KV_BYTES / times["best_s"] / 1e9
        print(f"  {label:<28} {times['best_s'] * 1e3:7.2f} ms (median {times['median_s'] * 1e3:7.2f})"
              f"  {rate:6.1f} GB/s  {peer / times['best_s']:5.0%} of the peer copy")  # fmt: skip
    if json_path is not None:
        with open(json_path.replace(".json", "-fused.json"), "w") as out:
            json.dump(measured, out, indent=2)
    return 0


def fused(rounds: int = ROUNDS) -> dict[str, Any]:
    """The fused kernel (`kvrt.kernels.pool_to_pool.move_between`) in one process: launched on
    cuda:0, it reads the pull benchmark's request from dp=4 pools there and writes it into one
    pool on cuda:1 over NVLink (peer access as torch's own cross-device copy enables it),
    beside a plain peer copy of the same bytes, in turns. Host-timed around synchronizes of
    both devices; best and median of `rounds`; one row per launch shape. The moved rows of
    the first and last layers are checked against the source."""
    from kvrt.kernels.paged_kv import Layout, PoolTable, Tuning
    from kvrt.kernels.pool_to_pool import move_between

    producer, consumer = torch.device(pull.PRODUCER_DEVICE), torch.device(pull.CONSUMER_DEVICE)
    torch.cuda.set_device(producer)
    src, replica, slots = pull.request_pools()
    dst = PoolTable(
        [[[torch.zeros((pull.TOKENS, 2 * pull.HEADS, pull.DIM), dtype=torch.bfloat16, device=consumer)
           for _ in range(pull.LAYERS)]]],
        Layout.TOKEN_MAJOR,
    )  # fmt: skip
    into = torch.randperm(pull.TOKENS, device=producer)
    source = torch.ones(pull.KV_BYTES, dtype=torch.uint8, device=producer)
    target = torch.empty(pull.KV_BYTES, dtype=torch.uint8, device=consumer)

    def timed(work: Any) -> float:
        for device in (producer, consumer):
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        work()
        for device in (producer, consumer):
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    def peer_copy() -> None:
        target.copy_(source, non_blocking=True)

    shapes = [Tuning(warps=warps) for warps in (4, 8, 16)]
    peer_copy()  # also enables cuda:0's access to cuda:1, as the kernel needs
    times: dict[str, list[float]] = {"peer": []}
    for tuning in shapes:  # compiled before the clock
        move_between(src, replica, slots, dst, 0, into, tuning=tuning)
    for _ in range(rounds):
        times["peer"].append(timed(peer_copy))
        for tuning in shapes:
            name = f"{tuning.warps} warps"
            times.setdefault(name, []).append(
                timed(lambda t=tuning: move_between(src, replica, slots, dst, 0, into, check=False, tuning=t))
            )
    for layer in (0, pull.LAYERS - 1):
        want = torch.empty((pull.TOKENS, 2 * pull.HEADS, pull.DIM), dtype=torch.bfloat16, device=producer)
        for r in range(pull.REPLICAS):
            chosen = (replica == r).nonzero().flatten()
            want[chosen] = src.pools[r][0][layer][slots[chosen]]
        got = dst.pools[0][0][layer][into.to(consumer)].to(producer)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            raise AssertionError(f"the fused kernel moved layer {layer} wrong")
    return {name: {"best_s": min(values), "median_s": statistics.median(values)} for name, values in times.items()}
