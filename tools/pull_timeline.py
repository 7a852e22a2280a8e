"""Where the time of `kvrt bench pull` goes: host and GPU timestamps of one pull per chunk size.

python3 tools/pull_timeline.py OUT_DIR [nccl|cuda_ipc]   (two CUDA devices; writes OUT_DIR/timeline-*.json)

Runs the benchmark with its producer and consumer patched to note, on the host's monotonic
clock: the publish's start, each gather chunk's launch and GPU completion, the send's
enqueue; the Deliver's arrival, each segment's landing (GPU), each scatter's completion
(GPU), and the pull's return. GPU times are mapped to the host clock through an anchor
event recorded on an idle stream.
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

OUT = Path(os.environ.get("KVRT_TIMELINE_OUT", "/tmp/kvrt-timeline"))
TRANSPORT = os.environ.get("KVRT_TIMELINE_TRANSPORT", "nccl")
"""The transport the pull is forced onto (the producer process inherits it)."""


def _transport_class() -> Any:
    if TRANSPORT == "cuda_ipc":
        from kvrt.transports.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport
    from kvrt.transports.paired import PairedTransport

    return PairedTransport


class _TimedEvent(torch.cuda.Event):
    def __new__(cls, enable_timing: bool = True, blocking: bool = False, interprocess: bool = False) -> Any:
        return super().__new__(cls, enable_timing=True, blocking=blocking, interprocess=interprocess)


class Clock:
    """GPU events of one device mapped to host time."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.anchor = _TimedEvent()
        self.anchor.record(self.stream)
        self.anchor.synchronize()
        self.host = time.perf_counter()
        self.pending: list[tuple[str, torch.cuda.Event]] = []
        self.marks: list[tuple[str, float]] = []

    def host_mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def gpu_mark(self, name: str, event: torch.cuda.Event) -> None:
        self.pending.append((name, event))

    def resolve(self) -> list[tuple[str, float]]:
        for name, event in self.pending:
            event.synchronize()
            self.marks.append((name, self.host + self.anchor.elapsed_time(event) / 1e3))
        self.pending.clear()
        marks, self.marks = sorted(self.marks, key=lambda mark: mark[1]), []
        return marks


def mark_control_messages(clock: Clock) -> None:
    """Note every control message this process sends, and every first one a wait reads."""
    from kvrt._zmqio import SocketIO

    socket_send, socket_next = SocketIO.send, SocketIO.next

    async def timed_socket_send(self: Any, frames: Any, deadline: float | None = None) -> bool:
        sent = await socket_send(self, frames, deadline)
        clock.host_mark(f"control message sent ({len(frames)} frames)")
        return sent

    async def timed_socket_next(self: Any, deadline: float | None) -> Any:
        frames = await socket_next(self, deadline)
        clock.host_mark(f"control message read ({len(frames or ())} frames)")
        return frames

    SocketIO.send = timed_socket_send  # type: ignore[method-assign]
    SocketIO.next = timed_socket_next  # type: ignore[method-assign]


def mark_waiter_wakes(clock: Clock) -> None:
    """Note when kvrt's waiter thread returns from each blocking wait (a transfer's landing
    seen by the host), before it hands the outcome to the loop."""
    from kvrt._threads import Waiter

    wait = Waiter.wait

    def timed_wait(self: Any, blocking: Any, result: Any = None) -> Any:
        def marked() -> None:
            blocking()
            clock.host_mark("waiter woke")

        return wait(self, marked, result)

    Waiter.wait = timed_wait  # type: ignore[method-assign,assignment]


def note_allocations(clock: Clock, device: str) -> None:
    """Note the caching allocator's device allocations so far (cudaMalloc and cudaFree calls,
    and retries after freeing its cache), after a round: ~0.25 ms, outside the timed path."""
    stats = torch.cuda.memory_stats(device)
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries")
    counts = ", ".join(f"{key} {stats.get(key, 0)}" for key in keys)
    clock.host_mark(f"allocator so far: {counts}")


