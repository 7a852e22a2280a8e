"""Where the time of `kvrt bench nccl` goes at one item size: host and GPU timestamps of both sides.

python3 tools/nccl_timeline.py OUT_DIR [SIZE_MIB [LAYERS]]     (two CUDA devices; default 1024 32)

Runs the benchmark for one size with its producer and consumer patched to note, on the host's
monotonic clock: each item's send (called, posted) and its GPU completion on the send stream;
each Deliver's arrival, its receive posted, and its landing (GPU); the same for each batch of
the batched passes (its staging copy's end on the producer's GPU, its completion on the
consumer's loop; KVRT_BATCH sets the batch size); the start and end of each pass; the garbage
collector's passes over generations 1 and 2. GPU times are mapped to the host clock as in
`tools/pull_timeline.py`. KVRT_TIMELINE_HOST_ONLY=1 notes host times only, with kvrt's own
events left as they are. Last, for each side: the wall and the thread CPU time of each
transport call and of the NCCL calls inside it (medians): a wall well above the CPU time is
time spent waiting (for the GIL, a lock, a core), not working.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.connection
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pull_timeline import Clock, _TimedEvent, mark_control_messages, mark_waiter_wakes  # a sibling tool

OUT = Path(os.environ.get("KVRT_TIMELINE_OUT", "/tmp/kvrt-nccl-timeline"))


def _cases() -> tuple[tuple[int, int], ...]:
    size_mib, layers = os.environ.get("KVRT_TIMELINE_CASE", "1024 32").split()
    return ((int(size_mib), int(layers)),)


def _patch(device: str, side: str) -> Clock:
    from kvrt._bench import nccl
    from kvrt.transports.paired import PairedTransport

    nccl.CASES = _cases()  # type: ignore[misc]
    nccl.LATENCY_REQUESTS = 30  # type: ignore[misc]
    host_only = os.environ.get("KVRT_TIMELINE_HOST_ONLY") == "1"
    if not host_only:  # timing events cost more to record: KVRT_TIMELINE_HOST_ONLY=1 keeps kvrt's own
        torch.cuda.Event = _TimedEvent  # type: ignore[misc]
    clock = Clock(torch.device(device))
    count = [0]
    from kvrt._protocol import ProducerCore

    mark_control_messages(clock)
    _cost_group_calls(side)
    _mark_collections(clock)
    core_receive = ProducerCore.receive

    def timed_core_receive(self: Any, *args: Any) -> Any:
        out = core_receive(self, *args)
        clock.host_mark(f"core answered ({len(out)} messages)")
        return out

    ProducerCore.receive = timed_core_receive  # type: ignore[method-assign]
    if side == "producer":
        send = PairedTransport.send

        async def timed_send(self: Any, peer: bytes, item: Any) -> Any:
            index = count[0]
            count[0] += 1
            clock.host_mark(f"send {index} called")
            frames = await send(self, peer, item)
            clock.host_mark(f"send {index} posted")
            assert self._streams is not None
            if not host_only:
                done = _TimedEvent()
                done.record(self._streams[0])
                clock.gpu_mark(f"send {index} done (gpu)", done)
            return frames

        PairedTransport.send = timed_send  # type: ignore[method-assign]
        send_many = PairedTransport.send_many
        batches = [0]

        async def timed_send_many(self: Any, peer: bytes, message: Any, items: Any) -> Any:
            index = batches[0]
            batches[0] += 1
            clock.host_mark(f"batch {index} send called ({len(items)} items)")
            frames = await send_many(self, peer, message, items)
            clock.host_mark(f"batch {index} send posted")
            assert self._streams is not None
            if not host_only:
                copied = _TimedEvent()
                copied.record(self._streams[0])
                clock.gpu_mark(f"batch {index} staged (gpu)", copied)
            return frames

        PairedTransport.send_many = timed_send_many  # type: ignore[method-assign]
    else:
        receive = PairedTransport.receive
        consume = nccl._consume

        def timed_receive(self: Any, deliver: Any, frames: Any) -> Any:
            index = count[0]
            count[0] += 1
            clock.host_mark(f"deliver {index} arrives")
            arrival = receive(self, deliver, frames)
            clock.host_mark(f"receive {index} posted")
            for event in arrival.landed if not host_only else ():
                clock.gpu_mark(f"item {index} landed (gpu)", event)
            arrival.complete.add_done_callback(lambda _: clock.host_mark(f"item {index} completed"))
            return arrival

        async def timed_consume(consumer: Any, items: int, in_flight: int) -> float:
            clock.host_mark("drop_selects start")
            seconds = await consume(consumer, items, in_flight)
            clock.host_mark("drop_selects end")
            return seconds

        receive_many = PairedTransport.receive_many
        consume_batched = nccl._consume_batched
        batches = [0]

        def timed_receive_many(self: Any, message: Any, frames: Any) -> Any:
            index = batches[0]
            batches[0] += 1
            clock.host_mark(f"batch {index} header arrives")
            arriving = receive_many(self, message, frames)
            clock.host_mark(f"batch {index} receive posted")
            assert self._streams is not None
            if not host_only:
                landed = _TimedEvent()
                landed.record(self._streams[1])
                clock.gpu_mark(f"batch {index} landed (gpu)", landed)

            arriving.add_done_callback(lambda _: clock.host_mark(f"batch {index} completed"))
            return arriving

        async def timed_consume_batched(consumer: Any, items: int, batch: int) -> float:
            clock.host_mark("drop_selects start")
            seconds = await consume_batched(consumer, items, batch)
            clock.host_mark("drop_selects end")
            return seconds

        mark_waiter_wakes(clock)
        PairedTransport.receive = timed_receive  # type: ignore[method-assign]
        PairedTransport.receive_many = timed_receive_many  # type: ignore[method-assign]
        nccl._consume = timed_consume  # type: ignore[assignment]
        nccl._consume_batched = timed_consume_batched  # type: ignore[assignment]
    return clock


COSTS: dict[str, list[tuple[float, float]]] = {}
"""(wall, thread CPU) seconds of each call, by name."""


def _costed(name: str, call: Any) -> Any:
    def costed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return call(*args, **kwargs)
        finally:
            COSTS.setdefault(name, []).append((time.perf_counter() - wall, time.thread_time() - cpu))

    return costed


class _CostedGroup:
    """A pair's process group whose send and recv note their wall and thread CPU time."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self.send = _costed("group.send", group.send)
        self.recv = _costed("group.recv", group.recv)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


