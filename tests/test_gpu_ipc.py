"""The `cuda_ipc` transport's choice of path and its failures, between two processes of one
host (producer on cuda:0, consumer on cuda:1, or both on cuda:0 where one GPU is visible:
`tests/_gpus.py`). Bit-exact transfers of every dtype, batches, pulls and streams over it
are in `test_gpu_nccl.py` and `test_gpu_stream.py`, run over both GPU transports.

Skipped without CUDA (the fallbacks to NCCL, without two devices); `tools/gpu_check.sh` runs them on a
GPU host.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

import kvrt
from kvrt.transports.cuda_ipc import CudaIpcReceiver
from tests._checks import caught_up, same_bits
from tests._gpu_processes import kv_item, kv_tokens, run_gpu_ipc_reader, run_gpu_producer, run_gpu_streamer
from tests._gpus import CONSUMER_DEVICE, PRODUCER_DEVICE, one_gpu, two_gpus
from tests._processes import child_process, fails_with_peer_lost_in_time, gpu_producer_process, killed_and_forgotten

pytestmark = [one_gpu, pytest.mark.timeout(100, method="thread")]
"""One GPU will do (both processes on it) but where NCCL serves: `two_gpus`."""

spawn = multiprocessing.get_context("spawn")




async def arrives_right(consumer: kvrt.Consumer, index: int, tokens: int) -> None:
    input_tokens, key, value, hidden = kv_item(index, tokens, torch.bfloat16, CONSUMER_DEVICE)
    item = await consumer.drop_select(input_tokens, None)
    assert item is not None and same_bits(item.key, key) and same_bits(item.value, value)
    assert item.hidden is not None and same_bits(item.hidden, hidden)


async def test_a_consumer_on_the_producers_host_gets_cuda_ipc_unasked_and_both_sides_report_it() -> None:
    async with (
        child_process(run_gpu_producer, (PRODUCER_DEVICE, None, 1.0, [(0, 300, "bfloat16")]), "GPU producer") as (
            endpoint,
            _,
            control,
        ),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE) as consumer,
    ):
        assert consumer.transports == {endpoint: "cuda_ipc"}
        await arrives_right(consumer, 0, 300)
        await caught_up(consumer)  # the receipt went before it
        control.send("stats")
        items, in_flight, peers = await asyncio.to_thread(control.recv)
        assert (items, in_flight, peers) == (0, 0, 1)


@two_gpus
async def test_a_consumer_on_another_host_gets_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvrt._consumer._session.host_identity", lambda: "boot:another-machine")
    async with (
        gpu_producer_process([(0, 300, "bfloat16")]) as (endpoint, _, _),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE) as consumer,
    ):
        assert consumer.transports == {endpoint: "nccl"}
        await arrives_right(consumer, 0, 300)


def cannot_open(self: CudaIpcReceiver, *_: Any) -> None:
    raise kvrt.TransportUnavailableError("cuda_ipc: the producer's memory cannot be opened here: (simulated)")


@two_gpus
async def test_where_ipc_cannot_open_the_producers_memory_the_consumer_falls_back_to_nccl_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(CudaIpcReceiver, "_check_probe", cannot_open)
    with caplog.at_level(logging.WARNING, logger="kvrt"):
        async with (
            gpu_producer_process([(0, 300, "bfloat16"), (1, 200, "bfloat16")]) as (endpoint, _, _),
            kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE) as consumer,
        ):
            assert consumer.transports == {endpoint: "nccl"}
            await arrives_right(consumer, 0, 300)
            await arrives_right(consumer, 1, 200)
    assert any(
        "cannot be opened here" in record.getMessage() and "nccl" in record.getMessage() for record in caplog.records
    )


async def test_a_consumer_that_forces_cuda_ipc_where_it_cannot_work_gets_a_typed_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(CudaIpcReceiver, "_check_probe", cannot_open)
    async with gpu_producer_process([(0, 300, "bfloat16")]) as (endpoint, _, _):
        with pytest.raises(kvrt.PeerLostError, match="cannot be opened here"):
            async with kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport="cuda_ipc"):
                pass


@two_gpus
async def test_memory_from_expandable_segments_travels_or_falls_back_never_crashes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The producer's allocator maps its memory in expandable segments, which legacy CUDA IPC
    # cannot share: torch shares them by file descriptor, or the probe fails and NCCL serves.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    async with gpu_producer_process([(0, 300, "bfloat16"), (1, 5000, "bfloat16")]) as (endpoint, _, _):
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
        async with kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE) as consumer:
            chosen = consumer.transports[endpoint]
            print(f"expandable segments: the items travel over {chosen}")
            assert chosen in ("cuda_ipc", "nccl")
            await arrives_right(consumer, 0, 300)
            await arrives_right(consumer, 1, 5000)


async def test_a_prefill_killed_before_writing_fails_the_ipc_reader_in_time_and_leaves_its_gpu_usable() -> None:
    # Its layers' marks are never recorded. The reader's copies wait for them on the host,
    # never on its GPU: it learns of the death from the heartbeat, fails the stream, and its
    # device stays usable (a GPU-side wait would have blocked every later CUDA call of the
    # process that waits for the whole device, for ever). The reader runs in a process of its
    # own, so that if it does hang, only it does.
    heartbeat_s = 0.25
    streamer = child_process(run_gpu_streamer, (PRODUCER_DEVICE, heartbeat_s), "GPU streamer")
    async with streamer as (endpoint, producer, control):
        reader_control, child = spawn.Pipe()
        reader = spawn.Process(target=run_gpu_ipc_reader, args=(endpoint, CONSUMER_DEVICE, heartbeat_s, child))
        await asyncio.to_thread(reader.start)
        try:
            assert await heard(reader_control) == ("warming",)
            control.send(("stream", 3, "bfloat16", 1, 256, 0, None))  # columns as stream 0's
            assert await heard(control) == "streamed"
            assert await heard(reader_control) == ("opened",)
            control.send(("stream", 0, "bfloat16", 4, 256, 3000, None))  # 3 s of GPU work a layer
            # Layer 0 was not written yet: it has not landed. (Two runs with no warm-up, or one
            # of other columns, saw it landed: that put_layer loaded its kernel's module, which
            # waited for the GPU's 3 s.)
            assert await heard(reader_control) == ("reading", False)
            assert producer.pid is not None
            os.kill(producer.pid, signal.SIGKILL)
            reader_control.send("killed")
            what, error, seconds = await heard(reader_control)
            assert (what, error) == ("lost", "PeerLostError") and seconds < 4 * heartbeat_s + 1.0
            # Handed out before the stream failed (its copy's wait on the GPU released since), or
            # failed with it (a transport that hands a layer out only once written).
            assert await heard(reader_control) in (("layer 0", "PeerLostError"), ("layer 0", "handed out"))
            assert await heard(reader_control) == ("device works", True)
            what, seconds = await heard(reader_control)
            assert what == "closed" and seconds < 5.0
        finally:
            await asyncio.to_thread(reader.join, 10)
            if reader.is_alive():
                reader.kill()


def posts_noted(link: Any) -> asyncio.Event:
    """An event set once `link` has posted the receive of a Deliver (its copies queued)."""
    posted = asyncio.Event()
    on_deliver = link.arrivals.on_deliver

    def noting_the_post(*args: Any) -> None:
        on_deliver(*args)
        posted.set()

    link.arrivals.on_deliver = noting_the_post
    return posted


@contextlib.asynccontextmanager
async def ipc_consumer_of(
    runner: Any, what: str, heartbeat_s: float, **options: Any
) -> AsyncIterator[tuple[kvrt.Consumer, Any, Any]]:
    """A producer process `runner(PRODUCER_DEVICE, heartbeat_s, control)` and a consumer of it
    over cuda_ipc (with `options`): the consumer, the process and its control pipe."""
    async with child_process(runner, (PRODUCER_DEVICE, heartbeat_s), what) as (endpoint, producer, control):
        async with kvrt.Consumer(
            connect=endpoint, device=CONSUMER_DEVICE, heartbeat_s=heartbeat_s, transport="cuda_ipc", **options
        ) as consumer:
            yield consumer, producer, control


def producer_memory(producer: kvrt.Producer | None = None) -> int:
    """The producer GPU's bytes that hold something, once what nothing holds any more was
    collected (torch's IPC limbo included) and its queued work done: allocated bytes, less
    those of `producer`'s registered memory free for new items."""
    gc.collect()
    torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize(PRODUCER_DEVICE)
    held = torch.cuda.memory_allocated(PRODUCER_DEVICE)
    if producer is not None and "cuda_ipc" in producer._transports:
        arena = producer._transports["cuda_ipc"]._arena  # type: ignore[attr-defined]
        arena.collect()
        held -= arena.reserved_bytes - arena.used_bytes
    return held


async def stream_reader_that_dies(
    producer: kvrt.Producer, tokens: torch.Tensor, layers: int, heartbeat_s: float, *, sees_the_end: bool = True
) -> tuple[Any, Any]:
    """A reader process of the stream `tokens` name, started: it reads `layers` layers, holds
    what it opened, says "read" on the returned control pipe, and waits to be killed."""
    from tests._gpu_processes import run_gpu_stream_reader_that_dies

    control, child = spawn.Pipe()
    reader = spawn.Process(
        target=run_gpu_stream_reader_that_dies,
        args=(producer.endpoint, CONSUMER_DEVICE, heartbeat_s, tokens.tolist(), layers, child),
        kwargs={"sees_the_end": sees_the_end},
        daemon=True,
    )
    await asyncio.to_thread(reader.start)
    return reader, control


async def heard(control: Any) -> Any:
    assert await asyncio.to_thread(control.poll, 30), "the reader did not answer"
    return control.recv()


async def test_the_consumer_releases_every_share_it_receives_exactly_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The producer's torch counts one reference per share it sends; the consumer owes one
    # decrement per share it receives (by dropping a counted opening, or releasing it unread).
    # More and the producer frees memory another reader may still use; fewer and it is pinned.
    # A chunked pull reads many ranges of one share: it opened one counted storage each.
    # Shares of registered memory are not counted (the slab is opened once and kept).
    from kvrt import Layout, PoolTable
    from kvrt.transports import cuda_ipc
    from tests._gpu_processes import PULL_LAYERS, pull_request, run_gpu_publisher

    received: dict[tuple[bytes, int], int] = {}
    released: dict[tuple[bytes, int], int] = {}
    share_in, check_probe = CudaIpcReceiver._share_in, CudaIpcReceiver._check_probe
    new_shared, release = cuda_ipc._new_shared, cuda_ipc._release

    registered: list[Any] = []

    def counted_in(self: CudaIpcReceiver, frames: Any) -> Any:
        share = share_in(self, frames)
        if not share.counter:
            registered.append(share)
            return share
        key = (share.counter, share.counter_offset)
        received[key] = received.get(key, 0) + 1
        return share

    def counted_probe(self: CudaIpcReceiver, session: Any, probe: Any, *rest: Any) -> None:
        key = (probe.counter, probe.counter_offset)  # (the mark words' share is kept for good)
        received[key] = received.get(key, 0) + 1
        check_probe(self, session, probe, *rest)

    def counted_open(device_index: int, share: Any, *, counted: bool) -> Any:
        if counted:
            key = (share.counter, share.counter_offset)
            released[key] = released.get(key, 0) + 1
        return new_shared(device_index, share, counted=counted)

    def counted_release(share: Any) -> None:
        if not share.counter:
            return
        key = (share.counter, share.counter_offset)
        released[key] = released.get(key, 0) + 1
        release(share)

    monkeypatch.setattr(CudaIpcReceiver, "_share_in", counted_in)
    monkeypatch.setattr(CudaIpcReceiver, "_check_probe", counted_probe)
    monkeypatch.setattr(cuda_ipc, "_new_shared", counted_open)
    monkeypatch.setattr(cuda_ipc, "_release", counted_release)
    torch.cuda.set_device(CONSUMER_DEVICE)
    publisher = (PRODUCER_DEVICE, 5, 16 << 20, False, False, None)
    async with child_process(run_gpu_publisher, publisher, "GPU publisher") as (
        endpoint,
        _,
        _,
    ):

        def build() -> tuple[Any, ...]:
            torch.cuda.set_device(CONSUMER_DEVICE)
            pools, tokens, _, _ = pull_request(5, False)
            shape = pools[0][0][0].shape
            target = PoolTable(
                [[[torch.zeros(shape, dtype=torch.bfloat16, device=CONSUMER_DEVICE) for _ in range(PULL_LAYERS)]]],
                Layout.TOKEN_MAJOR,
            )
            torch.cuda.synchronize(CONSUMER_DEVICE)
            return tokens, target, torch.randperm(shape[0], device=CONSUMER_DEVICE)[: tokens.numel()]

        tokens, target, into_slots = await asyncio.to_thread(build)
        async with kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport="cuda_ipc") as consumer:
            item = await consumer.pull(tokens, into=target, slots=into_slots, replica=0, timeout=30)
            assert item is not None and item.matched == tokens.numel()
    assert received and released == received
    assert registered  # the published item's chunks: ranges of a registered slab


