"""One rank of a decode TP group (4 gloo processes, or NCCL on the GPUs there are), for
tests/test_consensus_group.py (spawned).

Each rank has its own producer and a consumer with group=WORLD, runs the same scenarios in
the same order, and reports what it saw to the parent through `results`. A group of one
rank runs them too: its lookups take the same path, collective included (on one GPU the
only NCCL group there is).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import kvrt
from kvrt import Layout, PoolTable
from tests._checks import caught_up

RANDOM_ROUNDS = 200
IN_FLIGHT = 8


def missing_rank(world: int) -> int:
    return min(2, world - 1)


def failing_rank(world: int) -> int:
    return min(1, world - 1)


def tokens(base: int, length: int) -> torch.Tensor:
    return torch.arange(base, base + length, dtype=torch.int64)


async def insert(producer: kvrt.Producer, input_tokens: torch.Tensor, rank: int) -> None:
    n = len(input_tokens)
    key = torch.full((2, n, 2, 4), float(rank), dtype=torch.float16)
    await producer.insert(input_tokens, None, key, key.clone(), torch.zeros(n, 3))


def summary(outcome: kvrt.KVItem | BaseException | None) -> tuple[Any, ...]:
    if outcome is None:
        return ("miss",)
    if isinstance(outcome, BaseException):
        return ("error", type(outcome).__name__, str(outcome))
    return ("item", outcome.matched, len(outcome.input_tokens), outcome.key.shape[1], outcome.value.shape[1])


async def scenarios(rank: int, world: int, results: Any) -> None:
    async with kvrt.Producer(heartbeat_s=0.5) as producer:
        async with kvrt.Consumer(connect=producer.endpoint, group=dist.group.WORLD, heartbeat_s=0.5) as consumer:
            # Different prefix lengths: rank r holds 8 + 8r tokens of the query's 32.
            await insert(producer, tokens(0, 8 + 8 * rank), rank)
            item = await consumer.drop_select(tokens(0, 32))
            results.put((rank, "different_prefix", summary(item)))

            # A pull is agreed as a drop_select is: every rank writes the agreed tokens (8)
            # into its pools, no more, from its own item (its rows hold its rank).
            await insert(producer, tokens(7000, 8 + 8 * rank), rank)
            empty = -1.0
            layers = [torch.full((32, 4, 4), empty, dtype=torch.float16) for _ in range(2)]
            item = await consumer.pull(
                tokens(7000, 32), into=PoolTable([[layers]], Layout.TOKEN_MAJOR), slots=torch.arange(32)
            )
            written = [slot for slot in range(32) if not bool((layers[0][slot] == empty).all())]
            values = sorted({float(value) for layer in layers for value in layer[written].unique()})
            results.put((rank, "pull", (summary(item), written, values, producer.stats().items)))

            # One rank has no item: a miss everywhere, and the others' items go back.
            if rank != missing_rank(world):
                await insert(producer, tokens(1000, 16), rank)
            item = await consumer.drop_select(tokens(1000, 16))
            await caught_up(consumer)
            results.put((rank, "one_missing", (summary(item), producer.stats().items)))

            # A batch: each of its queries is agreed as a drop_select's would be, all of them
            # together (rounds: the group's collectives each batch took).
            if rank != missing_rank(world):
                await insert(producer, tokens(2000, 6), rank)
            await insert(producer, tokens(3000, 4 + rank), rank)
            consensus = consumer._connections.consensus
            assert consensus is not None
            before = consensus.rounds
            items = await consumer.drop_select_many([tokens(2000, 6), tokens(3000, 10), tokens(4000, 3)])
            rounds = [consensus.rounds - before]
            await caught_up(consumer)
            before = consensus.rounds
            misses = await consumer.drop_select_many([tokens(6000, 2), tokens(6100, 2), tokens(6200, 2)])
            rounds.append(consensus.rounds - before)
            outcomes = [summary(item) for item in [*items, *misses]]
            results.put((rank, "batch", (outcomes, producer.stats().items, rounds)))

            # into=: the agreed (cut) item lands in the rank's own buffers; a miss of the group
            # leaves them untouched, though this rank's own item had come (it went back).
            def staging() -> kvrt.KVBuffers:
                empty = torch.full((1024,), -1.0, dtype=torch.float16)  # the largest item as it comes, uncut
                return kvrt.KVBuffers(key=empty, value=empty.clone())

            await insert(producer, tokens(8000, 8 + 8 * rank), rank)
            landing = staging()
            item = await consumer.drop_select(tokens(8000, 32), into=landing)
            landed = item is not None and item.key.data_ptr() == landing.key.data_ptr()
            values = sorted({float(value) for value in landing.key.unique()})
            if rank != missing_rank(world):
                await insert(producer, tokens(8100, 8), rank)
            untouched = staging()
            missed = await consumer.drop_select(tokens(8100, 8), into=untouched)
            await insert(producer, tokens(8200, 6), rank)
            per_query = [staging()]
            (batched,) = await consumer.drop_select_many([tokens(8200, 6)], into=per_query)
            batch_landed = batched is not None and batched.key.data_ptr() == per_query[0].key.data_ptr()
            await caught_up(consumer)
            results.put((rank, "into", (
                summary(item), landed, values, missed is None, bool((untouched.key == -1).all()),
                summary(batched), batch_landed, producer.stats().items,
            )))  # fmt: skip

            # Random rounds, several lookups in flight on every rank.
            rng = random.Random(99)
            expected: list[int] = []
            for round_index in range(RANDOM_ROUNDS):
                lengths = [rng.randrange(1, 20) for _ in range(world)]
                base = 10_000 + 100 * round_index
                await insert(producer, tokens(base, lengths[rank]), rank)
                expected.append(min(lengths))
            outcomes: list[Any] = []
            for start in range(0, RANDOM_ROUNDS, IN_FLIGHT):
                batch = range(start, min(RANDOM_ROUNDS, start + IN_FLIGHT))
                queries = [consumer.drop_select(tokens(10_000 + 100 * i, 20)) for i in batch]
                outcomes += await asyncio.gather(*queries)
            matched = [None if item is None else item.matched for item in outcomes]
            results.put((rank, "random_rounds", (matched, expected)))

            # One rank's producer fails: that error, on every rank, for a lookup and for a
            # batch; the other ranks' items go back to their producers.
            if rank == failing_rank(world):
                await producer.aclose()
            else:
                await insert(producer, tokens(5000, 8), rank)
            held = None if rank == failing_rank(world) else producer.stats().items
            seen: list[Any] = []
            for lookup in (consumer.drop_select(tokens(5000, 8)), consumer.drop_select_many([tokens(5000, 8)])):
                try:
                    seen.append(summary(await lookup))  # type: ignore[arg-type]
                except kvrt.KVRTError as error:
                    seen.append(summary(error))
            # One more lookup (it fails too): its request follows the give-backs on the same
            # connection, so the producer has taken them in once it answered.
            with contextlib.suppress(kvrt.KVRTError):
                await consumer.drop_select(tokens(-10_000, 4))
            seen.append(None if held is None else producer.stats().items - held)
            results.put((rank, "producer_failing", tuple(seen)))


@contextlib.contextmanager
def process_group(rank: int, world: int, port: int, backend: str) -> Iterator[None]:
    """torch.distributed's default group, this process as `rank` of `world`, for the `with`
    block. NCCL ranks take a GPU each, this rank's."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # the group's collectives run on this rank's GPU
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, world: int, port: int, results: Any, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    with process_group(rank, world, port, backend):
        try:
            asyncio.run(scenarios(rank, world, results))
        except BaseException as error:
            results.put((rank, "crashed", repr(error)))
            raise


