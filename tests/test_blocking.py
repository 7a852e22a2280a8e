"""`kvrt.blocking`: the embedded API for synchronous engines, called from plain threads that
have no event loop of their own, many at once, over real sockets."""

from __future__ import annotations

import asyncio
import gc
import inspect
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import zmq

import kvrt
import kvrt.blocking
from tests._gpus import one_gpu
from tests.conftest import make_kv

JOIN_S = 30.0
"""How long a test waits for a thread it started (a bound, not an ordering)."""


def kvrt_threads() -> list[threading.Thread]:
    return [
        thread for thread in threading.enumerate() if thread.name in ("kvrt-producer", "kvrt-consumer", "kvrt-client")
    ]


@pytest.fixture(autouse=True)
def no_kvrt_thread_left() -> Iterator[None]:
    before = set(kvrt_threads())
    yield
    left = [thread for thread in kvrt_threads() if thread not in before]
    assert not left, f"kvrt threads still running after the test: {left}"


@pytest.fixture
def producer() -> Iterator[kvrt.blocking.Producer]:
    with kvrt.blocking.Producer() as started:
        yield started


@pytest.fixture
def consumer(producer: kvrt.blocking.Producer) -> Iterator[kvrt.blocking.Consumer]:
    with kvrt.blocking.Consumer(connect=producer.endpoint) as started:
        yield started


def insert(producer: kvrt.blocking.Producer, tokens: torch.Tensor, *, seed: int = 0, **options: Any) -> None:
    key, value, hidden = make_kv(tokens, seed=seed)
    producer.insert(tokens, None, key, value, hidden, **options)


def entered(side: kvrt.blocking.Producer | kvrt.blocking.Consumer, method: str, count: int) -> threading.Event:
    """An event set once `count` calls of the async side's `method` have started on kvrt's
    loop (the calls are then waiting there, or about to)."""
    service = side._service  # type: ignore[attr-defined]
    original = getattr(service, method)
    reached = threading.Event()
    started = 0

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal started
        started += 1
        if started == count:
            reached.set()
        return await original(*args, **kwargs)

    setattr(service, method, counted)
    return reached


def run_in_threads(count: int, call: Callable[[int], Any]) -> list[Any]:
    """`call(i)` for i in range(count), each in its own thread, started together; what each
    returned or raised."""
    barrier = threading.Barrier(count)

    def each(index: int) -> Any:
        barrier.wait(JOIN_S)
        try:
            return call(index)
        except BaseException as error:  # the outcome under test
            return error

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(each, range(count), timeout=JOIN_S))


def same_parameters(sync: Callable[..., Any], asynchronous: Callable[..., Any]) -> bool:
    def described(call: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(call).parameters.values()]

    return described(sync) == described(asynchronous)


def test_the_blocking_sides_take_the_async_sides_constructor_arguments() -> None:
    assert same_parameters(kvrt.blocking.Producer, kvrt.Producer)
    assert same_parameters(kvrt.blocking.Consumer, kvrt.Consumer)
    assert same_parameters(kvrt.blocking.Client, kvrt.Client)


@pytest.mark.parametrize(
    ("sync", "asynchronous"),
    [
        (kvrt.blocking.Producer.insert, kvrt.Producer.insert),
        (kvrt.blocking.Producer.publish, kvrt.Producer.publish),
        (kvrt.blocking.Producer.open_stream, kvrt.Producer.open_stream),
        (kvrt.blocking.Producer.register_pools, kvrt.Producer.register_pools),
        (kvrt.blocking.ProducerStream.put_layer, kvrt.ProducerStream.put_layer),
        (kvrt.blocking.ProducerStream.put_layers, kvrt.ProducerStream.put_layers),
        (kvrt.blocking.ProducerStream.finish, kvrt.ProducerStream.finish),
        (kvrt.blocking.ProducerStream.abort, kvrt.ProducerStream.abort),
        (kvrt.blocking.Consumer.drop_select, kvrt.Consumer.drop_select),
        (kvrt.blocking.Consumer.drop_select_many, kvrt.Consumer.drop_select_many),
        (kvrt.blocking.Consumer.pull, kvrt.Consumer.pull),
        (kvrt.blocking.Consumer.open_stream, kvrt.Consumer.open_stream),
        (kvrt.blocking.ConsumerStream.layer, kvrt.ConsumerStream.layer),
        (kvrt.blocking.Client.probe, kvrt.Client.probe),
        (kvrt.blocking.Client.stats, kvrt.Client.stats),
        (kvrt.blocking.Client.list_items, kvrt.Client.list_items),
        (kvrt.blocking.Client.evict, kvrt.Client.evict),
    ],
    ids=lambda call: call.__qualname__,
)
def test_every_operation_takes_the_async_operations_arguments_as_a_plain_method(
    sync: Callable[..., Any], asynchronous: Callable[..., Any]
) -> None:
    assert same_parameters(sync, asynchronous)
    assert not inspect.iscoroutinefunction(sync)