def _patch(device: str, side: str) -> Clock:
    import kvrt._producer as producer_module
    import kvrt.kernels.paged_kv as kernels

    PairedTransport = _transport_class()  # the class the timeline patches: nccl's or cuda_ipc's
    torch.cuda.Event = _TimedEvent  # type: ignore[misc]  # every event kvrt makes can be timed
    clock = Clock(torch.device(device))
    mark_control_messages(clock)

    def marked(function: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            clock.host_mark(f"{name} called")
            result = function(*args, **kwargs)
            clock.host_mark(f"{name} returns")
            return result

        return call

    if side == "producer":
        publish = producer_module.Producer.publish
        send = PairedTransport.send
        launch = kernels.PreparedGather.launch

        async def timed_publish(self: Any, *args: Any, **kwargs: Any) -> None:
            clock.host_mark("publish starts")
            await publish(self, *args, **kwargs)
            clock.host_mark("publish returns")

        def timed_launch(self: Any) -> None:
            clock.host_mark("gather launch called")
            launch(self)
            clock.host_mark("gather queued")

        for name in ("masked_tokens", "layer_segments", "check_tokens"):
            setattr(producer_module, name, marked(getattr(producer_module, name), name))
        lookup_key_and = marked(producer_module._lookup_key_and, "read back queued")
        producer_module._lookup_key_and = lambda *args: marked(lookup_key_and(*args), "read back waited")
        kernels.check_indices = marked(kernels.check_indices, "check_indices")
        producer_module.pack_empty = marked(producer_module.pack_empty, "pack_empty")
        kernels.per_token = marked(kernels.per_token, "per_token")

        async def timed_send(self: Any, peer: bytes, item: Any) -> Any:
            clock.host_mark("send starts")
            frames = await send(self, peer, item)
            clock.host_mark(f"{len(item.segments or [0])} sends queued")
            for index, event in enumerate(dict.fromkeys(item.segment_ready)):
                clock.gpu_mark(f"gather {index} done (gpu)", event)
            return frames

        producer_module.Producer.publish = timed_publish  # type: ignore[method-assign]
        kernels.PreparedGather.launch = timed_launch  # type: ignore[method-assign]
        for method in ("_reclaim", "_wait_for_room", "_buffer"):
            original = getattr(producer_module.Producer, method)
            if method == "_reclaim":
                setattr(producer_module.Producer, method, lambda self, f=original: marked(f, "_reclaim")(self))
            else:

                async def timed(self: Any, *args: Any, f: Any = original, name: str = method) -> Any:
                    clock.host_mark(f"{name} called")
                    result = await f(self, *args)
                    clock.host_mark(f"{name} returns")
                    return result

                setattr(producer_module.Producer, method, timed)
        PairedTransport.send = timed_send  # type: ignore[method-assign]
        producer_module._Gathers.prepare = marked(producer_module._Gathers.prepare, "gathers planned")  # type: ignore[method-assign]
        from kvrt._protocol import ProducerCore

        ProducerCore.insert = marked(ProducerCore.insert, "ProducerCore.insert")  # type: ignore[method-assign]
        PairedTransport.prepare = marked(PairedTransport.prepare, "transport.prepare")  # type: ignore[method-assign]
        producer_module.m.encode = marked(producer_module.m.encode, "encode")
    else:
        receive = PairedTransport.receive
        scatter_from = kernels.scatter_from

        def timed_receive(self: Any, deliver: Any, frames: Any) -> Any:
            # No memory_stats() around it (it would count the allocations): ~0.25 ms each.
            clock.host_mark("deliver arrives")
            arrival = receive(self, deliver, frames)
            clock.host_mark(f"{len(arrival.landed)} receives posted")
            for index, event in enumerate(arrival.landed):
                clock.gpu_mark(f"segment {index} landed (gpu)", event)
            return arrival

        def timed_scatter(*args: Any, **kwargs: Any) -> None:
            scatter_from(*args, **kwargs)
            done = _TimedEvent()
            done.record()
            clock.gpu_mark(f"scatter {kwargs.get('layers')} done (gpu)", done)

        PairedTransport.receive = timed_receive  # type: ignore[method-assign]
        mark_waiter_wakes(clock)
        import kvrt._threads
        from kvrt._consumer import Consumer

        kvrt._threads._settle = marked(kvrt._threads._settle, "a wait's outcome on the loop")
        pull = Consumer.pull

        async def timed_pull(self: Any, *args: Any, **kwargs: Any) -> Any:
            item = await pull(self, *args, **kwargs)
            clock.host_mark("pull returns")
            note_allocations(clock, device)
            return item

        Consumer.pull = timed_pull  # type: ignore[method-assign]
        from kvrt._protocol import ConsumerCore

        ConsumerCore.receive = marked(ConsumerCore.receive, "ConsumerCore.receive")  # type: ignore[method-assign]
        kernels.scatter_from = timed_scatter
    return clock


def timeline_producer(store_port: int, control: multiprocessing.connection.Connection) -> None:
    from kvrt._bench import pull

    torch.cuda.set_device(pull.PRODUCER_DEVICE)
    clock = _patch(pull.PRODUCER_DEVICE, "producer")
    original_send = control.send

    class Control:  # notes the timeline whenever the producer reports a round
        def __getattr__(self, name: str) -> Any:
            return getattr(control, name)

        def send(self, message: Any) -> None:
            if isinstance(message, float):
                note_allocations(clock, pull.PRODUCER_DEVICE)
                marks = clock.resolve()
                (OUT / f"timeline-producer-{message:.6f}.json").write_text(json.dumps(marks))
            original_send(message)

    pull._producer(store_port, Control())  # type: ignore[arg-type]


def main() -> int:
    global OUT, TRANSPORT
    OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    TRANSPORT = sys.argv[2] if len(sys.argv) > 2 else TRANSPORT
    OUT.mkdir(parents=True, exist_ok=True)
    os.environ["KVRT_TIMELINE_OUT"] = str(OUT)  # the producer process inherits both
    os.environ["KVRT_TIMELINE_TRANSPORT"] = TRANSPORT
    from kvrt._bench import pull

    torch.cuda.set_device(pull.CONSUMER_DEVICE)
    clock = _patch(pull.CONSUMER_DEVICE, "consumer")
    pull._producer = timeline_producer  # type: ignore[assignment]
    result = pull.main(argparse.Namespace(json=str(OUT / "pull.json"), transport=TRANSPORT))
    marks = clock.resolve()
    (OUT / "timeline-consumer.json").write_text(json.dumps(marks))
    producer_marks = sorted(
        (mark for path in OUT.glob("timeline-producer-*.json") for mark in json.loads(path.read_text())),
        key=lambda mark: mark[1],
    )
    everything = sorted(
        [("P " + n, t) for n, t in producer_marks] + [("C " + n, t) for n, t in marks], key=lambda m: m[1]
    )
    starts = [t for n, t in everything if n == "P publish starts"]
    for index, start in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else float("inf")
        print(f"\n-- round {index}")
        for name, at in everything:
            if start <= at < end:
                print(f"  {1e3 * (at - start):8.2f} ms  {name}")
    return result


if __name__ == "__main__":
    sys.exit(main())
