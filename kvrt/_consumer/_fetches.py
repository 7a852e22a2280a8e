"""`Consumer.fetch` (`Fetches`): a scheduler step's requests taken in one message and written
into the caller's paged pools as they land, in two phases: `fetch` starts it and returns at
once (its request is on its way), `Fetch.landed` waits until every item was written and the
producer's delivery held (its lease), and says how many tokens each query found.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrt._caller_stream import caller_stream
from kvrt._consumer._connections import Connections, Scatters
from kvrt._consumer._drop_selects import DropSelects
from kvrt._errors import ClosedError, InvalidInputError
from kvrt._heads import head_range
from kvrt._item import KVItem, query_bytes
from kvrt._messages import MAX_BATCH, HeadRange
from kvrt._pools import PoolTable, checked_indexes, per_token


@dataclass(frozen=True, slots=True)
class _Target:
    """Where one query's item lands: its tokens [skip, skip + len(slots)) at `slots`."""

    replicas: torch.Tensor
    slots: torch.Tensor
    skip: int


class Fetch:
    """A step's requests on their way into the caller's pools (`Consumer.fetch`); the second
    phase is `landed`."""

    def __init__(self, task: asyncio.Task[list[int]]) -> None:
        self._task = task

    async def landed(self) -> list[int]:
        """Return once every item found was written into its slots: per query, in order, the
        tokens its item matched (0: nothing matched, and nothing was written there). The
        tokens of the match past `skip` are written, as far as its slots go.

        Raises what the fetch met as a whole (the call's errors, as `drop_select_many`'s:
        `PeerLostError`, `KVRTTimeoutError`, `LeaseExpiredError`, `IntegrityError`, ...):
        then no item is the caller's (each went back to its producer, or the producer is
        gone), though some slots may hold some of an item's bytes. `ClosedError` once the
        consumer closed. Cancelling this wait leaves the fetch going; `cancel()` ends it."""
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if self._task.cancelled():
                raise ClosedError("the fetch was given up (cancel(), or its consumer closed)") from None
            raise

    def done(self) -> bool:
        """Whether `landed` would return (or raise) at once."""
        return self._task.done()

    def cancel(self) -> None:
        """Give the fetch up: items whose bytes had not come go back to their producer."""
        self._task.cancel()