@pytest.mark.parametrize("registered", [True, False], ids=["registered", "torch-shared"])
async def test_a_consumer_killed_holding_what_it_read_leaves_no_producer_memory_pinned(registered: bool) -> None:
    # Torch counts a reference per share, and the consumer gives it back by dropping what it
    # opened. This one read the item and is killed still holding it: its count would stay up,
    # and once a second consumer has taken and confirmed the item, the producer's torch would
    # keep the item's memory in its limbo for good. The producer releases the counts of what
    # a departed consumer never confirmed, so the memory comes back. In registered memory
    # nothing is counted: the item's region comes back once the item is confirmed.
    from tests._gpu_processes import run_gpu_consumer, run_gpu_consumer_that_dies

    heartbeat_s = 0.25
    tokens, key, value, hidden = kv_item(0, 1 << 15, torch.bfloat16, PRODUCER_DEVICE)
    item_bytes = key.nbytes + value.nbytes
    torch.cuda.set_device(PRODUCER_DEVICE)
    async with kvrt.Producer(device=PRODUCER_DEVICE, heartbeat_s=heartbeat_s) as producer:
        if not registered:
            producer._transports["cuda_ipc"]._arena.limit_bytes = 0  # type: ignore[attr-defined]
        await producer.insert(tokens, None, key, value, hidden)
        del key, value, hidden  # the producer holds its own copy
        with_item = producer_memory(producer)
        query = tokens.tolist()
        control, child = spawn.Pipe()
        reader = spawn.Process(
            target=run_gpu_consumer_that_dies,
            args=(producer.endpoint, CONSUMER_DEVICE, heartbeat_s, query, child, "cuda_ipc", True),
            daemon=True,
        )
        await asyncio.to_thread(reader.start)
        assert await heard(control) == "asked"
        assert await heard(control) == "arrived"
        await killed_and_forgotten(reader, producer, heartbeat_s)
        assert producer.stats().items == 1  # back in the buffer

        producer._serving.peer_left.clear()
        control, child = spawn.Pipe()
        taker = spawn.Process(
            target=run_gpu_consumer, args=(producer.endpoint, CONSUMER_DEVICE, query, "cuda_ipc", child)
        )
        await asyncio.to_thread(taker.start)
        assert await heard(control) == len(query)
        await asyncio.to_thread(taker.join)
        await asyncio.wait_for(producer._serving.peer_left.wait(), 10.0)  # its bye, after its receipt
        stats = producer.stats()
        assert (stats.items, stats.in_flight, stats.totals.delivered_items) == (0, 0, 1)
        freed = with_item - producer_memory(producer)
        assert freed >= item_bytes, f"{freed} bytes freed of the item's {item_bytes}"


