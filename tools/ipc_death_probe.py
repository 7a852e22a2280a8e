"""Two questions for the next cuda_ipc design (a diagnostic; two CUDA devices):
1. can a consumer still read (and stay healthy) through an open IPC mapping once its exporter died?
2. can a stream wait on a host word (cuStreamWaitValue64) that the host then releases, and how fast?

    python3 tools/ipc_death_probe.py

On 2x H200 (2026-11-30): 1. yes, the bytes read back right and the device stayed healthy;
2. yes, ~18 us from the host's write to the event seen past the wait.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import time

import torch

spawn = multiprocessing.get_context("spawn")
MIB = 1 << 20


def exporter(control: object) -> None:
    torch.cuda.set_device(0)
    tensor = torch.full((64 * MIB,), 7, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    control.send(tensor.untyped_storage()._share_cuda_())  # type: ignore[attr-defined]
    control.recv()


def main() -> int:
    torch.cuda.set_device(1)
    control, child = spawn.Pipe()
    process = spawn.Process(target=exporter, args=(child,))
    process.start()
    shared = control.recv()
    _, handle, nbytes, offset, *_ = shared
    storage = torch.UntypedStorage._new_shared_cuda(1, handle, nbytes, offset, b"", 0, b"", False)
    source = torch.empty(0, dtype=torch.uint8, device="cuda:1").set_(storage)
    target = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda:1")
    target.copy_(source[: 64 * MIB])
    torch.cuda.synchronize()
    print("before death: read", int(target[:4].sum()), "(28 expected)")
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    time.sleep(1.0)
    try:
        target.zero_()
        target.copy_(source[: 64 * MIB])
        torch.cuda.synchronize()
        print("after death: read", int(target[:4].sum()), "sum ok:", bool((target == 7).all()))
        small = torch.ones(4, device="cuda:1")
        print("after death: device healthy:", float(small.sum()))
    except RuntimeError as error:
        print("after death: error", str(error)[:300])
    # 2. stream wait on a host word.
    cuda = ctypes.CDLL("libcuda.so.1")
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    address = flag.data_ptr()
    stream = torch.cuda.Stream(device="cuda:1")
    fn = cuda.cuStreamWaitValue64_v2 if hasattr(cuda, "cuStreamWaitValue64_v2") else cuda.cuStreamWaitValue64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    latencies = []
    for round_ in range(20):
        result = fn(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(address), ctypes.c_uint64(round_ + 1), 0)
        if result != 0:
            print("cuStreamWaitValue64 returned", result)
            break
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            target[:1024].fill_(round_)
            done.record(stream)
        time.sleep(0.01)
        waited = not done.query()
        started = time.perf_counter()
        ctypes.c_int64.from_address(address).value = round_ + 1
        while not done.query():
            pass
        latencies.append(time.perf_counter() - started)
        if round_ == 0:
            print("stream waited for the host word:", waited)
    if latencies:
        latencies.sort()
        p50, worst = 1e6 * latencies[len(latencies) // 2], 1e6 * latencies[-1]
        print(f"host write -> stream past the wait -> event seen: p50 {p50:.1f} us, max {worst:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
