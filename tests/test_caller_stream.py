"""`stream=`: a call's GPU work is ordered on the caller's stream. What holds without a GPU:
each step of a call runs inside its own context and no other task's step does, the argument
is checked, and every call that reads or writes GPU memory takes it (the GPU behaviour is in
tests/test_blocking.py, marked gpu)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import kvrt
from kvrt._caller_stream import caller_stream, steps_on
from tests.conftest import make_kv

_marks = threading.local()


def inside() -> bool:
    return getattr(_marks, "inside", False)


@contextlib.contextmanager
def marked() -> Iterator[None]:
    """Stands for `torch.cuda.stream(s)`: a setting of the thread, entered and left."""
    before = inside()
    _marks.inside = True
    try:
        yield
    finally:
        _marks.inside = before


async def test_every_step_of_a_call_runs_inside_its_context_and_no_step_of_another_task_does() -> None:
    turn = asyncio.Event()
    seen_by_call: list[bool] = []
    seen_by_other: list[bool] = []

    async def call() -> str:
        seen_by_call.append(inside())
        await turn.wait()  # the other task runs while this one is suspended
        seen_by_call.append(inside())
        await asyncio.sleep(0)
        seen_by_call.append(inside())
        return "done"

    async def other() -> None:
        seen_by_other.append(inside())
        turn.set()
        await asyncio.sleep(0)
        seen_by_other.append(inside())

    stepped = asyncio.create_task(steps_on(call(), marked))
    await asyncio.sleep(0)
    await other()
    assert await stepped == "done"
    assert seen_by_call == [True, True, True]
    assert seen_by_other == [False, False]
    assert not inside()


async def test_a_cancelled_call_sees_its_cancellation_inside_its_context() -> None:
    seen: list[bool] = []

    async def waits_for_ever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(inside())
            raise

    stepped = asyncio.create_task(steps_on(waits_for_ever(), marked))
    await asyncio.sleep(0)
    stepped.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stepped
    assert seen == [True] and not inside()


async def test_an_error_of_a_stepped_call_reaches_its_caller() -> None:
    async def fails() -> None:
        await asyncio.sleep(0)
        raise kvrt.CapacityError("full")

    with pytest.raises(kvrt.CapacityError, match="full"):
        await steps_on(fails(), marked)
    assert not inside()


def test_a_stream_that_is_not_a_cuda_stream_is_refused() -> None:
    with pytest.raises(kvrt.InvalidInputError, match=r"stream must be a torch\.cuda\.Stream or None"):
        caller_stream("stream 7", torch.device("cpu"))


def test_a_cpu_call_given_no_stream_runs_on_none() -> None:
    assert caller_stream(None, torch.device("cpu")) is None


async def test_insert_refuses_a_stream_that_is_not_a_cuda_stream(producer: kvrt.Producer) -> None:
    """Refused before the insert starts, and the insert that never ran is closed, not left to
    be reported as never awaited."""
    tokens = torch.arange(4)
    key, value, hidden = make_kv(tokens)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(kvrt.InvalidInputError, match="stream must be"):
            await producer.insert(tokens, None, key, value, hidden, stream=object())  # type: ignore[arg-type]
        gc.collect()
    assert not [warning for warning in caught if "never awaited" in str(warning.message)]
    assert producer.stats().items == 0


GPU_CALLS: list[Callable[..., Any]] = [
    kvrt.Producer.insert,
    kvrt.Producer.publish,
    kvrt.Producer.open_stream,
    kvrt.ProducerStream.put_layer,
    kvrt.ProducerStream.finish,
    kvrt.Consumer.drop_select,
    kvrt.Consumer.drop_select_many,
    kvrt.Consumer.pull,
    kvrt.Consumer.open_stream,
    kvrt.ConsumerStream.layer,
]


@pytest.mark.parametrize("call", GPU_CALLS, ids=lambda call: call.__qualname__)
def test_every_call_that_reads_or_writes_gpu_memory_takes_a_keyword_stream(call: Callable[..., Any]) -> None:
    parameter = inspect.signature(call).parameters["stream"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None
    assert inspect.iscoroutinefunction(call)