async def test_a_stream_reader_killed_holding_what_it_read_leaves_no_producer_memory_pinned() -> None:
    # The same for a stream's layers: each is shared as it is published. The reader is killed
    # mid-stream holding the layers it opened; the stream goes back to the open streams, and
    # once the prefill gives it up, its layers' memory must come back.
    heartbeat_s = 0.25
    tokens, layers, read = kv_tokens(7, 1 << 14), 4, 3
    torch.cuda.set_device(PRODUCER_DEVICE)
    async with kvrt.Producer(device=PRODUCER_DEVICE, heartbeat_s=heartbeat_s) as producer:
        before = torch.cuda.memory_allocated(PRODUCER_DEVICE)
        stream = await producer.open_stream(tokens, layers=layers)
        reader, control = await stream_reader_that_dies(producer, tokens, read, heartbeat_s)
        layer_bytes = 0
        for layer in range(read):
            key = torch.full((tokens.numel(), 8, 128), float(layer), dtype=torch.bfloat16, device=PRODUCER_DEVICE)
            await stream.put_layer(key, key.clone())
            layer_bytes += 2 * key.nbytes
            del key
        assert await heard(control) == "read"
        await killed_and_forgotten(reader, producer, heartbeat_s)
        await stream.abort("the test gives the prefill up")
        stats = producer.stats()
        assert (stats.items, stats.in_flight) == (0, 0)
        held = producer_memory() - before
        assert held < layer_bytes // read, f"{held} bytes still held of the {layer_bytes} the layers took"


