"""TP-group consensus: every rank of a decode tensor-parallel group agrees on each lookup.

Each rank runs its own consumer against its own producer and may see a different result
for the same request (a shorter prefix, a miss, a lost producer). Before any rank uses
its result, the group agrees with one `all_reduce(MIN)` over a small int64 tensor, one
value per lookup that holds the negated status above the matched length in tokens:

    not ready yet (this rank has no result)   NOT_READY, the smallest int64
    status S other than OK, seen by rank R     -1 - ((S * world_size + R) << 16 | backlog)
    OK with M tokens matched                   M << 16 | (0xFFFF - backlog)

MIN is NOT_READY unless every rank has its result. Otherwise it is negative when any rank
failed: the worst status (the largest code) and, among ranks with it, the highest rank, so
the message can name one; the match does not matter then (every rank returns that error).
When every rank matched, MIN is the shortest match (tokens, never blocks). In the first row
the low bits carry the sender's backlog (lookups it has waiting), and MIN hands every rank
the same one: it sizes the next round.

Why one value and not a (matched, -status) pair: gloo's ring all_reduce cuts the tensor
into 2 x world_size segments and sends each non-empty one around the ring, so its cost
grows with the values up to 2 x world_size of them (`docs/bench/consensus-cpu.md`). One
lookup at a time then costs a 1-value collective, a round of 16 lookups a 16-value one.

Lookups are numbered in call order, which is the same on every rank (TP ranks run the
same schedule). A round covers a window of lookups from the oldest undecided one; a rank
enters a round only once its own oldest undecided lookup has a result, so every rank
eventually enters, and that lookup is decided in the round. Lookups in flight together
are decided together: never more than one collective per lookup, fewer as concurrency
rises. The window moves and resizes from the reduced tensor alone, so identically on every
rank.

`ConsensusWindow` is that bookkeeping without any collective (tested on its own);
`GroupConsensus` drives it with a process group. It issues each collective from the event
loop with `async_op=True` (so the issue order is the loop's, the same on every rank) and
learns of its completion without blocking the loop: from gloo's work future, whose
callback wakes the loop, or for NCCL from an event on a stream of its own that one kvrt
thread waits for (NCCL's work future completes at enqueue, and the engine's compute
stream must not wait for the group).
"""

from __future__ import annotations

import array
import asyncio
import collections
import concurrent.futures
import contextlib
import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist

from kvrt._errors import (
    ClosedError,
    InvalidInputError,
    KVRTError,
    KVRTTimeoutError,
    PeerLostError,
    fresh_copy,
)
from kvrt._threads import own_thread
from kvrt._trace import emit

ROWS: Final = 64
"""Most lookups one round can decide."""

_BACKLOG_BITS: Final = 16
_BACKLOG_MASK: Final = (1 << _BACKLOG_BITS) - 1

_BACKLOG_MEMORY_ROUNDS: Final = 4
"""Rounds over which the largest reported backlog sizes the window."""

_NOT_MATCHED: Final = 0
_NOT_READY: Final = -(1 << 63)
MAX_MATCHED_TOKENS: Final = (1 << (63 - _BACKLOG_BITS)) - 1
"""The longest match one value can carry above the backlog bits."""


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

    def __post_init__(self) -> None:
        if not 0 <= self.matched_tokens <= MAX_MATCHED_TOKENS:
            raise InvalidInputError(f"matched_tokens must be in [0, {MAX_MATCHED_TOKENS}], got {self.matched_tokens}")