def test_an_item_inserted_from_one_plain_thread_is_taken_from_another(producer: kvrt.blocking.Producer) -> None:
    tokens = torch.arange(16)
    key, value, hidden = make_kv(tokens)

    def prefill() -> None:
        with pytest.raises(RuntimeError):
            asyncio.get_running_loop()  # a plain thread: no loop of its own
        producer.insert(tokens, None, key, value, hidden)

    def decode() -> kvrt.KVItem | None:
        with kvrt.blocking.Consumer(connect=producer.endpoint) as consumer:
            return consumer.drop_select(tokens[:10], None, timeout=None)

    with ThreadPoolExecutor(max_workers=2) as pool:
        taken = pool.submit(decode)
        pool.submit(prefill).result(JOIN_S)
        item = taken.result(JOIN_S)
    assert item is not None and item.matched == 10
    assert torch.equal(item.key, key) and torch.equal(item.value, value) and torch.equal(item.hidden, hidden)  # type: ignore[arg-type]


def test_fifty_threads_waiting_at_once_each_get_their_own_item(
    producer: kvrt.blocking.Producer, consumer: kvrt.blocking.Consumer
) -> None:
    def call(index: int) -> Any:
        if index % 2:  # half the threads insert, the other half wait for what they insert
            insert(producer, torch.arange(8) + 100 * index, seed=index)
            return None
        item = consumer.drop_select(torch.arange(8) + 100 * (index + 1), None, timeout=None)
        return None if item is None else int(item.input_tokens[0])

    outcomes = run_in_threads(100, call)
    assert outcomes[0::2] == [100 * (index + 1) for index in range(0, 100, 2)]
    assert producer.stats().items == 0


def test_close_from_another_thread_ends_fifty_waiting_calls_with_closed_error(
    producer: kvrt.blocking.Producer,
) -> None:
    consumer = kvrt.blocking.Consumer(connect=producer.endpoint)
    waiting = entered(consumer, "drop_select", 50)
    closer = threading.Thread(target=lambda: (waiting.wait(JOIN_S), consumer.close()))
    closer.start()
    outcomes = run_in_threads(50, lambda index: consumer.drop_select(torch.tensor([index, -1]), None, timeout=None))
    closer.join(JOIN_S)
    assert waiting.is_set()
    assert all(isinstance(outcome, kvrt.ClosedError) for outcome in outcomes), outcomes


def test_close_ends_an_insert_waiting_for_room_with_closed_error() -> None:
    producer = kvrt.blocking.Producer(buffer_bytes=64)
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            insert(producer, torch.arange(16))  # over the limit from now on: the next insert waits
            waiting = entered(producer, "insert", 1)
            blocked = pool.submit(insert, producer, torch.arange(16, 32))
            assert waiting.wait(JOIN_S)
        finally:
            producer.close()
        with pytest.raises(kvrt.ClosedError):
            blocked.result(JOIN_S)


def test_calls_after_close_raise_closed_error_on_both_sides(producer: kvrt.blocking.Producer) -> None:
    consumer = kvrt.blocking.Consumer(connect=producer.endpoint)
    consumer.close()
    with pytest.raises(kvrt.ClosedError, match="consumer is closed"):
        consumer.drop_select(torch.arange(4))
    producer.close()
    with pytest.raises(kvrt.ClosedError, match="producer is closed"):
        insert(producer, torch.arange(4))
    with pytest.raises(kvrt.ClosedError):
        producer.stats()


def test_close_twice_and_from_two_threads_at_once_returns_in_each(producer: kvrt.blocking.Producer) -> None:
    consumer = kvrt.blocking.Consumer(connect=producer.endpoint)
    outcomes = run_in_threads(2, lambda _: consumer.close())
    assert outcomes == [None, None]
    consumer.close()


def test_timeouts_raise_the_async_apis_typed_errors_in_the_calling_thread() -> None:
    with kvrt.blocking.Producer(buffer_bytes=64) as producer, kvrt.blocking.Consumer(producer.endpoint) as consumer:
        assert consumer.drop_select(torch.arange(4), None, timeout=0.05) is None
        insert(producer, torch.arange(16))
        with pytest.raises(kvrt.KVRTTimeoutError) as caught:
            insert(producer, torch.arange(16, 32), timeout=0.05)
        assert caught.value.phase == "insert"


def test_bad_input_is_refused_in_the_calling_thread_and_the_side_stays_usable(
    producer: kvrt.blocking.Producer, consumer: kvrt.blocking.Consumer
) -> None:
    with pytest.raises(kvrt.InvalidInputError, match="input_tokens must be a 1-D integer tensor"):
        consumer.drop_select(torch.arange(4.0))
    insert(producer, torch.arange(4))
    assert consumer.drop_select(torch.arange(4)) is not None


