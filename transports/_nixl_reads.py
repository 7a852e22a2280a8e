"""NIXL READs on the consumer's side: one READ per delivery posted from the loop when small,
else by its session's waiter thread, which asks NIXL until it ended (see
`kvrt.transports.nixl`'s docstring, "How a transfer goes" and "Failures")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, TypeVar

import numpy as np
import torch

from kvrt._errors import IntegrityError, PeerLostError, RemoteProtocolError
from kvrt._threads import WaitThread
from kvrt.transports._base import InPlace
from kvrt.transports._nixl_agent import Agent, AgentError, Registration, Transfer, TransferState

log = logging.getLogger("kvrt.transports")

_T = TypeVar("_T")
POST_ON_LOOP_BYTES: Final = 1 << 20
"""READs up to this size are posted from the loop (`cma` finishes one inside the call, in a
few microseconds a 64 KiB); larger ones from the waiter thread, so the loop never copies."""
READ_PART_BYTES: Final = 8 << 20
"""The most one READ between host memories moves: a larger one is made as parts of this size,
posted one after the other. UCX's `cma` copies inside the call that posts a READ, holding the
agent's lock (NIXL's thread-safe mode locks every call), so any call of the loop's (another
READ made, a registration) waits for the copy under way: a part's, a few ms, not an item's
(a 256 MiB one stalled the loop for up to 250 ms). Parts of 4 MiB cost large items a third of
their rate on a 2-core host; 8 MiB ones, a few percent. Between GPUs a post only queues the
copy."""
UNCANCELLED_WAIT_S: Final = 60.0
"""How long a READ NIXL refused to cancel is waited for before it is left to the agent."""
_FIRST_PAUSE_S: Final = 20e-6
_LONGEST_PAUSE_S: Final = 1e-3


def translated(exc: AgentError, what: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"nixl: {what}: {exc}")


@dataclass(eq=False)
class ReadSession:
    """The consumer's side of one welcome: the producer's agent as loaded, where its memory
    lives, and the thread that waits for this session's READs."""

    remote: str
    remote_device: torch.device
    waiter: WaitThread
    queued: int = 0
    """READs handed to the waiter and not ended yet (a READ posted from the loop behind
    them would wait for the agent's lock)."""
    abandoned: bool = False
    """Set by `abandon` (on the loop), read by the waiter between asks."""
    loaded: set[bytes] = field(default_factory=set)
    """Region metadata loaded already (a frame repeats none, but a stray one costs nothing)."""



def post_reads(
    agent: Agent,
    device: torch.device,
    session: ReadSession,
    ranges: list[tuple[int, int, int]] | np.ndarray,
    payload: torch.Tensor,
    registration: Registration | None,
    result: _T,
    *,
    in_place: InPlace | None = None,
    check: Callable[[], None] | None = None,
) -> asyncio.Future[_T]:
    """READ `ranges` (local, remote, bytes) into `payload` (and the caller's memory of
    `in_place`, where they name it): a future done with `result` once they landed and
    `check` (of what landed: `IntegrityError`) passed, on the thread that saw them land. Small
    READs are posted here (most end inside the call), into kvrt's memory also while larger
    ones are under way (into the caller's, only with none queued: a cancelled call waits
    for a READ there that started, and one that did not end would wait behind others); the
    rest are posted and waited for by the session's waiter, which first waits for the
    caller's work on that memory, where that has not ended, and gives the READ up when
    told (`in_place.stop`). Between host memories a READ past `READ_PART_BYTES` is made
    as parts, posted in turn."""
    host = device.type == "cpu" and session.remote_device.type == "cpu"
    transfers: list[Transfer] = []
    try:
        for part in parts(ranges, READ_PART_BYTES) if host else [ranges]:
            transfers.append(agent.read(session.remote, part, local=device, peer=session.remote_device))
    except AgentError as exc:
        for transfer in transfers:
            released(transfer)
        if registration is not None:
            agent.deregister(registration)
        raise translated(exc, "the READ the producer described cannot be made") from None
    loop = asyncio.get_running_loop()
    posted = None
    ready = None if in_place is None else in_place.ready
    if ready is not None and ready.query():
        ready = None
    first = transfers[0]
    small = len(transfers) == 1 and first.nbytes <= POST_ON_LOOP_BYTES
    if small and ready is None and (in_place is None or session.queued == 0):
        try:
            posted = first.post() if in_place is None or in_place.may_write() else TransferState.FAILED
        except AgentError as exc:
            posted = TransferState.FAILED
            log.info("nixl: %s", exc)
        if posted is not TransferState.PENDING:
            if not first.release():  # an ended READ: NIXL has nothing to cancel
                first.abandon()
            if registration is not None:
                agent.deregister(registration)
            done: asyncio.Future[_T] = loop.create_future()
            if posted is not TransferState.DONE:
                done.set_exception(read_failed(session))
                return done
            try:
                if check is not None:
                    check()
            except IntegrityError as damaged:
                done.set_exception(damaged)
            else:
                done.set_result(result)
            return done

    def give_up() -> bool:
        return session.abandoned or (in_place is not None and in_place.stop)

    def post_all() -> list[TransferState]:
        """Post the parts in turn (the first maybe posted already), up to one that failed,
        or until told to give up."""
        states = [posted] if posted is not None else []
        for transfer in transfers[len(states) :]:
            if give_up():
                break
            if states:
                # NIXL's lock is not fair: taken again at once, a call of the loop's
                # waiting on it would wait out every part. This thread steps aside.
                time.sleep(0)
            states.append(transfer.post())
            if states[-1] is TransferState.FAILED:
                break
        return states

    def wait() -> None:
        state = TransferState.FAILED
        try:
            if ready is not None:
                ready.synchronize()  # the caller's work on that memory before the call
            # Not posted when the call ended before this READ's turn came.
            if posted is not None or in_place is None or in_place.may_write():
                states = post_all()
                if len(states) == len(transfers):
                    state = TransferState.DONE
                for transfer, posted_state in zip(transfers, states, strict=False):
                    if until_ended(transfer, give_up, deadline=None, state=posted_state) is not TransferState.DONE:
                        state = TransferState.FAILED
                        break
        except AgentError:
            state = TransferState.FAILED
        finally:
            for transfer in transfers:
                released(transfer)  # cancels a READ still in flight (an abandoned session's)
            if registration is not None:
                agent.deregister(registration)
            landing.clear()  # NIXL wrote into it until here: the region is reused only now
        if state is not TransferState.DONE:
            raise read_failed(session)
        if check is not None:
            check()

    landing = [payload]
    session.queued += 1
    waited = session.waiter.wait(wait, result)

    def ended(_: asyncio.Future[_T]) -> None:
        session.queued -= 1

    waited.add_done_callback(ended)
    return waited


