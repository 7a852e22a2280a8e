"""Where `kvrt bench stream`'s last layer spends its time, on the GPUs' clocks (a diagnostic,
not a record). It runs the benchmark with stamps added around `put_layer`'s copy, on kvrt's
send stream after the layer's event, on it after NCCL's send ended (`work.wait()`, which
makes each send wait for the one before: the figures are of that variant), after the
receive, and after `layer()` made the reader's stream wait. A stamp is a one-thread kernel:
it waits for an SM like NCCL's kernels do, which is what this tool showed (a send queued
during the next layer's matmul starts when that matmul ends). On the GPU host:
`python3 tools/stream_timeline.py OUT` (OUT: a folder for its JSON)."""

from __future__ import annotations

import argparse
import json
import multiprocessing.connection
import statistics
import sys
from typing import Any

import torch

SLOTS = 2048


def _hooks(names: list[str], device: str) -> tuple[Any, dict[str, int]]:
    from kvrt._bench._gpu_clock import Stamps

    stamps = {name: Stamps(device, SLOTS) for name in names}
    return stamps, {name: 0 for name in names}


def patched_producer(store_port: int, control: multiprocessing.connection.Connection) -> None:
    import kvrt._streams as streams
    from kvrt._bench import stream as bench
    from kvrt.transports.paired import PairedTransport

    device = bench.PRODUCER_DEVICE
    torch.cuda.set_device(device)
    stamps, counts = _hooks(["computed", "copied", "send_start", "send_end"], device)
    owned = streams._owned

    def _owned(key: torch.Tensor, value: torch.Tensor, dev: torch.device) -> Any:
        stamps["computed"].stamp(counts["computed"] % SLOTS)
        counts["computed"] += 1
        result = owned(key, value, dev)
        stamps["copied"].stamp(counts["copied"] % SLOTS)
        counts["copied"] += 1
        return result

    streams._owned = _owned
    send_tensors = PairedTransport.send_tensors

    async def probed_send(self: Any, peer: bytes, tensors: Any, ready: Any) -> None:
        index = counts["send_start"] % SLOTS
        counts["send_start"] += 1
        send_stream = self._streams[0]
        with torch.cuda.device(self.device), torch.cuda.stream(send_stream):
            if ready is not None:
                send_stream.wait_event(ready)
            stamps["send_start"].stamp(index)
        await send_tensors(self, peer, tensors, ready)
        work = self._pairs[peer].sends[-1][0]
        with torch.cuda.device(self.device), torch.cuda.stream(send_stream):
            work.wait()
            stamps["send_end"].stamp(index)
        counts["send_end"] += 1

    PairedTransport.send_tensors = probed_send  # type: ignore[method-assign]
    bench._producer(store_port, control)
    torch.cuda.synchronize(device)
    with open(f"{OUT_DIR}/producer-stamps.json", "w") as out:
        json.dump({name: s.values.tolist()[: counts[name]] for name, s in stamps.items()}, out)


OUT_DIR = sys.argv[1] if len(sys.argv) > 1 else "/tmp"


def main() -> None:
    import kvrt._streams as streams
    from kvrt._bench import stream as bench
    from kvrt.transports.paired import PairedTransport

    device = bench.CONSUMER_DEVICE
    torch.cuda.set_device(device)
    stamps, counts = _hooks(["received", "reader"], device)
    receive_tensors = PairedTransport.receive_tensors

    def probed_receive(self: Any, metas: Any, frames: Any) -> Any:
        arrival = receive_tensors(self, metas, frames)
        with torch.cuda.device(self.device), torch.cuda.stream(self._streams[1]):
            stamps["received"].stamp(counts["received"] % SLOTS)
        counts["received"] += 1
        return arrival

    PairedTransport.receive_tensors = probed_receive  # type: ignore[method-assign]
    layer = streams.ConsumerStream.layer

    async def probed_layer(self: Any, index: int, *, stream: Any = None) -> Any:
        result = await layer(self, index, stream=stream)
        stamps["reader"].stamp(counts["reader"] % SLOTS)
        counts["reader"] += 1
        return result

    streams.ConsumerStream.layer = probed_layer  # type: ignore[method-assign]
    bench._producer = patched_producer
    bench.main(argparse.Namespace(json=f"{OUT_DIR}/probe-stream.json"))
    torch.cuda.synchronize(device)
    with open(f"{OUT_DIR}/probe-stream.json") as f:
        result = json.load(f)
    with open(f"{OUT_DIR}/producer-stamps.json") as f:
        producer = json.load(f)
    consumer = {name: s.values.tolist()[: counts[name]] for name, s in stamps.items()}
    offset = result["clock_offset_ns"]
    layers = bench.LAYERS
    rows = []
    for end in range(layers - 1, len(consumer["reader"]), layers):
        p = {name: values[end] for name, values in producer.items() if end < len(values)}
        c = {name: values[end] - offset for name, values in consumer.items()}
        if len(p) < 4:
            continue
        rows.append({
            "copy": p["copied"] - p["computed"],
            "send_start-copied": p["send_start"] - p["copied"],
            "send (producer)": p["send_end"] - p["send_start"],
            "received-send_start": c["received"] - p["send_start"],
            "received-send_end": c["received"] - p["send_end"],
            "reader-received": c["reader"] - c["received"],
            "total": c["reader"] - p["computed"],
        })  # fmt: skip
    print(f"\nlast layer of each stream round, us (raw one layer: {result['raw_one_layer_s'] * 1e6:.0f} us)")
    for key in rows[0]:
        values = [row[key] / 1e3 for row in rows]
        print(f"  {key:22} median {statistics.median(values):8.1f}   " + " ".join(f"{v:7.1f}" for v in values))
    # And every layer's transfer, to see whether sends back up.
    gaps = [(producer["send_start"][i] - producer["copied"][i]) / 1e3 for i in range(min(len(producer["copied"]), 64))]
    print("send_start - copied, first 64 layers (us):", " ".join(f"{g:.0f}" for g in gaps))


if __name__ == "__main__":
    main()