def _cost_group_calls(side: str) -> None:
    from kvrt.transports.paired import PairedTransport

    establish = PairedTransport._establish
    PairedTransport._establish = lambda self, *args: _CostedGroup(establish(self, *args))  # type: ignore[method-assign]
    if side == "producer":

        def costed_send(name: str, send: Any) -> Any:
            async def costed(self: Any, peer: bytes, *args: Any) -> Any:
                await self._pair_of(peer)  # established: what is left is the call's own cost
                return await _costed(name, lambda: _first_step(send(self, peer, *args)))()

            return costed

        PairedTransport.send = costed_send("transport.send", PairedTransport.send)  # type: ignore[method-assign]
        PairedTransport.send_many = costed_send("transport.send_many", PairedTransport.send_many)  # type: ignore[method-assign]
    else:
        PairedTransport.receive = _costed("transport.receive", PairedTransport.receive)  # type: ignore[method-assign]
        PairedTransport.receive_many = _costed("transport.receive_many", PairedTransport.receive_many)  # type: ignore[method-assign]
    # The pieces of a batch's handling, each side: where its host time goes.
    import kvrt._consumer as consumer_module
    import kvrt._messages as messages
    import kvrt.transports.paired as paired
    from kvrt._consumer import _Link
    from kvrt._protocol import ConsumerCore, ProducerCore

    for owner, name in (
        (PairedTransport, "_payload"),
        (PairedTransport, "_post"),
        (paired, "batch_views"),
        (paired, "check_metas"),
        (paired, "_pack_hits"),
        (paired, "_drop_finished"),
        (consumer_module, "query_bytes"),
        (_Link, "_batch_landed"),
        (_Link, "_on_deliver_many"),
        (ConsumerCore, "receive"),
        (ProducerCore, "receive"),
        (messages, "encode"),
        (messages, "decode"),
    ):
        setattr(owner, name, _costed(f"{getattr(owner, '__name__', owner)}.{name}", getattr(owner, name)))