@dataclass(frozen=True, slots=True)
class Decision:
    """What the group agreed for one lookup: the worst status (and a rank that saw it, -1
    when every rank matched), and the shortest matched length in tokens (0 unless every rank
    matched)."""

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
    """Which lookups are registered, which have a local outcome, which the group decided.

    Each recorded outcome is kept as the value it sends (without the backlog, which only
    the round's first row carries): every round of a lookup then reads it instead of
    encoding it again, and a decided lookup, no longer kept, sends NOT_READY.
    """

    def __init__(self, *, rank: int, world_size: int, max_rows: int = ROWS) -> None:
        self.rank = rank
        self.world_size = world_size
        self.max_rows = max_rows
        self.rows = 1
        """Lookups the next round covers; every rank has the same."""
        self.start = 0
        """The oldest undecided lookup; every rank has the same."""
        self._registered = 0
        self._values: dict[int, int] = {}
        """Recorded, undecided lookups: the value each sends, its backlog bits zero."""
        self._decided_ahead: set[int] = set()
        """Lookups decided past `start` (a round decided them while an older one waited)."""
        self._recent_backlogs: collections.deque[int] = collections.deque(maxlen=_BACKLOG_MEMORY_ROUNDS)

    def register(self) -> int:
        """Number the next lookup (call order)."""
        sequence = self._registered
        self._registered += 1
        return sequence

    def record(self, sequence: int, outcome: Outcome) -> None:
        if outcome.status is Status.OK:
            value = outcome.matched_tokens << _BACKLOG_BITS | _BACKLOG_MASK
        else:
            value = -1 - ((outcome.status * self.world_size + self.rank) << _BACKLOG_BITS)
        self._values[sequence] = value

    @property
    def start_is_ready(self) -> bool:
        """Whether this rank can enter the next round (its oldest undecided lookup has a result)."""
        return self.start in self._values

    def values_to_reduce(self) -> list[int]:
        """This rank's contribution to the round over [start, start + rows), one value a lookup."""
        ready = self._values.get
        values = [ready(sequence, _NOT_READY) for sequence in range(self.start, self.start + self.rows)]
        if values[0] != _NOT_READY:
            # The first row carries this rank's backlog in its low bits: for a match their
            # complement (MIN then takes the largest backlog), for a failure the backlog.
            values[0] -= min(self._registered - self.start, _BACKLOG_MASK)
        return values

    def apply(self, reduced: list[int]) -> dict[int, Decision]:
        """Decisions of a round, from the reduced values; moves and resizes the window."""
        decisions: dict[int, Decision] = {}
        backlog = 0
        start = self.start
        for offset, value in enumerate(reduced[: self.rows]):
            if value == _NOT_READY:
                continue
            if value >= 0:
                decision = Decision(Status.OK, value >> _BACKLOG_BITS, -1)
                low = _BACKLOG_MASK - (value & _BACKLOG_MASK)
            else:
                status_code, rank = divmod((-1 - value) >> _BACKLOG_BITS, self.world_size)
                decision = Decision(Status(status_code), _NOT_MATCHED, rank)
                low = (-1 - value) & _BACKLOG_MASK
            if offset == 0:
                backlog = low  # the start row is ready on every rank
            decisions[start + offset] = decision
            self._values.pop(start + offset, None)
        # Move past the decided prefix; lookups decided beyond a gap wait in `_decided_ahead`.
        ahead = self._decided_ahead
        ahead.update(decisions)
        while start in ahead:
            ahead.discard(start)
            start += 1
        self.start = start
        # The next window covers the largest backlog reported in the last few rounds: waves
        # of concurrent lookups then take one round each (a wave's tail round reports a
        # small backlog, which must not shrink the window for the next wave).
        self._recent_backlogs.append(backlog)
        self.rows = min(self.max_rows, max(1, *self._recent_backlogs))
        return decisions


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives need their tensors: the current CUDA device for NCCL."""
    backend = dist.get_backend(group)
    if backend == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GroupConsensus:
    """Agreement on lookups inside one process group.

    Rounds run one at a time, each started from the loop as soon as this rank can enter it
    (at the end of the loop iteration in which a lookup recorded its outcome, so that a burst
    shares one round; when the previous round ends, right after the callers it woke, so that
    their next lookups join), so every rank issues the same rounds in the same order. A
    round's completion comes back as a loop callback: no task sits between the collective
    and the lookups it decides (on a 2-core host each extra hop of the loop is a visible
    share of a 2-value collective). A collective that fails (a rank
    died, the group timed out) fails every waiting lookup, and later ones, with
    `PeerLostError`: nothing waits for a group that cannot agree any more.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, max_rows: int = ROWS) -> None:
        if not dist.is_initialized():
            raise KVRTError("group= needs torch.distributed to be initialized (init_process_group) first")
        self.group = group
        self.device = group_device(group)
        self._process_group: Any = dist.group.WORLD if group is None else group
        self._min = dist.AllreduceOptions()
        self._min.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        self.window = ConsensusWindow(
            rank=dist.get_rank(group), world_size=dist.get_world_size(group), max_rows=max_rows
        )
        self.rounds = 0
        self._waiting: dict[int, asyncio.Future[Decision]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_round = False
        self._round_soon = False
        self._broken: KVRTError | None = None
        self._stream: torch.cuda.Stream | None = None
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None
        if self.device.type == "cuda":
            # A stream of its own: the engine's compute stream never waits for the group.
            self._stream = torch.cuda.Stream(self.device)
            self._waiter = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvrt-consensus", initializer=own_thread
            )
        self._closed = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def register(self) -> int:
        if self._closed:
            raise ClosedError("the consumer is closed")
        return self.window.register()

    def decide(self, sequence: int, outcome: Outcome) -> asyncio.Future[Decision]:
        """Record this rank's outcome for lookup `sequence`: await the result for the group's
        decision. (A future, not a coroutine: one frame less per lookup on the loop that
        every round waits for.)"""
        return self._decision(sequence, outcome)

    async def decide_many(self, sequences: Sequence[int], outcomes: Sequence[Outcome]) -> list[Decision]:
        """`decide` for lookups that wait together (a batch's): their outcomes are recorded in
        one go, so they share a round once the window has their size, and one wait covers them
        all (no task per lookup)."""
        waiting = [self._decision(sequence, outcome) for sequence, outcome in zip(sequences, outcomes, strict=True)]
        decided: list[Decision] = []
        for decision in await asyncio.gather(*waiting, return_exceptions=True):  # every failure retrieved
            if isinstance(decision, BaseException):
                raise decision
            decided.append(decision)
        return decided

    def _decision(self, sequence: int, outcome: Outcome) -> asyncio.Future[Decision]:
        """Record `outcome` for lookup `sequence`: the future of the group's decision."""
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        if self._closed:
            future.set_exception(ClosedError("the consumer was closed while its TP group was agreeing"))
        elif self._broken is not None:
            future.set_exception(fresh_copy(self._broken))
        else:
            self._waiting[sequence] = future
            self.window.record(sequence, outcome)
            self._start_round_soon()
        return future

    def abandon(self, sequence: int, outcome: Outcome) -> None:
        """Record an outcome whose caller will not wait for the decision (it was cancelled):
        the group still has to decide the lookup, in order."""
        self.window.record(sequence, outcome)
        self._start_round_soon()

    async def aclose(self) -> None:
        """Fail every lookup waiting for a decision. A collective already issued completes
        when the other ranks join it, or fails at the process group's timeout."""
        if self._closed:
            return
        self._closed = True
        self._fail_waiting(ClosedError("the consumer was closed while its TP group was agreeing"))
        if self._waiter is not None:
            self._waiter.shutdown(wait=False, cancel_futures=True)

    def _start_round_soon(self) -> None:
        """Start a round at the end of this loop iteration: lookups that record their outcome
        in the same iteration (a burst of concurrent requests) then share it."""
        if not self._round_soon:
            self._round_soon = True
            (self._loop or asyncio.get_running_loop()).call_soon(self._start_round_at_iteration_end)

    def _start_round_at_iteration_end(self) -> None:
        self._round_soon = False
        self._start_round()

    def _start_round(self) -> None:
        """Issue the next round now, if none is running and this rank can enter it."""
        if self._in_round or self._closed or self._broken is not None or not self.window.start_is_ready:
            return
        self._in_round = True
        try:
            self._issue(self.window.values_to_reduce())
        except (RuntimeError, ValueError) as error:  # the backend refused at once
            self._in_round = False
            self._break(error)

    def _issue(self, values: list[int]) -> None:
        """One collective, issued now from the loop; `_end_round` runs on the loop when it is done."""
        emit("consensus.round_issued", rows=len(values))
        loop = self._loop or asyncio.get_running_loop()
        if self._stream is not None and self._waiter is not None:
            # NCCL: a work's future completes at enqueue, not at completion. So the collective
            # runs on the consensus stream, an event marks its end, and a kvrt thread waits.
            with torch.cuda.stream(self._stream):
                tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
                work = dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
                assert work is not None
                work.wait()  # the consensus stream waits for NCCL's; the host does not
                finished = torch.cuda.Event(blocking=True)  # the waiting thread sleeps, not spins
                finished.record(self._stream)
            waited = self._waiter.submit(finished.synchronize)
            waited.add_done_callback(lambda _: loop.call_soon_threadsafe(self._end_round, work, tensor, waited))
            return
        # gloo: the values' own bytes as the tensor (torch.tensor from a list costs ~3x as much),
        # and the group's allreduce called as it is (dist.all_reduce's checks cost ~20 us more):
        # on a 2-core host four ranks' per-round host work adds up to a share of the round.
        tensor = torch.frombuffer(array.array("q", values), dtype=torch.int64)
        work = self._process_group.allreduce([tensor], self._min)
        # Runs on gloo's thread when the collective is done (or failed).
        work.get_future().add_done_callback(lambda _: loop.call_soon_threadsafe(self._end_round, work, tensor, None))

    def _end_round(self, work: Any, tensor: torch.Tensor, waited: concurrent.futures.Future[None] | None) -> None:
        emit("consensus.round_ended", rows=tensor.numel())
        self._in_round = False
        if self._closed:
            return
        try:
            if waited is not None:
                waited.result()
            work.wait()  # completed already: raises the backend's error, if it had one
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    reduced: list[int] = tensor.tolist()
            else:
                reduced = tensor.tolist()
        except (RuntimeError, concurrent.futures.CancelledError) as error:
            self._break(error)
            return
        self.rounds += 1
        try:
            decisions = self.window.apply(reduced)
        except ValueError as error:  # a value no rank of this version sends (a status it does not know)
            self._break(error)
            return
        for sequence, decision in decisions.items():
            future = self._waiting.pop(sequence, None)
            if future is not None and not future.done():
                future.set_result(decision)
        # The next round starts once the callers just woken have run (their wake-ups are
        # queued ahead of it): a caller that starts its next lookup at once joins that round,
        # and the round is issued in this same loop iteration, not one later.
        self._start_round_soon()

    def _break(self, error: BaseException) -> None:
        self._broken = PeerLostError(f"the TP group's collective failed, so its ranks cannot agree any more: {error}")
        self._fail_waiting(self._broken)

    def _fail_waiting(self, error: KVRTError) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(fresh_copy(error))
        self._waiting.clear()


