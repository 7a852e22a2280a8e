"""`kvrt bench ipc`: the cuda_ipc transport on two GPUs of one host, beside raw torch NCCL and a
plain peer copy (`copy_` from cuda:0 to cuda:1 in one process) of the same bytes, same run.

Two parts, each the matching NCCL benchmark run over `cuda_ipc` (see their docstrings for
how they time): contiguous items of 1 MiB to 1 GiB (`kvrt bench nccl`: goal >= 95% of the
peer copy at 1 GiB), and the paged 32k-token, 32-layer, 8-head, head_dim-128 bf16 request
from dp=4 pools into one pool (`kvrt bench pull`: goal >= 90% of the peer copy of its bytes).
"""

from __future__ import annotations

import argparse
import copy

from kvrt._bench import nccl, pull


def main(args: argparse.Namespace) -> int:
    over_ipc = copy.copy(args)
    over_ipc.transport = "cuda_ipc"
    json_path = getattr(args, "json", None)
    over_ipc.json = None if json_path is None else json_path.replace(".json", "-items.json")
    code = nccl.main(over_ipc)
    if code:
        return code
    over_ipc.json = None if json_path is None else json_path.replace(".json", "-paged.json")
    over_ipc.plot = None
    return pull.main(over_ipc)
