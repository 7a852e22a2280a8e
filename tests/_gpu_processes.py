"""Programs the GPU tests start in their own processes (importable by `spawn`)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing.connection
from typing import Any

import torch

import kvrt
from tests._checks import caught_up


def kv_tokens(index: int, tokens: int, device: str = "cpu") -> torch.Tensor:
    """The tokens of item `index` (cheap: no KV generated)."""
    return torch.arange(tokens, device=device) + 1_000_000 * index


def kv_item(index: int, tokens: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """Tokens, key, value, hidden of item `index`, generated on `device` from a seed."""
    generator = torch.Generator(device=device).manual_seed(index)
    input_tokens = kv_tokens(index, tokens, device)
    shape = (2, tokens, 8, 128)
    if dtype.is_floating_point and dtype.itemsize > 1:
        key = torch.randn(shape, generator=generator, device=device).to(dtype)
        value = torch.randn(shape, generator=generator, device=device).to(dtype)
    else:
        key = torch.randint(0, 2 if dtype == torch.bool else 127, shape, generator=generator, device=device).to(dtype)
        value = torch.randint(0, 2 if dtype == torch.bool else 127, shape, generator=generator, device=device).to(dtype)
    hidden = torch.randn((tokens, 64), generator=generator, device=device)
    return input_tokens, key, value, hidden


def run_gpu_producer(
    device: str, transport: str | None, heartbeat_s: float, items: list[tuple[int, int, str]],
    control: multiprocessing.connection.Connection,
) -> None:  # fmt: skip
    """Insert `items` (index, tokens, dtype name) on `device`, send the endpoint, serve until told to stop."""

    async def main() -> None:
        async with kvrt.Producer(
            device=device, transport=transport, heartbeat_s=heartbeat_s, buffer_bytes=1 << 40
        ) as producer:
            for index, tokens, dtype_name in items:
                input_tokens, key, value, hidden = kv_item(index, tokens, getattr(torch, dtype_name), device)
                await producer.insert(input_tokens, None, key, value, hidden)
            control.send(producer.endpoint)
            while True:
                command: Any = await asyncio.to_thread(_receive, control)
                if command is None or command == "stop":
                    return
                if command == "stats":
                    stats = producer.stats()
                    control.send((stats.items, stats.in_flight, stats.peers))

    asyncio.run(main())


def run_gpu_producer_registering(
    device: str, registered_bytes: int | None, items: list[tuple[int, int, str]],
    control: multiprocessing.connection.Connection,
) -> None:  # fmt: skip
    """As `run_gpu_producer`, its cuda_ipc registered memory capped at `registered_bytes`
    (None: the default; 0: every item is allocated and shared by torch)."""

    async def main() -> None:
        async with kvrt.Producer(device=device, buffer_bytes=1 << 40) as producer:
            if registered_bytes is not None:
                producer._transports["cuda_ipc"]._arena.limit_bytes = registered_bytes  # type: ignore[attr-defined]
            for index, tokens, dtype_name in items:
                input_tokens, key, value, hidden = kv_item(index, tokens, getattr(torch, dtype_name), device)
                await producer.insert(input_tokens, None, key, value, hidden)
            control.send(producer.endpoint)
            await asyncio.to_thread(_receive, control)

    asyncio.run(main())


def _receive(control: multiprocessing.connection.Connection) -> Any:
    with contextlib.suppress(EOFError):
        return control.recv()
    return None


def run_gpu_consumer_that_dies(
    endpoint: str, device: str, heartbeat_s: float, tokens: list[int],
    control: multiprocessing.connection.Connection, transport: str | None = None, hold_reads: bool = False,
) -> None:  # fmt: skip
    """Ask for an item and never confirm it: the parent kills this process mid-transfer. With
    `hold_reads` (cuda_ipc), what it opened of the producer's memory is never dropped: killed
    after "arrived", it dies as one killed mid-read, its counts never given back."""
    from kvrt import _messages as m

    if hold_reads:
        from kvrt.transports import cuda_ipc

        held: list[Any] = []
        cuda_ipc._drop = lambda device, idle, *references: held.extend(list(each) for each in references)

    async def main() -> None:
        async with kvrt.Consumer(
            connect=endpoint, device=device, heartbeat_s=heartbeat_s, transport=transport
        ) as consumer:
            query = m.tokens_to_bytes(torch.tensor(tokens).numpy())
            request = asyncio.create_task(
                consumer.link_for_tests().call(
                    lambda request_id: m.DropSelect(request_id=request_id, tokens=query, timeout_s=None),
                    confirm=False,
                )
            )
            await asyncio.sleep(0)  # the request is on the wire once the task ran this far
            control.send("asked")
            await request
            control.send("arrived")
            await asyncio.to_thread(_receive, control)

    asyncio.run(main())


def run_gpu_consumer(
    endpoint: str, device: str, tokens: list[int], transport: str, control: multiprocessing.connection.Connection
) -> None:
    """Take the item `tokens` name, confirm it, say how many tokens matched, and leave."""

    async def main() -> None:
        async with kvrt.Consumer(connect=endpoint, device=device, transport=transport) as consumer:
            item = await consumer.drop_select(torch.tensor(tokens))
        control.send(None if item is None else item.matched)

    asyncio.run(main())


def run_gpu_stream_reader_that_dies(
    endpoint: str, device: str, heartbeat_s: float, tokens: list[int], layers: int,
    control: multiprocessing.connection.Connection, *, sees_the_end: bool = True,
) -> None:  # fmt: skip
    """Read `layers` layers of the stream `tokens` name over cuda_ipc, never dropping what it
    opened of the producer's memory, say "read", and wait: the parent kills it mid-stream.
    Without `sees_the_end` it never handles the stream's end (so never confirms the item), as
    a reader killed before the end of a finished item's stream, which comes with its layers."""
    from kvrt import _streams
    from kvrt.transports import cuda_ipc

    held: list[Any] = []
    cuda_ipc._drop = lambda device, idle, *references: held.extend(list(each) for each in references)
    if not sees_the_end:
        _streams.ConsumerStream.finish = lambda self, hidden: None  # type: ignore[method-assign]

    async def main() -> None:
        torch.cuda.set_device(device)
        async with kvrt.Consumer(
            connect=endpoint, device=device, heartbeat_s=heartbeat_s, transport="cuda_ipc"
        ) as consumer:
            reader = await consumer.open_stream(torch.tensor(tokens), timeout=30)
            assert reader is not None
            for layer in range(layers):
                await reader.layer(layer)
            torch.cuda.synchronize(device)
            control.send("read")
            await asyncio.to_thread(_receive, control)

    asyncio.run(main())