async def test_a_finished_items_stream_reader_killed_holding_what_it_read_leaves_no_producer_memory_pinned() -> None:
    # A finished item read as a stream comes whole, in one transfer, and is confirmed once it
    # landed: the reader killed holding its layers took the item for good (nothing goes back),
    # and none of the producer's memory stays pinned for it.
    heartbeat_s = 0.25
    tokens, layers, read = kv_tokens(8, 1 << 14), 4, 3
    torch.cuda.set_device(PRODUCER_DEVICE)
    async with kvrt.Producer(device=PRODUCER_DEVICE, heartbeat_s=heartbeat_s) as producer:
        stream = await producer.open_stream(tokens, layers=layers)
        layer_bytes = 0
        for layer in range(layers):
            key = torch.full((tokens.numel(), 8, 128), float(layer), dtype=torch.bfloat16, device=PRODUCER_DEVICE)
            await stream.put_layer(key, key.clone())
            layer_bytes = 2 * key.nbytes
            del key
        await stream.finish()
        before = producer_memory(producer)  # the finished item, in the buffer
        reader, control = await stream_reader_that_dies(producer, tokens, read, heartbeat_s, sees_the_end=False)
        assert await heard(control) == "read"
        await killed_and_forgotten(reader, producer, heartbeat_s)
        stats = producer.stats()
        assert (stats.items, stats.in_flight) == (0, 0)  # confirmed by the reader before it died
        held = producer_memory(producer) - before
        assert held < layer_bytes, f"{held} bytes still held; a layer takes {layer_bytes}"


