"""GPU-clock timestamps for benchmarks that span two GPUs: a one-thread kernel writes the
GPU's `%globaltimer` (nanoseconds) when the stream reaches it, and a ping-pong over NCCL
measures the offset between the two GPUs' clocks. So a time from an event on one GPU to an
event on the other is read with no host thread in it (a host thread that waits for a CUDA
event reads its clock tens of microseconds late when the interpreter lock is busy)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer


@triton.jit
def _stamp_kernel(out_ptr, index):  # type: ignore[no-untyped-def]
    tl.store(out_ptr + index, globaltimer())


class Stamps:
    """Slots for GPU timestamps on one device, written in stream order."""

    def __init__(self, device: str, slots: int) -> None:
        self.device = device
        self.values = torch.zeros(slots, dtype=torch.int64, device=device)

    def stamp(self, index: int) -> None:
        """Queue a timestamp into slot `index` on the current stream."""
        _stamp_kernel[(1,)](self.values, index)

    def read(self) -> list[int]:
        """The slots, once the device wrote them (waits for the device)."""
        torch.cuda.synchronize(self.device)
        values: list[int] = self.values.tolist()
        return values


CALIBRATION_ROUNDS = 32


def calibrate(group: Any, rank: int, device: str) -> int | None:
    """Rank 1's clock minus rank 0's, in ns (returned on rank 1; None on rank 0): rank 0 stamps,
    sends a byte, rank 1 stamps on its arrival and sends it back, rank 0 stamps the return;
    of CALIBRATION_ROUNDS, the round with the shortest round trip, its arrival taken to be at
    the round trip's middle."""
    flag = torch.ones(1, device=device)
    stamps = Stamps(device, 2 * CALIBRATION_ROUNDS)
    peer = 1 - rank
    for round_index in range(CALIBRATION_ROUNDS):
        marker = torch.ones(1, device=device)
        group.allreduce([marker]).wait()
        torch.cuda.synchronize(device)
        if rank == 0:
            stamps.stamp(2 * round_index)
            group.send([flag], peer, 0).wait()
            group.recv([flag], peer, 0).wait()
            stamps.stamp(2 * round_index + 1)
        else:
            group.recv([flag], peer, 0).wait()
            stamps.stamp(2 * round_index)
            group.send([flag], peer, 0).wait()
        torch.cuda.synchronize(device)
    mine = stamps.values
    torch.cuda.synchronize(device)
    if rank == 0:
        group.send([mine], peer, 0).wait()
        torch.cuda.synchronize(device)
        return None
    theirs = torch.empty_like(mine)
    group.recv([theirs], peer, 0).wait()
    sent, arrived = theirs.tolist(), mine.tolist()
    best = min(range(CALIBRATION_ROUNDS), key=lambda index: sent[2 * index + 1] - sent[2 * index])
    round_trip = sent[2 * best + 1] - sent[2 * best]
    return int(arrived[2 * best] - (sent[2 * best] + round_trip // 2))
