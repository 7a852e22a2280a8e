"""Does a copy-engine peer copy (cuda:0 -> cuda:1) run while a matmul holds every SM of cuda:0,
where a kernel (NCCL's send is one) waits for the matmul's end? A diagnostic for issue 9 (a
same-host transport on the copy engines), not a record. On a host with two GPUs:
`python3 tools/copy_engine_probe.py`. Each line: the work alone, the same work queued on a
high-priority stream while a 4.5 ms matmul runs (start to end on its stream), and the
matmul's time alone and with it (medians of 5)."""

import torch

torch.cuda.set_device(0)
a = torch.randn(8192, 4096, device="cuda:0", dtype=torch.bfloat16)
w = torch.randn(4096, 53248, device="cuda:0", dtype=torch.bfloat16)
src = torch.ones(32 << 20, dtype=torch.uint8, device="cuda:0")
dst = torch.empty(32 << 20, dtype=torch.uint8, device="cuda:1")
side = torch.cuda.Stream(device="cuda:0", priority=-1)
kernel_src = torch.ones(16 << 20, dtype=torch.bfloat16, device="cuda:0")
for _ in range(3):
    a @ w
    dst.copy_(src)
torch.cuda.synchronize()


def timed(fn, stream):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    with torch.cuda.stream(stream):
        fn()
    end.record(stream)
    return start, end


for label, work in (
    ("CE peer copy 32 MiB", lambda: dst.copy_(src, non_blocking=True)),
    ("kernel (x * 2) 32 MiB", lambda: kernel_src.mul_(1.0)),
):
    alone = []
    during = []
    matmul_alone = []
    matmul_with = []
    for _ in range(5):
        torch.cuda.synchronize()
        s, e = timed(work, side)
        torch.cuda.synchronize()
        alone.append(s.elapsed_time(e))
        s0, e0 = timed(lambda: a @ w, torch.cuda.current_stream())
        torch.cuda.synchronize()
        matmul_alone.append(s0.elapsed_time(e0))
        m0, m1 = timed(lambda: (a @ w, a @ w), torch.cuda.current_stream())
        s, e = timed(work, side)  # queued while the first matmul runs
        torch.cuda.synchronize()
        during.append(s.elapsed_time(e))
        matmul_with.append(m0.elapsed_time(m1) / 2)
        # when did the side work end relative to the matmul's end?
    print(
        f"{label}: alone {sorted(alone)[2] * 1e3:.0f} us; queued during a 4.5 ms matmul: "
        f"{sorted(during)[2] * 1e3:.0f} us (start to end on its stream); matmul alone "
        f"{sorted(matmul_alone)[2]:.3f} ms, with it {sorted(matmul_with)[2]:.3f} ms"
    )