def _mark_collections(clock: Clock) -> None:
    """Note the garbage collector's passes of generations 1 and 2 (each stops the process)."""
    import gc

    def noted(phase: str, info: dict[str, int]) -> None:
        if info["generation"] > 0:
            clock.host_mark(f"gc generation {info['generation']} {phase}")

    gc.callbacks.append(noted)


def _first_step(coroutine: Any) -> Any:
    """Run a coroutine that does not suspend (its pair is established) to its end, now."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        value = done.value

        async def result() -> Any:
            return value

        return result()
    raise RuntimeError("the transport call suspended: its pair was not established")


def cost_table(costs: dict[str, list[tuple[float, float]]]) -> str:
    lines = []
    for name, samples in sorted(costs.items()):
        walls = sorted(wall for wall, _ in samples)
        cpus = sorted(cpu for _, cpu in samples)
        lines.append(
            f"  {name:<24} {len(samples):5d} calls: wall p50 {1e6 * walls[len(walls) // 2]:7.1f} us, "
            f"p90 {1e6 * walls[9 * len(walls) // 10]:7.1f} us; thread CPU p50 {1e6 * cpus[len(cpus) // 2]:7.1f} us"
        )
    return "\n".join(lines)


def timeline_producer(store_port: int, control: multiprocessing.connection.Connection) -> None:
    from kvrt._bench import nccl

    torch.cuda.set_device(nccl.PRODUCER_DEVICE)
    clock = _patch(nccl.PRODUCER_DEVICE, "producer")
    try:
        nccl._producer(store_port, control)
    finally:
        (OUT / "timeline-producer.json").write_text(json.dumps(clock.resolve()))
        (OUT / "costs-producer.json").write_text(json.dumps(COSTS))


def main() -> int:
    global OUT
    OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    OUT.mkdir(parents=True, exist_ok=True)
    os.environ["KVRT_TIMELINE_OUT"] = str(OUT)  # the producer process inherits these
    size_mib, layers = (sys.argv[2:] + ["1024", "32"][len(sys.argv[2:]) :])[:2]
    os.environ["KVRT_TIMELINE_CASE"] = f"{size_mib} {layers}"
    from kvrt._bench import nccl

    torch.cuda.set_device(nccl.CONSUMER_DEVICE)
    clock = _patch(nccl.CONSUMER_DEVICE, "consumer")
    nccl._producer = timeline_producer  # type: ignore[assignment]
    result = nccl.main(argparse.Namespace(json=None, plot=None, in_flight=None, batch=os.environ.get("KVRT_BATCH")))
    marks = [("C " + name, at) for name, at in clock.resolve()]
    marks += [("P " + name, at) for name, at in json.loads((OUT / "timeline-producer.json").read_text())]
    marks.sort(key=lambda mark: mark[1])
    starts = [at for name, at in marks if name == "C drop_selects start"]
    for index, start in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else float("inf")
        print(f"\n-- pass {index}")
        for name, at in marks:
            if start - 0.002 <= at < end:
                print(f"  {1e3 * (at - start):8.2f} ms  {name}")
    print("\nhost cost of the transport's calls, consumer:")
    print(cost_table(COSTS))
    print("producer:")
    print(cost_table(json.loads((OUT / "costs-producer.json").read_text())))
    return result


if __name__ == "__main__":
    sys.exit(main())
