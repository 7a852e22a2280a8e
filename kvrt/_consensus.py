"""TP-group consensus: every rank of a decode tensor-parallel group agrees on each lookup.

Each rank runs its own consumer against its own producer and may see a different result
for the same request (a shorter prefix, a miss, a lost producer). Before any rank uses
its result, the group agrees with one `all_reduce(MIN)` over a small int64 tensor:

    row = [ready, matched_tokens, -(status * world_size + rank)]

MIN over `ready` says whether every rank has its result; MIN over `matched_tokens` is the
shortest match (tokens, never blocks); MIN over the last column is the worst status (the
largest code) and, among ranks with it, the highest rank, so the message can name one.

Lookups are numbered in call order, which is the same on every rank (TP ranks run the
same schedule). A round covers the window of `ROWS` lookups from the oldest undecided
one; a rank enters a round only once its own oldest undecided lookup has a result, so
every rank eventually enters, and that row is decided in the round. Lookups in flight
together are decided together: never more than one collective per lookup, fewer as
concurrency rises. Which lookups a round decided follows from the reduced tensor alone,
so the window moves identically on every rank.

`ConsensusWindow` is that bookkeeping without any collective (tested on its own);
`GroupConsensus` drives it with a process group, running each blocking collective in a
thread kvrt owns so the event loop never waits on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
from dataclasses import dataclass
from typing import Final

import torch
import torch.distributed as dist

from kvrt._errors import (
    ClosedError,
    KVRTError,
    KVRTTimeoutError,
    PeerLostError,
)

ROWS: Final = 64
"""Lookups one round can decide."""

_NOT_MATCHED: Final = 0


class Status(enum.IntEnum):
    """A lookup's local outcome. Larger is worse: the group takes the largest."""

    OK = 0
    MISS = 1
    TIMEOUT = 2
    PEER_LOST = 3
    FAILED = 4
    CANCELLED = 5
    CLOSED = 6


