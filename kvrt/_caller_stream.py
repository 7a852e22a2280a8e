"""The CUDA stream a call's GPU work is ordered on: the caller's.

Every call that reads or writes GPU memory takes `stream=` (`Producer.insert`, `publish`,
`open_stream`, `ProducerStream.put_layer` and `finish`, `Consumer.drop_select`,
`drop_select_many`, `pull`, `open_stream`, `ConsumerStream.layer`). None means the current
stream, on the call's device, of the thread that made the call, captured when the call
starts running: for `await producer.insert(...)` that is where it is written; for a call
wrapped in a task, the task's first step (pass `stream=` to `asyncio.create_task(...)`'s
call if the current stream changes before then). `kvrt.blocking` captures it on the
engine's thread, before the call crosses to the thread that runs kvrt's loop, whose
current stream is not the engine's.

A call takes many steps on the loop (it awaits room, a reply, a worker thread), and the
loop runs other calls' steps in between. CUDA's current stream is a setting of the thread,
not of the call: `steps_on` makes the call's stream current around each of its steps and
puts the thread's own back before the loop runs anything else. So what the call allocates,
copies and records (a buffered item's ready event, a gather, a scatter) is ordered after
the caller's work on its stream, and no other call, nor kvrt's own tasks, ever sees it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Concatenate, ParamSpec, Protocol, TypeAlias, TypeVar

import torch

from kvrt._errors import InvalidInputError

Enter: TypeAlias = Callable[[], contextlib.AbstractContextManager[Any]]
"""What `steps_on` enters around each step of a coroutine (`torch.cuda.stream(s)`, bound)."""

_P = ParamSpec("_P")
_T = TypeVar("_T")


class OnDevice(Protocol):
    """What has a device: a producer, a consumer, a producer's stream."""

    @property
    def device(self) -> torch.device: ...


_Self = TypeVar("_Self", bound=OnDevice)


def caller_stream(stream: object, device: torch.device) -> torch.cuda.Stream | None:
    """The stream a call on `device` is ordered on: `stream` if given (checked), else the
    calling thread's current stream on a CUDA `device`; None for a CPU device given none."""
    if stream is not None:
        if not isinstance(stream, torch.cuda.Stream):
            raise InvalidInputError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
        if device.type == "cuda" and stream.device != _indexed(device):
            raise InvalidInputError(f"stream is on {stream.device}, the call's device is {device}")
        return stream
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device)


def _indexed(device: torch.device) -> torch.device:
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class _Steps:
    """Awaits a coroutine with `enter()` entered around each of its steps (each resumption,
    up to its next suspension), and only then."""

    __slots__ = ("_coroutine", "_enter")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], enter: Enter) -> None:
        self._coroutine = coroutine
        self._enter = enter

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, enter = self._coroutine, self._enter
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                with enter():
                    if thrown is None:
                        suspended_on = coroutine.send(sent)
                    else:
                        error, thrown = thrown, None
                        suspended_on = coroutine.throw(error)
            except StopIteration as returned:
                return returned.value
            try:
                sent = yield suspended_on  # what the loop waits on (a future), as it was given
            except BaseException as error:  # thrown into the awaiting task (a cancellation): passed on
                sent, thrown = None, error


def steps_on(coroutine: Coroutine[Any, Any, _T], enter: Enter) -> Coroutine[Any, Any, _T]:
    """`coroutine`, run with `enter()` entered around each of its steps."""

    async def stepped() -> _T:
        result: _T = await _Steps(coroutine, enter)
        return result

    return stepped()


def run_on_caller_stream(
    call: Coroutine[Any, Any, _T], device: torch.device, stream: object, *, lands: bool = False
) -> Coroutine[Any, Any, _T]:
    """`call` (a call's coroutine, not started) with every step run on the caller's stream
    (`caller_stream(stream, device)`, captured now: await this where the call starts). On a
    CPU device given no stream, `call` itself: no frame of this module stays on the call's
    stack. `lands`: for a call whose result lands in GPU memory, once it returns the caller's
    stream also waits, on the GPU, for what kvrt's own tasks queued meanwhile on the loop
    thread's stream (an item that came over TCP is copied to the device by its link's task);
    the host never waits."""
    try:
        current = caller_stream(stream, device)
    except BaseException:
        call.close()  # never started: closed, so that it is not reported as never awaited
        raise
    if current is None:
        return call
    stepped = steps_on(call, functools.partial(torch.cuda.stream, current))
    if not (lands and device.type == "cuda"):
        return stepped
    return _landed(stepped, current, device)


async def _landed(stepped: Coroutine[Any, Any, _T], stream: torch.cuda.Stream, device: torch.device) -> _T:
    result = await stepped
    stream.wait_stream(torch.cuda.current_stream(device))
    return result


def on_caller_stream(
    method: Callable[Concatenate[_Self, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[_Self, _P], Coroutine[Any, Any, _T]]:
    """For a method with a keyword `stream=` that does its work itself: every step of the call
    runs with the caller's stream current (`run_on_caller_stream`, the stream captured when the
    call starts)."""

    @functools.wraps(method)
    async def on_stream(self: _Self, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return await run_on_caller_stream(method(self, *args, **kwargs), self.device, kwargs.get("stream"))

    return on_stream