async def test_a_producer_killed_before_its_item_is_written_fails_the_call_instead_of_handing_out_garbage() -> None:
    # The item is delivered at once; its bytes come 3 s later (the producer's GPU is busy).
    # The producer is killed meanwhile: the link gives it up after the heartbeat timeout and
    # lets the copy read whatever was left, so the call must fail with PeerLostError, not
    # return those bytes as the item.
    from tests._gpu_processes import WARM_UP, run_gpu_late_inserter

    heartbeat_s = 0.25
    tokens = 4096
    async with ipc_consumer_of(run_gpu_late_inserter, "GPU late inserter", heartbeat_s) as (
        consumer,
        producer,
        control,
    ):
        assert await consumer.drop_select(kv_tokens(WARM_UP, 16)) is not None  # the path is warm
        link = consumer.link_for_tests()
        posted = posts_noted(link)
        call = asyncio.create_task(consumer.drop_select(kv_tokens(5, tokens), timeout=30))
        await asyncio.sleep(0)
        await caught_up(consumer)  # the request is in
        control.send(("insert", 5, tokens, 3000))
        assert await heard(control) == "inserted"
        await asyncio.wait_for(posted.wait(), 10)  # its copy waits for the producer's mark
        assert not call.done() and link.session._arrivals
        await fails_with_peer_lost_in_time(call, producer, heartbeat_s)