def run_rank_that_loses_its_peer(rank: int, port: int, results: Any) -> None:
    """Two gloo ranks with a 3 s group timeout; rank 1 dies before the first lookup. Rank 0
    reports what its lookup raised, how long it took, and what the next lookup raised."""
    import datetime
    import time

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        os._exit(0)  # dies without a word, as a killed rank does

    async def lookups() -> None:
        async with kvrt.Producer() as producer:
            async with kvrt.Consumer(connect=producer.endpoint, group=dist.group.WORLD) as consumer:
                started = time.monotonic()
                outcomes: list[Any] = []
                for _ in range(2):
                    try:
                        outcomes.append(summary(await consumer.drop_select(tokens(0, 4))))
                    except kvrt.KVRTError as error:
                        outcomes.append(summary(error))
                    outcomes.append(time.monotonic() - started)
                results.put(tuple(outcomes))

    asyncio.run(lookups())


def run_rank_that_reads_an_unknown_status(port: int, results: Any) -> None:
    """A one-rank gloo group whose round carries a status this version does not know (as a
    rank of another version could send): the lookup reports what it raised."""
    from kvrt._consensus import GroupConsensus, Outcome, Status

    async def lookup() -> None:
        consensus = GroupConsensus(dist.group.WORLD)
        consensus.start()
        consensus.window.values_to_reduce = lambda: [-1 - (99 << 16)]  # type: ignore[method-assign]
        try:
            async with asyncio.timeout(30):
                await consensus.decide(consensus.register(), Outcome(Status.OK, 4))
            results.put(("decided",))
        except kvrt.KVRTError as error:
            results.put(summary(error))
        finally:
            await consensus.aclose()

    with process_group(0, 1, port, "gloo"):  # its collectives complete at once
        asyncio.run(lookup())


def run_rank_with_callers(port: int, callers: int, lookups_each: int, results: Any, backend: str = "gloo") -> None:
    """A one-rank group (gloo: its collective done at once; NCCL: on this host's GPU) and
    `callers` concurrent callers, each starting its next lookup as soon as its last is decided:
    reports the lookups and the rounds after a warm-up of four lookups each (the window at its
    steady size). A caller whose decision is not its own outcome (4 tokens matched) raises."""
    from kvrt._consensus import Decision, GroupConsensus, Outcome, Status

    async def caller(consensus: GroupConsensus, lookups: int) -> None:
        for _ in range(lookups):
            decision = await consensus.decide(consensus.register(), Outcome(Status.OK, 4))
            assert decision == Decision(Status.OK, 4, -1), decision

    async def lookups() -> None:
        consensus = GroupConsensus(dist.group.WORLD)
        consensus.start()
        try:
            async with asyncio.timeout(30):
                await asyncio.gather(*(caller(consensus, 4) for _ in range(callers)))
                rounds_before = consensus.rounds
                await asyncio.gather(*(caller(consensus, lookups_each) for _ in range(callers)))
            results.put((callers * lookups_each, consensus.rounds - rounds_before))
        except BaseException as error:
            results.put(("crashed", repr(error)))
            raise
        finally:
            await consensus.aclose()

    with process_group(0, 1, port, backend):
        asyncio.run(lookups())