PULL_LAYERS, PULL_TOKENS, PULL_HEADS, PULL_DIM, PULL_SLOTS, PULL_REPLICAS = 4, 4096, 8, 128, 8192, 4


def pull_request(
    seed: int, mla: bool = False
) -> tuple[list[list[list[torch.Tensor]]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-major (or MLA) dp=4 pools (on the CPU, from a seed), and a request spread over
    them: its tokens, per-token replica and slot."""
    generator = torch.Generator().manual_seed(seed)
    shape = (PULL_SLOTS, PULL_DIM) if mla else (PULL_SLOTS, 2 * PULL_HEADS, PULL_DIM)
    pools = [[[torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(PULL_LAYERS)]]
             for _ in range(PULL_REPLICAS)]  # fmt: skip
    replica = torch.randint(0, PULL_REPLICAS, (PULL_TOKENS,), generator=generator)
    slots = torch.randperm(PULL_SLOTS, generator=generator)[:PULL_TOKENS]
    return pools, kv_tokens(seed, PULL_TOKENS), replica, slots


def run_gpu_publisher(
    device: str, seed: int, chunk_bytes: int, mla: bool, host_indexes: bool, transport: str | None,
    control: multiprocessing.connection.Connection,
) -> None:  # fmt: skip
    """Publish `pull_request(seed, mla)` from pools on `device` in chunks of `chunk_bytes`,
    its tokens and indexes on the host or on `device`; serve until told to stop."""
    from kvrt import Layout, PoolTable

    torch.cuda.set_device(device)
    pools, tokens, replica, slots = pull_request(seed, mla)
    table = PoolTable([[[pool.to(device) for pool in layers] for layers in copies] for copies in pools],
                      Layout.MLA if mla else Layout.TOKEN_MAJOR)  # fmt: skip

    async def main() -> None:
        async with kvrt.Producer(device=device, buffer_bytes=1 << 40, transport=transport) as producer:
            producer.register_pools(table, chunk_bytes=chunk_bytes)
            if host_indexes:
                await producer.publish(tokens, slots, replica)
            else:
                await producer.publish(tokens.to(device), slots.to(device), replica.to(device))
            control.send(producer.endpoint)
            await asyncio.to_thread(_receive, control)

    asyncio.run(main())


def run_gpu_late_publisher(device: str, heartbeat_s: float, control: multiprocessing.connection.Connection) -> None:
    """`pull_request(5)`'s pools on `device`; on ("publish", index, milliseconds), that much GPU
    work, then the same request published again under the tokens `kv_tokens(index,
    PULL_TOKENS)` (tokens and indexes on the host: the publish reads nothing back; its gathers
    run after the work). Answers "published" at once. It first publishes the request under
    `WARM_UP`'s tokens, gathered at once: the gathers' kernels are compiled and loaded then."""
    from kvrt import Layout, PoolTable

    torch.cuda.set_device(device)
    pools, _, replica, slots = pull_request(5)
    table = PoolTable([[[pool.to(device) for pool in layers] for layers in copies] for copies in pools],
                      Layout.TOKEN_MAJOR)  # fmt: skip

    async def main() -> None:
        async with kvrt.Producer(device=device, heartbeat_s=heartbeat_s, buffer_bytes=1 << 40) as producer:
            producer.register_pools(table)
            await producer.publish(kv_tokens(WARM_UP, PULL_TOKENS), slots, replica)
            torch.cuda.synchronize(device)
            control.send(producer.endpoint)
            while (command := await asyncio.to_thread(_receive, control)) not in (None, "stop"):
                _, index, work_ms = command
                torch.cuda._sleep(work_ms * GPU_CYCLES_PER_MS)
                await producer.publish(kv_tokens(index, PULL_TOKENS), slots, replica)
                control.send("published")

    asyncio.run(main())


def stream_layer_kv(index: int, layer: int, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value of layer `layer` of stream `index`, [tokens, 8, 128], on the CPU from a seed
    (so that both processes know them bit for bit)."""
    generator = torch.Generator().manual_seed(1000 * index + layer)
    shape = (tokens, 8, 128)
    if dtype.is_floating_point:
        return tuple(torch.randn(shape, generator=generator).to(dtype) for _ in range(2))  # type: ignore[return-value]
    return tuple(torch.randint(0, 127, shape, generator=generator).to(dtype) for _ in range(2))  # type: ignore[return-value]


GPU_CYCLES_PER_MS = 2_000_000
"""`torch.cuda._sleep` cycles for about a millisecond (an H200 runs at up to 1.98 GHz)."""


def run_gpu_streamer(device: str, heartbeat_s: float, control: multiprocessing.connection.Connection) -> None:
    """A prefill on `device` that streams layers on command: ("stream", index, dtype name,
    layers, tokens, milliseconds of GPU work before each layer, layers after which it aborts
    or None), or ("paged", index, dtype name, layers, tokens, milliseconds, published): out of
    dp=4 pools (see `_stream_paged`). The host queues the whole prefill at once, as an engine
    does; the GPU's stream runs it. Answers "streamed" once it queued it all; "stats": (items,
    in flight); "stop" ends it."""

    async def main() -> None:
        torch.cuda.set_device(device)
        async with kvrt.Producer(device=device, heartbeat_s=heartbeat_s, buffer_bytes=1 << 40) as producer:
            control.send(producer.endpoint)
            while (command := await asyncio.to_thread(_receive, control)) not in (None, "stop"):
                if command == "stats":
                    stats = producer.stats()
                    control.send((stats.items, stats.in_flight))
                    continue
                if command[0] == "paged":
                    await _stream_paged(producer, device, *command[1:])
                    control.send("streamed")
                    continue
                _, index, dtype_name, layers, tokens, work_ms, abort_after = command
                kv = [stream_layer_kv(index, layer, tokens, getattr(torch, dtype_name)) for layer in range(layers)]
                on_device = [_columns(key.to(device), value.to(device), shift=index % 3) for key, value in kv]
                stream = await producer.open_stream(kv_tokens(index, tokens), layers=layers)
                for layer, (key, value) in enumerate(on_device):
                    if work_ms:
                        torch.cuda._sleep(work_ms * GPU_CYCLES_PER_MS)
                    await stream.put_layer(key, value)
                    if abort_after == layer + 1:
                        await stream.abort("the prefill ran out of memory")
                        break
                else:
                    await stream.finish(torch.full((tokens, 4), float(index), device=device))
                control.send("streamed")

    asyncio.run(main())


def _columns(key: torch.Tensor, value: torch.Tensor, *, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value as a prefill hands them over: columns of one wider projection output
    [tokens, shift + 2 * heads * dim + 3] (`shift` moves them off the widest word)."""
    tokens, heads, dim = key.shape
    row = heads * dim
    width = shift + 2 * row + 3
    out = torch.zeros((tokens, width * key.dtype.itemsize), dtype=torch.uint8, device=key.device).view(key.dtype)
    views = out[:, shift : shift + row], out[:, shift + row : shift + 2 * row]
    for view, source in zip(views, (key, value), strict=True):  # as bytes: fp8 too
        view.view(torch.uint8).copy_(source.reshape(tokens, row).view(torch.uint8))
    return views[0].view(tokens, heads, dim), views[1].view(tokens, heads, dim)


STREAM_SLOTS, STREAM_REPLICAS = 2048, 4


def paged_stream_request(index: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where stream `index`'s tokens sit in the prefill's dp=4 pools: replica and slot each."""
    generator = torch.Generator().manual_seed(index)
    return torch.arange(tokens) % STREAM_REPLICAS, torch.randperm(STREAM_SLOTS, generator=generator)[:tokens]


def paged_layer_pools(index: int, layer: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """What the prefill of stream `index` writes into layer `layer` of each replica's token-major
    pool [slots, 2*8, 128]: random bytes from a seed, on the CPU (both processes know them)."""
    generator = torch.Generator().manual_seed(10_000 * index + layer)
    shape = (STREAM_SLOTS, 16, 128)
    count = torch.Size(shape).numel() * dtype.itemsize
    return [
        torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator).view(dtype).view(shape)
        for _ in range(STREAM_REPLICAS)
    ]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Zeros of any dtype (fp8 too), made as bytes."""
    count = torch.Size(shape).numel() * dtype.itemsize
    return torch.zeros(count, dtype=torch.uint8, device=device).view(dtype).view(shape)


async def _stream_paged(
    producer: kvrt.Producer, device: str, index: int, dtype_name: str, layers: int, tokens: int, work_ms: int,
    published: bool,
) -> None:  # fmt: skip
    """A prefill into dp=4 pools that streams each layer out of them as it writes it (or, when
    `published`, publishes the request once every layer is written)."""
    from kvrt import Layout, PoolTable

    dtype = getattr(torch, dtype_name)
    pools = [[[zeros((STREAM_SLOTS, 16, 128), dtype, device) for _ in range(layers)]] for _ in range(STREAM_REPLICAS)]
    producer.register_pools(PoolTable(pools, Layout.TOKEN_MAJOR))
    written = [[pool.to(device) for pool in paged_layer_pools(index, layer, dtype)] for layer in range(layers)]
    replica, slots = paged_stream_request(index, tokens)
    input_tokens = kv_tokens(index, tokens)
    stream = None if published else await producer.open_stream(input_tokens, slots=slots, replica=replica)
    for layer in range(layers):
        if work_ms:
            torch.cuda._sleep(work_ms * GPU_CYCLES_PER_MS)
        for copies, pool in zip(pools, written[layer], strict=True):  # the prefill writes the layer
            copies[0][layer].copy_(pool)
        if stream is not None:
            await stream.put_layer()
    if stream is None:
        await producer.publish(input_tokens, slots, replica)
    else:
        await stream.finish()


WARM_UP = 99


def run_gpu_late_inserter(device: str, heartbeat_s: float, control: multiprocessing.connection.Connection) -> None:
    """A producer on `device` that, on ("insert", index, tokens, milliseconds), queues that much
    GPU work and then an item (its KV written after the work; its tokens on the host, so the
    insert reads nothing back): the item is buffered, and delivered, long before its bytes
    are written. Answers "inserted" at once; "sync" is answered "synced" once the GPU's work
    is done. It first inserts item `WARM_UP` (16 tokens),
    written at once: the kernels an insert runs are loaded then, since loading a module
    waits for the whole GPU, and the loop would stop answering heartbeats meanwhile."""

    async def main() -> None:
        torch.cuda.set_device(device)
        async with kvrt.Producer(device=device, heartbeat_s=heartbeat_s, buffer_bytes=1 << 40) as producer:
            _, key, value, hidden = kv_item(WARM_UP, 16, torch.bfloat16, device)
            await producer.insert(kv_tokens(WARM_UP, 16), None, key, value, hidden)
            torch.cuda.synchronize(device)
            control.send(producer.endpoint)
            while (command := await asyncio.to_thread(_receive, control)) not in (None, "stop"):
                if command == "sync":  # answered once the GPU's work is done
                    await asyncio.to_thread(torch.cuda.synchronize, device)
                    control.send("synced")
                    continue
                _, index, tokens, work_ms = command
                torch.cuda._sleep(work_ms * GPU_CYCLES_PER_MS)
                _, key, value, hidden = kv_item(index, tokens, torch.bfloat16, device)
                await producer.insert(kv_tokens(index, tokens), None, key, value, hidden)
                control.send("inserted")

    asyncio.run(main())


def run_gpu_ipc_reader(
    endpoint: str, device: str, heartbeat_s: float, control: multiprocessing.connection.Connection
) -> None:
    """Read a stream over cuda_ipc whose prefill the parent kills before it wrote a layer.
    First reads a one-layer stream whole (reporting ("warming",) when it waits for it): the
    prefill's first put_layer of a kind of columns (their alignment and strides, which follow
    the stream's index: see `_columns`) loads its copy kernel's module, which waits for the
    whole GPU, so the stream that dies must not be the first of its kind: the warm-up, 3, has
    the columns of the stream that dies, 0. Then reports ("opened",); ("reading",
    whether layer 0 was handed out and landed, 0.5 s after the stream opened); ("lost", error
    type name, seconds from "killed" to the error); ("layer 0", its error type name, or
    "handed out"); ("device works", whether a new kernel and a synchronize of the whole device
    returned within 5 s); ("closed", seconds to close)."""
    import time

    async def main() -> None:
        torch.cuda.set_device(device)
        consumer = kvrt.Consumer(connect=endpoint, device=device, heartbeat_s=heartbeat_s, transport="cuda_ipc")
        async with consumer:
            for index, said in ((3, "warming"), (0, "opened")):
                opening = asyncio.create_task(consumer.open_stream(kv_tokens(index, 256), timeout=30))
                await asyncio.sleep(0)
                await caught_up(consumer)  # the request is in
                control.send((said,))
                if said == "warming":
                    warm = await opening
                    assert warm is not None
                    await warm.finished()
            reader = await opening
            assert reader is not None
            layer_0 = asyncio.create_task(reader.layer_event(0))
            # Its copy waits for the producer's mark: 0.5 s of the 3 s of work. Not landed: not
            # handed out, or handed out with an event that has not fired.
            await asyncio.wait({layer_0}, timeout=0.5)
            landed = layer_0.result() if layer_0.done() else None
            control.send(("reading", landed is not None and landed.query()))
            assert await asyncio.to_thread(_receive, control) == "killed"
            killed_at = time.monotonic()
            try:
                await reader.finished()
                control.send(("lost", "none", time.monotonic() - killed_at))
            except kvrt.KVRTError as error:
                control.send(("lost", type(error).__name__, time.monotonic() - killed_at))
            try:
                await layer_0
                control.send(("layer 0", "handed out"))
            except kvrt.KVRTError as error:
                control.send(("layer 0", type(error).__name__))
            # Nothing of this process waits on the dead producer on the GPU: what waits for the
            # whole device (a new kernel's module load, a synchronize) still returns.
            small = torch.ones(4, device=device)
            works = await asyncio.to_thread(
                _finishes_within, lambda: (small.sum().item(), torch.cuda.synchronize()), 5.0
            )
            control.send(("device works", works))
            closing_at = time.monotonic()
        control.send(("closed", time.monotonic() - closing_at))

    asyncio.run(main())


def _finishes_within(work: Any, seconds: float) -> bool:
    import threading

    done = threading.Event()

    def run() -> None:
        work()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds)
