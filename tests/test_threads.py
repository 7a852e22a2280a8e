"""kvrt's threads: the transfer waiter's blocking waits run in order on one kvrt thread and
resolve on the loop; each thread carries its name for the OS."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvrt._loop_thread import LoopThread
from kvrt._threads import WaitThread, host_worker


async def test_waits_run_in_order_and_each_resolves_once_it_returned() -> None:
    waiter = WaitThread("kvrt-test-waiter")
    ran: list[int] = []
    started, gate = threading.Event(), threading.Event()
    try:
        first = waiter.wait(lambda: (started.set(), gate.wait(5), ran.append(1)))
        second = waiter.wait(lambda: ran.append(2))
        assert await asyncio.to_thread(started.wait, 5)
        # The first wait is held at its gate: the second has not run, neither is done.
        assert not first.done() and not second.done() and ran == []
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert ran == [1, 2]
    finally:
        waiter.close()


async def test_a_failing_wait_fails_its_future_and_the_next_waits_still_run() -> None:
    waiter = WaitThread("kvrt-test-waiter")

    def fail() -> None:
        raise RuntimeError("NCCL error: remote process exited")

    try:
        failed, after = waiter.wait(fail), waiter.wait(lambda: None)
        with pytest.raises(RuntimeError, match="remote process exited"):
            await asyncio.wait_for(failed, 5)
        assert await asyncio.wait_for(after, 5) is None
    finally:
        waiter.close()


async def test_what_a_wait_holds_is_freed_on_the_waiting_thread() -> None:
    waiter = WaitThread("kvrt-test-waiter")
    freed_on: list[str] = []

    class Work:  # stands for an NCCL work, whose release takes the GIL back from C++
        def __del__(self) -> None:
            freed_on.append(threading.current_thread().name)

    def wait_then_drop(work: Work) -> Callable[[], None]:
        held = [work]
        return held.clear  # as a receive's wait drops its works once they completed

    done = waiter.wait(wait_then_drop(Work()))
    try:
        await asyncio.wait_for(done, 5)
        assert freed_on == ["kvrt-test-waiter"]
    finally:
        waiter.close()


async def test_a_closed_waiter_finishes_what_was_queued_and_refuses_more() -> None:
    waiter = WaitThread("kvrt-test-waiter")
    queued = waiter.wait(lambda: None)
    waiter.close()
    assert await asyncio.wait_for(queued, 5) is None
    with pytest.raises(RuntimeError, match="closed"):
        await waiter.wait(lambda: None)


@pytest.mark.skipif(not Path("/proc/thread-self/comm").exists(), reason="Linux names threads in /proc")
def test_kvrts_threads_carry_their_names_for_the_os_as_top_and_ps_show_them() -> None:
    # An operator reading `top -H` of an engine's process sees which of kvrt's threads takes
    # a core, not a row of "python".
    def os_name(thread: threading.Thread) -> str:
        return Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()

    loop = LoopThread("kvrt-named-loop", "named loop")
    gather = host_worker("kvrt-gather")
    try:
        assert os_name(loop._thread) == "kvrt-named-loop"
        gathered = gather.submit(threading.current_thread).result(10)
        assert os_name(gathered) == "kvrt-gather_0"
    finally:
        loop.stop()
        gather.shutdown()