async def test_bytes_a_live_producer_does_not_write_in_time_fail_the_call_and_come_in_a_new_session() -> None:
    # The producer's GPU is busy for 4 s, its loop answers heartbeats: past the consumer's
    # transfer timeout the call fails, the link releases its copy's wait (the consumer's GPU
    # is free at once) and starts a new session; once written, the item arrives intact.
    from tests._gpu_processes import WARM_UP, run_gpu_late_inserter

    heartbeat_s, tokens = 0.25, 4096
    async with ipc_consumer_of(run_gpu_late_inserter, "GPU late inserter", heartbeat_s, transfer_timeout_s=1.0) as (
        consumer,
        _,
        control,
    ):
        assert await consumer.drop_select(kv_tokens(WARM_UP, 16)) is not None  # the path is warm
        call = asyncio.create_task(consumer.drop_select(kv_tokens(6, tokens), timeout=30))
        await asyncio.sleep(0)
        await caught_up(consumer)  # the request is in
        control.send(("insert", 6, tokens, 4000))
        assert await heard(control) == "inserted"
        inserted_at = time.monotonic()
        with pytest.raises(kvrt.KVRTTimeoutError, match="did not finish a transfer"):
            await call
        assert time.monotonic() - inserted_at < 3.0
        await asyncio.wait_for(asyncio.to_thread(torch.cuda.synchronize, CONSUMER_DEVICE), 2.0)
        assert time.monotonic() - inserted_at < 3.5  # before the producer's GPU is done
        control.send("sync")
        assert await heard(control) == "synced"
        item = await consumer.drop_select(kv_tokens(6, tokens), timeout=10)
        _, key, value, hidden = kv_item(6, tokens, torch.bfloat16, CONSUMER_DEVICE)
        assert item is not None and same_bits(item.key, key) and same_bits(item.value, value)
        assert item.hidden is not None and same_bits(item.hidden, hidden)


async def test_a_producer_killed_mid_pull_fails_the_pull_with_a_typed_error() -> None:
    # The safety rule for paged pulls over cuda_ipc: the request is published while the producer's GPU
    # is busy (its gathers, so its marks, come 3 s later) and the producer is killed
    # meanwhile. The pull fails with PeerLostError within the heartbeat timeout; it never
    # returns the item as pulled (the slots hold no defined bytes then).
    from kvrt import Layout, PoolTable
    from tests._gpu_processes import PULL_LAYERS, PULL_SLOTS, PULL_TOKENS, WARM_UP, run_gpu_late_publisher

    heartbeat_s = 0.25
    torch.cuda.set_device(CONSUMER_DEVICE)
    target = PoolTable(
        [[[torch.zeros((PULL_SLOTS, 16, 128), dtype=torch.bfloat16, device=CONSUMER_DEVICE)
           for _ in range(PULL_LAYERS)]]],
        Layout.TOKEN_MAJOR,
    )  # fmt: skip
    into_slots = torch.randperm(PULL_SLOTS)[:PULL_TOKENS]
    async with ipc_consumer_of(run_gpu_late_publisher, "GPU late publisher", heartbeat_s) as (
        consumer,
        producer,
        control,
    ):
        warm = await consumer.pull(kv_tokens(WARM_UP, PULL_TOKENS), into=target, slots=into_slots, timeout=30)
        assert warm is not None  # the path is warm, the scatters' kernels too
        link = consumer.link_for_tests()
        posted = posts_noted(link)
        pulling = asyncio.create_task(
            consumer.pull(kv_tokens(8, PULL_TOKENS), into=target, slots=into_slots, timeout=30)
        )
        await asyncio.sleep(0)
        await caught_up(consumer)  # the request is in
        control.send(("publish", 8, 3000))
        assert await heard(control) == "published"
        await asyncio.wait_for(posted.wait(), 10)  # its copies wait for the producer's marks
        assert not pulling.done()
        await fails_with_peer_lost_in_time(pulling, producer, heartbeat_s)