MAX_SHARED_KEYS: Final = 64
"""Most keys one rank counts with `count_sharing` (a consumer's producers)."""


def _key_of(name: str) -> int:
    """A name as a nonzero int64 (0 pads the gathered rows)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little") | 1


async def count_sharing(group: dist.ProcessGroup | None, names: Sequence[str], timeout_s: float) -> list[int]:
    """For each of `names` (this rank's), how many ranks of `group`, this one included, hold
    it too: one all_gather, made by every rank at the same point (a consumer's start). Raises
    `PeerLostError` when the group does not complete it within `timeout_s`."""
    if len(names) > MAX_SHARED_KEYS:
        raise KVRTError(f"a rank of a TP group counts at most {MAX_SHARED_KEYS} producers, got {len(names)}")
    device = group_device(group)
    keys = [_key_of(name) for name in names]

    def gather() -> list[list[int]]:
        row = torch.zeros(MAX_SHARED_KEYS, dtype=torch.int64)
        row[: len(keys)] = torch.tensor(keys, dtype=torch.int64)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            mine = row.to(device)
            rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(rows, mine, group=group)
            return [gathered.tolist() for gathered in rows]

    try:
        rows = await asyncio.wait_for(asyncio.to_thread(gather), timeout_s)
    except TimeoutError:
        raise PeerLostError(
            f"the TP group did not tell within {timeout_s:g} s which producers its ranks read "
            "(every rank's consumer starts at the same point of its program)"
        ) from None
    except RuntimeError as error:
        raise PeerLostError(f"the TP group's collective failed: {error}") from error
    return [sum(key in row for row in rows) for key in keys]
