"""Host time of the small CUDA-side calls a transfer makes on kvrt's event loop (a diagnostic).

python3 tools/host_costs.py      (one CUDA device; microseconds per call, best of 7 x 2000)
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from typing import Any

import torch

from kvrt._tensors import check_metas, pack, unpack_tensor, views_at


def per_call_us(call: Callable[[], Any], number: int = 2000) -> float:
    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e6


def _enter_and_leave(stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        pass


def main() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    stream = torch.cuda.Stream()
    key = torch.zeros(32, 128, 8, 128, dtype=torch.bfloat16, device=device)
    packed = pack([torch.arange(128, device=device), None, key, key, None], device)
    payload = torch.empty(16 * packed.storage.numel(), dtype=torch.uint8, device=device)
    cached = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    del cached
    event = torch.cuda.Event()
    event.record()
    typed: dict[torch.dtype, torch.Tensor] = {}
    results = {
        "torch.empty 1 GiB (cached)": lambda: torch.empty(1 << 30, dtype=torch.uint8, device=device),
        "with torch.cuda.stream(side)": lambda: _enter_and_leave(stream),
        "Event() + record on a side stream": lambda: torch.cuda.Event().record(stream),
        "side stream waits on an event": lambda: stream.wait_event(event),
        "tensor.record_stream(side)": lambda: payload.record_stream(stream),
        "current_device()": torch.cuda.current_device,
        "slice + view of a CUDA payload": lambda: payload[256:1024].view(torch.bfloat16),
        "as_strided of a CUDA tensor": lambda: key.as_strided((4, 4), (4, 1), 0),
        "check_metas, one item": lambda: check_metas(packed.metas, packed.storage.numel()),
        "views_at, one item (cache warm)": lambda: views_at(packed.metas, payload, at=0, typed=typed),
        "unpack_tensor, one item (own cache)": lambda: unpack_tensor(packed.metas, payload),
    }
    for name, call in results.items():
        print(f"{name:<40} {per_call_us(call):7.2f} us")


if __name__ == "__main__":
    main()