_Ranges = list[tuple[int, int, int]] | np.ndarray


def parts(ranges: _Ranges, limit: int) -> list[_Ranges]:
    """`ranges` (local, remote, bytes) as lists of at most `limit` bytes each, in order (a
    range longer than that cut into pieces)."""
    if isinstance(ranges, list) and sum(nbytes for _, _, nbytes in ranges) <= limit:
        return [ranges]
    rows = np.asarray(ranges, dtype=np.int64).reshape(-1, 3)
    sizes = rows[:, 2]
    if int(sizes.sum()) <= limit:
        return [ranges]
    pieces = -(-sizes // limit)
    if int(pieces.max()) > 1:  # a range of `limit` bytes a row, the last one the rest
        first_of = np.repeat(np.cumsum(pieces) - pieces, pieces)
        offsets = (np.arange(int(pieces.sum())) - first_of) * limit
        rows = np.repeat(rows, pieces, axis=0)
        rows[:, 0] += offsets
        rows[:, 1] += offsets
        rows[:, 2] = np.minimum(limit, rows[:, 2] - offsets)
    ends = np.cumsum(rows[:, 2])
    cuts, start, taken = [], 0, 0
    while start < len(rows):  # one pass a part: the rows up to the last that still fits
        start = max(start + 1, int(np.searchsorted(ends, taken + limit, side="right")))
        cuts.append(start)
        taken = int(ends[start - 1])
    parts: list[_Ranges] = list(np.split(rows, cuts[:-1]))
    return parts



def released(transfer: Transfer) -> None:
    """On a kvrt thread: release `transfer`, cancelling it if in flight. Where NIXL refuses the
    cancel, the READ may still be writing (into the arena, or the caller's memory): wait for
    it to end (`UNCANCELLED_WAIT_S` at most) before the memory is reused or the call returns."""
    if transfer.release():
        return
    until_ended(transfer, lambda: False, deadline=time.monotonic() + UNCANCELLED_WAIT_S)
    if not transfer.release():
        log.error("nixl: a READ NIXL would not cancel still ran after %.0f s; left to the agent", UNCANCELLED_WAIT_S)
        transfer.abandon()



def read_failed(session: ReadSession) -> PeerLostError:
    if session.abandoned:
        return PeerLostError("the link gave the producer up before its nixl READ ended")
    return PeerLostError(f"a nixl READ from the producer's agent {session.remote} failed (its process may have died)")


def until_ended(
    transfer: Transfer, stop: Callable[[], bool], *, deadline: float | None, state: TransferState | None = None
) -> TransferState:
    """On a kvrt thread: ask NIXL for `transfer`'s state until it is not pending, `stop()`
    says to give up, or `deadline` (monotonic) passed; sleeping between asks, from 20 us
    doubling to 1 ms (NIXL has nothing to block on; see the module's docstring)."""
    if state is None:
        state = transfer.post()
    pause = _FIRST_PAUSE_S
    while state is TransferState.PENDING:
        if stop() or (deadline is not None and time.monotonic() > deadline):
            return TransferState.PENDING
        time.sleep(pause)
        pause = min(2 * pause, _LONGEST_PAUSE_S)
        state = transfer.state()
    return state

