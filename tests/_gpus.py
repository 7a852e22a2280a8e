"""Where the GPU tests put their two processes, and which transports they can run over.

The producer takes cuda:0 and the consumer cuda:1 when two GPUs are visible. With one GPU
both take cuda:0: CUDA IPC works between two processes on one device (NCCL does not: a
communicator needs a device per rank), so the tests of what cuda_ipc moves and how it fails
run on a one-GPU host too, and those over NCCL need two. NIXL (UCX's CUDA IPC between two
processes of one device) runs on one GPU as well, where `kvrt[nixl]` is installed: its cases
take a producer forced to nixl (`producer_transport`), which a producer offers only then.
"""

from __future__ import annotations

from typing import Final

import pytest
import torch

from kvrt.transports._nixl_agent import nixl_unavailable

PRODUCER_DEVICE: Final = "cuda:0"
CONSUMER_DEVICE: Final = "cuda:1" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cuda:0"

one_gpu = pytest.mark.gpu(count=1)
two_gpus = pytest.mark.gpu(count=2)

over_each_gpu_transport = pytest.mark.parametrize(
    "transport", [pytest.param("nccl", marks=two_gpus), pytest.param("cuda_ipc", marks=one_gpu)]
)
"""For what each transport must do alike wherever it runs: cuda_ipc's case runs on one GPU."""

needs_nixl = pytest.mark.skipif(nixl_unavailable() is not None, reason="NIXL is not installed (kvrt[nixl])")

over_each_gpu_item_transport = pytest.mark.parametrize(
    "transport",
    [
        pytest.param("nccl", marks=two_gpus),
        pytest.param("cuda_ipc", marks=one_gpu),
        pytest.param("nixl", marks=[one_gpu, needs_nixl]),
    ],
)
"""For what items and pulls must do alike over every GPU transport, NIXL's included."""


def producer_transport(transport: str) -> str | None:
    """The producer's `transport=` for a consumer that forces `transport`: every default
    (None), but nixl, which a producer offers only when forced."""
    return "nixl" if transport == "nixl" else None


over_each_gpu_transport_on_two_gpus = pytest.mark.parametrize("transport", ["nccl", "cuda_ipc"])
"""For what holds only with the consumer on a GPU of its own (overlap, timing): the module's
two-GPU mark applies."""