def test_a_constructor_that_cannot_connect_raises_and_leaves_no_thread() -> None:
    context = zmq.Context()
    placeholder = context.socket(zmq.ROUTER)  # a port nobody answers on
    port = placeholder.bind_to_random_port("tcp://127.0.0.1")
    placeholder.close()
    context.term()
    with pytest.raises(kvrt.KVRTTimeoutError, match="no producer answered"):
        kvrt.blocking.Consumer(connect=f"tcp://127.0.0.1:{port}", connect_timeout_s=0.2)
    with pytest.raises(kvrt.InvalidInputError, match="has no scheme"):
        kvrt.blocking.Producer(bind="127.0.0.1:0")


def test_a_producer_dropped_without_close_is_closed_by_the_garbage_collector() -> None:
    producer = kvrt.blocking.Producer()
    thread = producer._loop._thread  # type: ignore[attr-defined]
    socket = producer._service._socket  # type: ignore[attr-defined]
    del producer
    gc.collect()
    thread.join(JOIN_S)
    assert not thread.is_alive() and socket.closed


def test_streams_go_layer_by_layer_between_plain_threads(
    producer: kvrt.blocking.Producer, consumer: kvrt.blocking.Consumer
) -> None:
    tokens = torch.arange(6)
    layers = [(torch.full((6, 2, 4), float(layer)), torch.full((6, 2, 4), -float(layer))) for layer in range(3)]
    stream = producer.open_stream(tokens, layers=3)
    stream.put_layer(*layers[0])
    reader = consumer.open_stream(tokens, timeout=None)
    assert reader is not None and reader.matched == 6
    key, value = reader.layer(0)
    assert torch.equal(key, layers[0][0]) and torch.equal(value, layers[0][1])
    for layer in layers[1:]:
        stream.put_layer(*layer)
    stream.finish(torch.ones(6, 8))
    assert [int(key[0, 0, 0]) for _, key, _ in reader] == [0, 1, 2]
    hidden = reader.finished()
    assert hidden is not None and torch.equal(hidden, torch.ones(6, 8))


def test_a_thread_interrupted_while_it_waits_cancels_its_own_call() -> None:
    # In a process of its own: an interrupt is delivered to the main thread of a process.
    script = textwrap.dedent(
        """
        import os, signal, threading, torch, kvrt.blocking

        # Python's own Ctrl-C handling, as a program started from a terminal has it: a child of
        # a background job (a CI runner's) may inherit SIGINT ignored, and then never hears it.
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def interrupt():
            # Ctrl-C as soon as the call runs on kvrt's loop: the main thread may still be in
            # the portal's hand-over of the call, or already waiting for its result.
            os.kill(os.getpid(), signal.SIGINT)

        with kvrt.blocking.Producer() as producer, kvrt.blocking.Consumer(producer.endpoint) as consumer:
            service = consumer._service
            original = service.drop_select
            for trial in range(20):
                ended = threading.Event()

                async def waiting(*args, **kwargs):
                    threading.Thread(target=interrupt).start()
                    try:
                        return await original(*args, **kwargs)
                    finally:
                        ended.set()

                service.drop_select = waiting
                try:
                    consumer.drop_select(torch.arange(4), None, timeout=None)
                except KeyboardInterrupt:
                    pass
                else:
                    raise AssertionError("the call returned although nothing was inserted")
                assert ended.wait(10), f"trial {trial}: the call went on waiting on kvrt's loop"
                assert consumer.pending_requests == 0, f"trial {trial}: {consumer.pending_requests} pending"
            print("interrupted 20 times, nothing pending")
        print("closed")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["interrupted 20 times, nothing pending", "closed"]


@one_gpu
def test_an_insert_from_an_engine_thread_reads_what_a_long_kernel_on_its_side_stream_wrote() -> None:
    from tests._gpu_processes import GPU_CYCLES_PER_MS

    device = torch.device("cuda:0")
    tokens = torch.arange(64)
    with (
        kvrt.blocking.Producer(device=device, transport="tcp") as producer,
        kvrt.blocking.Consumer(connect=producer.endpoint, transport="tcp") as consumer,
    ):
        key = torch.zeros((2, 64, 4, 128), device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # after the zeros
        with torch.cuda.stream(side):  # the engine's compute stream, not the default one
            torch.cuda._sleep(200 * GPU_CYCLES_PER_MS)  # a long kernel before the write
            key.fill_(7.0)
            producer.insert(tokens, None, key, key, None)  # stream= defaults to `side`, captured here
        item = consumer.drop_select(tokens)
        assert item is not None and bool((item.key == 7.0).all())


def test_a_blocking_client_probes_and_evicts_what_a_plain_thread_inserted(producer: kvrt.blocking.Producer) -> None:
    tokens = torch.arange(16)
    key, value, hidden = make_kv(tokens)
    producer.insert(tokens, None, key, value, hidden)
    with kvrt.blocking.Client(producer.endpoint) as client:
        found = client.probe(tokens[:10])
        assert found.matched == 10 and found.item_id is not None
        assert client.stats().items == 1
        client.evict(found.item_id)
        assert client.probe(tokens).matched == 0
        with pytest.raises(kvrt.NotFoundError):
            client.evict(found.item_id)
    with pytest.raises(kvrt.ClosedError):
        client.probe(tokens)