class Fetches:
    """`fetch`, and the fetches on their way (ended when the consumer closes)."""

    def __init__(
        self, connections: Connections, scatters: Scatters, lookups: DropSelects, device: torch.device
    ) -> None:
        self._connections = connections
        self._scatters = scatters
        self._lookups = lookups
        self._device = device
        self._going: set[asyncio.Task[list[int]]] = set()

    def fetch(
        self,
        queries: Sequence[torch.Tensor],
        *,
        into: PoolTable,
        slots: Sequence[torch.Tensor],
        skip: Sequence[int] | None = None,
        replica: torch.Tensor | int = 0,
        heads: slice | None = None,
        stream: torch.cuda.Stream | None = None,
    ) -> Fetch:
        """See `Consumer.fetch`."""
        connections = self._connections
        connections.check_open()
        what = "fetch"
        if len(connections.links) != 1 or connections.consensus is not None:
            raise InvalidInputError(f"{what} needs a consumer of one producer, without group=")
        if not isinstance(queries, Sequence) or not 1 <= len(queries) <= MAX_BATCH:
            raise InvalidInputError(f"{what}: queries must be a sequence of 1 to {MAX_BATCH} token tensors")
        if into.device != self._device:
            raise InvalidInputError(f"{what}: the pools are on {into.device}, this consumer is on {self._device}")
        if not isinstance(slots, Sequence) or len(slots) != len(queries):
            raise InvalidInputError(
                f"{what}: slots must name one tensor of slots for each of the {len(queries)} queries"
            )
        skips = [0] * len(queries) if skip is None else list(skip)
        if len(skips) != len(queries) or any(type(value) is not int or value < 0 for value in skips):
            raise InvalidInputError(f"{what}: skip must be one int >= 0 for each query (the tokens the pools hold)")
        for query in queries:
            query_bytes(query, None, what=what)  # the tokens checked before anything is taken
        wanted = head_range(heads, f"{what}: heads")
        placed = _pool_heads(into, wanted, connections.links[0].core.heads, what)
        targets = [
            _Target(*checked_indexes(into, per_token(replica, query_slots), query_slots), skip=query_skip)
            for query_slots, query_skip in zip(slots, skips, strict=True)
        ]
        caller = caller_stream(stream, self._device)
        task = asyncio.get_running_loop().create_task(
            self._run(list(queries), into, targets, heads, placed, caller), name="kvrt-fetch"
        )
        self._going.add(task)
        task.add_done_callback(self._going.discard)
        return Fetch(task)

    async def _run(
        self, queries: list[torch.Tensor], into: PoolTable, targets: list[_Target], heads: slice | None,
        placed: tuple[int, int] | None, caller: torch.cuda.Stream | None,
    ) -> list[int]:  # fmt: skip
        items = await self._lookups.drop_select_many(queries, None, into=None, heads=heads)
        landed = [_written(item, target) for item, target in zip(items, targets, strict=True)]
        moves = [(item, target) for item, target in zip(items, targets, strict=True) if item is not None]
        if into.device.type == "cuda":
            await self._scatter_on_the_gpu(into, moves, placed, caller)
        else:
            from kvrt.kernels.paged_kv import scatter_from_any  # Triton: only when pools are used

            for item, target in moves:
                count = _count(item, target)
                if count > 0:
                    key, value = _tokens(item, target.skip, count)
                    scatter_from_any(  # the indexes were checked by `fetch`
                        into, key, value, target.replicas[:count], target.slots[:count], heads=placed, check=False
                    )
        return landed

    async def _scatter_on_the_gpu(
        self, into: PoolTable, moves: list[tuple[KVItem, _Target]], placed: tuple[int, int] | None,
        caller: torch.cuda.Stream | None,
    ) -> None:  # fmt: skip
        """The items' scatters, queued by the scatter thread (a first launch compiles) after
        the stream they landed on, then the caller's stream made to wait for them."""
        from kvrt.kernels.paged_kv import scatter_from

        device = self._device
        arrived = torch.cuda.Event()
        arrived.record(torch.cuda.current_stream(device))

        def queue() -> torch.cuda.Event:
            stream = self._scatters.scatter_stream()
            with torch.cuda.stream(stream):
                stream.wait_event(arrived)
                for item, target in moves:
                    count = _count(item, target)
                    if count > 0:
                        key, value = _tokens(item, target.skip, count)
                        for tensor in (key, value, target.slots, target.replicas):
                            tensor.record_stream(stream)
                        scatter_from(into, key, value, target.replicas[:count], target.slots[:count],
                                     heads=placed, check=False)  # fmt: skip
                done = torch.cuda.Event()
                done.record(stream)
            return done

        job: concurrent.futures.Future[torch.cuda.Event] = self._scatters.scatter_thread().submit(queue)
        written = await asyncio.shield(asyncio.wrap_future(job))
        (caller or torch.cuda.current_stream(device)).wait_event(written)

    async def aclose(self) -> None:
        """End the fetches on their way (`landed` raises `ClosedError`)."""
        going = list(self._going)
        for task in going:
            task.cancel()
        await asyncio.gather(*going, return_exceptions=True)  # each outcome is its caller's to read


def _count(item: KVItem, target: _Target) -> int:
    """The tokens of `item` that land: those of its match past `skip`, as far as the slots go."""
    return max(0, min(item.matched, int(item.key.shape[1]), target.skip + target.slots.numel()) - target.skip)


def _written(item: KVItem | None, target: _Target) -> int:
    return 0 if item is None else item.matched


def _tokens(item: KVItem, skip: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The item's K and V of the tokens that land (a latent's V is empty: it stays whole)."""
    value = item.value[:, skip : skip + count] if item.value.dim() == 4 and item.value.shape[1] else item.value
    return item.key[:, skip : skip + count], value


def _pool_heads(
    into: PoolTable, wanted: HeadRange | None, producer_heads: HeadRange | None, what: str
) -> tuple[int, int] | None:
    """Where the fetched heads lie among the pools' (None: the pools' every head)."""
    if wanted is None and into.heads_said and producer_heads is not None:
        wanted = producer_heads
    if wanted is None or into.geometry.kv != 2:
        return None
    placed = (wanted.first - into.first_head, wanted.end - into.first_head)
    if placed[0] < 0 or placed[1] > into.geometry.heads:
        raise InvalidInputError(
            f"{what}: heads [{wanted.first}, {wanted.end}) do not lie in the pools' heads [{into.first_head}, "
            f"{into.first_head + into.geometry.heads}) (PoolTable(..., heads=) says which the pools hold)"
        )
    return placed