def status_of(error: BaseException) -> Status:
    """The status a lookup that raised `error` reports to its group."""
    if isinstance(error, asyncio.CancelledError):
        return Status.CANCELLED
    if isinstance(error, ClosedError):
        return Status.CLOSED
    if isinstance(error, PeerLostError):
        return Status.PEER_LOST
    if isinstance(error, KVRTTimeoutError):
        return Status.TIMEOUT
    return Status.FAILED


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one rank saw for one lookup: its status and matched length in tokens."""

    status: Status
    matched_tokens: int = _NOT_MATCHED


@dataclass(frozen=True, slots=True)
class Decision:
    """What the group agreed for one lookup: the worst status (and a rank that saw it), and
    the shortest matched length in tokens (0 unless every rank matched)."""

    status: Status
    matched_tokens: int
    rank: int


def error_for(decision: Decision, own: Outcome, own_error: BaseException | None) -> KVRTError:
    """The error a rank raises for a failed decision: its own if it saw the worst status,
    else one of the same kind that names the rank that did."""
    if own_error is not None and own.status is decision.status and isinstance(own_error, KVRTError):
        return own_error
    text = f"rank {decision.rank} of the TP group reported {decision.status.name.lower()} for this lookup"
    match decision.status:
        case Status.PEER_LOST:
            return PeerLostError(text + "; its producer is unreachable")
        case Status.TIMEOUT:
            return KVRTTimeoutError(text, phase="lookup")
        case Status.CLOSED:
            return ClosedError(text + "; its consumer was closed")
        case _:
            return KVRTError(text)


class ConsensusWindow:
    """Which lookups are registered, which have a local outcome, which the group decided."""

    def __init__(self, *, rank: int, world_size: int, rows: int = ROWS) -> None:
        self.rank = rank
        self.world_size = world_size
        self.rows = rows
        self.start = 0
        """The oldest undecided lookup; every rank has the same."""
        self._registered = 0
        self._outcomes: dict[int, Outcome] = {}
        self._decided: set[int] = set()

    def register(self) -> int:
        """Number the next lookup (call order)."""
        sequence = self._registered
        self._registered += 1
        return sequence

    def record(self, sequence: int, outcome: Outcome) -> None:
        self._outcomes[sequence] = outcome

    @property
    def start_is_ready(self) -> bool:
        """Whether this rank can enter the next round (its oldest undecided lookup has a result)."""
        return self.start in self._outcomes

    def rows_to_reduce(self) -> list[list[int]]:
        """This rank's rows for the round over [start, start + rows)."""
        rows = []
        for sequence in range(self.start, self.start + self.rows):
            outcome = self._outcomes.get(sequence)
            if outcome is None or sequence in self._decided:
                # Not ready here (or already decided: row ignored). Neutral in the other columns.
                rows.append([0, 2**62, 0])
            else:
                worst = outcome.status * self.world_size + self.rank
                rows.append([1, outcome.matched_tokens, -worst])
        return rows

    def apply(self, reduced: list[list[int]]) -> dict[int, Decision]:
        """Decisions of a round, from the reduced rows; moves the window."""
        decisions: dict[int, Decision] = {}
        for offset, (ready, matched, negative_worst) in enumerate(reduced):
            sequence = self.start + offset
            if not ready or sequence in self._decided:
                continue
            status_code, rank = divmod(-negative_worst, self.world_size)
            status = Status(status_code)
            decisions[sequence] = Decision(status, matched if status is Status.OK else 0, rank)
            self._decided.add(sequence)
            self._outcomes.pop(sequence, None)
        while self.start in self._decided:
            self._decided.discard(self.start)
            self.start += 1
        return decisions


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives need their tensors: the current CUDA device for NCCL."""
    backend = dist.get_backend(group)
    if backend == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GroupConsensus:
    """Agreement on lookups inside one process group, one owned task driving the rounds."""

    def __init__(self, group: dist.ProcessGroup | None, *, rows: int = ROWS) -> None:
        if not dist.is_initialized():
            raise KVRTError("group= needs torch.distributed to be initialized (init_process_group) first")
        self.group = group
        self.device = group_device(group)
        self.window = ConsensusWindow(rank=dist.get_rank(group), world_size=dist.get_world_size(group), rows=rows)
        self.rounds = 0
        self._waiting: dict[int, asyncio.Future[Decision]] = {}
        self._start_ready = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrt-consensus")
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_rounds(), name="kvrt-consensus")

    def register(self) -> int:
        if self._closed:
            raise ClosedError("the consumer is closed")
        return self.window.register()

    async def decide(self, sequence: int, outcome: Outcome) -> Decision:
        """Record this rank's outcome for lookup `sequence` and wait for the group's decision."""
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiting[sequence] = future
        self.window.record(sequence, outcome)
        if self.window.start_is_ready:
            self._start_ready.set()
        if self._closed:
            future.set_exception(ClosedError("the consumer was closed while its TP group was agreeing"))
        return await future

    def abandon(self, sequence: int, outcome: Outcome) -> None:
        """Record an outcome whose caller will not wait for the decision (it was cancelled):
        the group still has to decide the lookup, in order."""
        self.window.record(sequence, outcome)
        if self.window.start_is_ready:
            self._start_ready.set()

    async def aclose(self) -> None:
        """Fail every lookup waiting for a decision. A collective already running stays in its
        thread until the other ranks join it or the group's timeout ends it."""
        if self._closed:
            return
        self._closed = True
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ClosedError("the consumer was closed while its TP group was agreeing"))
        self._waiting.clear()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run_rounds(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._start_ready.wait()
            rows = self.window.rows_to_reduce()
            reduced = await loop.run_in_executor(self._executor, self._all_reduce_min, rows)
            self.rounds += 1
            for sequence, decision in self.window.apply(reduced).items():
                future = self._waiting.pop(sequence, None)
                if future is not None and not future.done():
                    future.set_result(decision)
            if not self.window.start_is_ready:
                self._start_ready.clear()

    def _all_reduce_min(self, rows: list[list[int]]) -> list[list[int]]:
        """In the consensus thread: one collective, and one read back to the host."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        tensor = torch.tensor(rows, dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        reduced: list[list[int]] = tensor.tolist()
        return reduced
