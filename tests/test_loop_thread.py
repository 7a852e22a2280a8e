"""kvrt's loop thread (`kvrt._loop_thread.LoopThread`): a post returns at once whatever the loop
is doing, posts run in order, and stopping the loop ends every pending one with an error."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvrt._errors import ClosedError
from kvrt._loop_thread import LoopThread

BOUND_S = 5.0


def busy_loop(loop: LoopThread) -> tuple[threading.Event, threading.Event]:
    """Hold the loop's thread in a callback until the returned gate is set (a long callback, or
    a thread that waits for the GIL): (entered, gate)."""
    entered, gate = threading.Event(), threading.Event()

    async def hold() -> None:
        entered.set()
        gate.wait(BOUND_S)

    loop.post(hold, "hold")
    assert entered.wait(BOUND_S)
    return entered, gate


def test_a_post_returns_while_the_loops_thread_is_held_and_runs_once_it_is_free() -> None:
    loop = LoopThread("kvrt-test-loop", "test loop")
    try:
        _, gate = busy_loop(loop)
        started = time.monotonic()
        posted = loop.post(lambda: asyncio.sleep(0, result=7), "seven")
        assert time.monotonic() - started < 0.1 and not posted.done()
        gate.set()
        assert posted.result(BOUND_S) == 7
    finally:
        loop.stop()


def test_posts_run_in_the_order_they_were_posted() -> None:
    loop = LoopThread("kvrt-test-loop", "test loop")
    ran: list[int] = []

    def step(index: int) -> concurrent.futures.Future[None]:
        async def run() -> None:
            ran.append(index)

        return loop.post(run, f"step {index}")

    try:
        _, gate = busy_loop(loop)
        futures = [step(index) for index in range(100)]
        gate.set()
        for future in futures:
            future.result(BOUND_S)
        assert ran == list(range(100))
    finally:
        loop.stop()


def test_a_posts_error_reaches_its_caller_and_the_loop_goes_on() -> None:
    loop = LoopThread("kvrt-test-loop", "test loop")

    async def fail() -> None:
        raise ValueError("from the loop")

    try:
        with pytest.raises(ValueError, match="from the loop"):
            loop.post(fail, "fail").result(BOUND_S)
        assert loop.post(lambda: asyncio.sleep(0, result=1), "after").result(BOUND_S) == 1
    finally:
        loop.stop()


def test_stopping_the_loop_ends_a_pending_post_and_refuses_later_ones_with_closed_error() -> None:
    loop = LoopThread("kvrt-test-loop", "test loop")
    pending = loop.post(lambda: asyncio.sleep(3600), "for ever")
    loop.stop()
    with pytest.raises(ClosedError):
        pending.result(BOUND_S)
    with pytest.raises(ClosedError):
        loop.post(lambda: asyncio.sleep(0), "late").result(BOUND_S)


def test_torchs_host_operations_on_kvrts_thread_run_on_it_alone_and_the_callers_keep_their_team() -> None:
    # A copy split over torch's OpenMP team waits at its barrier for the engine's threads,
    # which a busy host does not schedule: kvrt's own threads keep their copies to themselves.
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    loop = LoopThread("kvrt-test-loop", "test loop")
    try:

        async def threads() -> int:
            return torch.get_num_threads()

        assert loop.call(threads, "threads", timeout_s=BOUND_S) == 1
        assert torch.get_num_threads() == 2
        assert _in_a_new_thread(torch.get_num_threads) == 2
    finally:
        loop.stop()
        torch.set_num_threads(previous)


def _in_a_new_thread(function: Callable[[], int]) -> int:
    results: list[int] = []
    thread = threading.Thread(target=lambda: results.append(function()))
    thread.start()
    thread.join(BOUND_S)
    return results[0]
