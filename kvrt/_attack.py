"""`kvrt attack`: an adversarial suite against a real producer, as an outsider attacks one.

Every scenario starts a producer in its own process and a legitimate consumer in another,
taking items at a steady rate; it measures that consumer for a while (the baseline), then
runs one attack beside it (peers sending garbage, thousands of connections, peers that stop
reading, stalls and kills of either side, many waiting lookups, 50 consumers under
backpressure), then stops the attackers, lets the producer settle and takes whatever it
still holds. Each item carries a unique id and a CRC-32 of its tensors in its tokens; every
process that inserts or takes items appends what it did to a file of its own (a process
killed with SIGKILL keeps what it wrote), so that the suite counts, across every process,
items inserted, delivered, lost, duplicated and damaged.

Per scenario it prints those counts, the legitimate consumer's p99 latency before and during
the attack, and the producer's RSS before and after, and it checks the goal: nothing lost,
nothing taken twice, nothing damaged, no process that does not stop when told and no call that
outlives its timeout, p99 under attack at most `P99_RATIO_GOAL` times the baseline's, and RSS
growth at most `RSS_GROWTH_GOAL_BYTES` once the attack is over and the buffer drained (a leak
grows with the attack's length; what the producer caches once does not). Killing the producer
loses what it buffered: those items are counted as "gone with the producer", not lost, and
the latency goal does not apply when the producer itself is stopped or killed.
The exit status is non-zero when a goal fails.

Attackers that speak raw ZeroMQ build their frames by hand from docs/protocol.md, as a
client in another language would; the stalled and killed consumers are real
`kvrt.Consumer`s. Child processes come from a forkserver that imported this module once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.process
import os
import random
import resource
import shutil
import signal
import tempfile
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np
import torch
import zmq

import kvrt
from kvrt._consumer import DEFAULT_REPLY_TIMEOUT_S
from kvrt._messages import MAX_TOKENS, PROTOCOL_VERSION
from kvrt._protocol import HEARTBEAT_MISSES

# -- goals -------------------------------------------------------------------------------

P99_RATIO_GOAL: Final = 5.0
"""The legitimate consumer's p99 under attack may be at most this many times its p99 without."""
LEGIT_RATE_GOAL: Final = 0.8
"""The legitimate consumer must still get at least this share of the items a second it got before
the attack (an attack that blocks inserts, or starves it of items, shows here, not in latency)."""
RSS_GROWTH_GOAL_BYTES: Final = 64 << 20
"""The most the producer's RSS may grow over a scenario, measured once the attack is over and
its buffer drained against what it was right before the attack."""

# -- items -------------------------------------------------------------------------------

LEGIT: Final = 1
"""First token of the items the legitimate consumer takes."""
ATTACKED: Final = 2
"""First token of the items the attacking (stalled, killed, flooding) consumers take."""
NEVER: Final = 777
"""First token of lookups that match no item (parked waiters)."""
ITEM_TOKENS: Final = 16
"""Tokens per item: class, id, CRC-32 of the tensors, then a pattern of the id."""
ITEM_LAYERS: Final = 2
ITEM_HEADS: Final = 4
HIDDEN_WIDTH: Final = 8
BYTES_PER_DIM: Final = 2 * ITEM_LAYERS * ITEM_TOKENS * ITEM_HEADS * 2
"""Key and value bytes per unit of head_dim (two float16 tensors)."""
INCARNATION_IDS: Final = 10**12
"""Item ids of a producer's n-th incarnation start at n times this: unique across restarts."""

# -- pace --------------------------------------------------------------------------------

LEGIT_RATE_PER_S: Final = 50.0
LEGIT_BYTES: Final = 64 << 10
LOOKUP_WAIT_S: Final = 2.0
"""How long a taker's waiting lookup waits before it asks again."""
LEGIT_POLLS_PER_S: Final = 100.0
"""Lookups a second the legitimate consumer makes (twice the rate its items come in)."""
CALL_GRACE_S: Final = 2.0
"""What a lookup may take past its timeout and the consumer's reply timeout (an item's bytes,
a loaded host) before it counts as a call that hung."""
ERROR_PAUSE_S: Final = 0.05
"""A taker's pause after a failed call, so that a dead producer does not make it spin."""
STOP_S: Final = 15.0
"""How long a kvrt process has to stop when told (then it counts as hung and is killed)."""
START_S: Final = 60.0
SETTLE_POLL_S: Final = 0.1
RSS_SAMPLE_S: Final = 0.25


@dataclass(frozen=True, slots=True)
class Timing:
    """How long each part of a scenario runs (the full suite, or --quick)."""

    heartbeat_s: float
    baseline_s: float
    attack_s: float
    flood_s: float
    """The 50-consumer scenario's attack."""
    flood_consumers: int
    flood_processes: int
    connects: int
    """Connections the connect storm opens at once."""
    parked: int
    """Waiting lookups the parking peer posts."""
    garbage_per_s: float

    @property
    def lease_s(self) -> float:
        return self.heartbeat_s * HEARTBEAT_MISSES

    @property
    def stall_s(self) -> float:
        """A stall long enough that the stalled side's lease ends."""
        return self.lease_s * 1.5 + 0.5


FULL: Final = Timing(
    heartbeat_s=0.25, baseline_s=6.0, attack_s=12.0, flood_s=60.0, flood_consumers=50, flood_processes=5,
    connects=4000, parked=5000, garbage_per_s=2000.0,
)  # fmt: skip
QUICK: Final = Timing(
    heartbeat_s=0.1, baseline_s=2.0, attack_s=3.0, flood_s=5.0, flood_consumers=50, flood_processes=5,
    connects=1000, parked=5000, garbage_per_s=1000.0,
)  # fmt: skip


def _item(kind: int, item_id: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, key, value and hidden of item `item_id`: its tensors' bytes depend on the id, and
    its tokens carry the id and their CRC-32 (what `_whole` verifies on arrival)."""
    dim = max(1, nbytes // BYTES_PER_DIM)
    shape = (ITEM_LAYERS, ITEM_TOKENS, ITEM_HEADS, dim)
    pattern = torch.arange(math.prod(shape), dtype=torch.int16) ^ (item_id & 0x7FFF)
    key = pattern.view(torch.float16).reshape(shape)
    value = (pattern + 1).view(torch.float16).reshape(shape)
    hidden = torch.arange(ITEM_TOKENS * HIDDEN_WIDTH, dtype=torch.float32).reshape(ITEM_TOKENS, HIDDEN_WIDTH) + item_id
    tokens = torch.full((ITEM_TOKENS,), item_id, dtype=torch.int64) + torch.arange(ITEM_TOKENS)
    tokens[0], tokens[1], tokens[2] = kind, item_id, _crc((key, value, hidden))
    return tokens, key, value, hidden


def _crc(tensors: tuple[torch.Tensor | None, ...]) -> int:
    crc = 0
    for tensor in tensors:
        if tensor is not None:
            crc = zlib.crc32(tensor.contiguous().view(torch.uint8).numpy().data, crc)
    return crc


def _item_id(item: kvrt.KVItem) -> int:
    """The id an arrived item names (-1 if its tokens are not an item's of this suite)."""
    tokens = item.input_tokens
    if tokens.dtype != torch.int64 or tokens.shape != (ITEM_TOKENS,):
        return -1
    return int(tokens[1])


def _whole(item: kvrt.KVItem) -> bool:
    """Whether an arrived item's tokens and tensors are what was inserted under its id."""
    item_id = _item_id(item)
    if item_id < 0:
        return False
    tokens = item.input_tokens
    expected = torch.full((ITEM_TOKENS,), item_id, dtype=torch.int64) + torch.arange(ITEM_TOKENS)
    whole = bool(torch.equal(tokens[3:], expected[3:])) and int(tokens[0]) in (LEGIT, ATTACKED)
    return whole and int(tokens[2]) == _crc((item.key, item.value, item.hidden))


# -- what each process writes ------------------------------------------------------------


class _Journal:
    """Lines appended to a file with one write each: a process killed with SIGKILL keeps every
    line it wrote. `I id kind t_ns` an insert begins, `B id` it returned, `T id t_ns` an item
    was handed over, `V id ok` whether it arrived whole, `E name t_ns` a call failed, `L t_ns
    took_ns` a lookup of the legitimate consumer."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, line: str) -> None:
        os.write(self._fd, line.encode() + b"\n")

    def close(self) -> None:
        os.close(self._fd)


def _log_to(journal: str) -> None:
    """kvrt's warnings in a child go beside its journal, not into the suite's table (WARNING, as
    Python logs by default: INFO writes a line per consumer that joins or leaves)."""
    logging.basicConfig(filename=journal.removesuffix(".log") + ".messages", level=logging.WARNING, force=True)


def _journal_take(journal: _Journal, item: kvrt.KVItem) -> None:
    """An item handed over: journaled at once (a process killed right after still counts it as
    taken), then checked (`V id ok`; a take killed before its check is not counted as damaged)."""
    item_id = _item_id(item)
    journal.write(f"T {item_id} {time.monotonic_ns()}")
    journal.write(f"V {item_id} {int(_whole(item))}")


def _commands(control: multiprocessing.connection.Connection, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[Any]:
    """A child's commands from its pipe, read by a thread and queued on its loop (EOF: "stop")."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def read() -> None:
        while True:
            try:
                command = control.recv()
            except (EOFError, OSError):
                command = ("stop",)
            loop.call_soon_threadsafe(queue.put_nowait, command)
            if command[0] == "stop":
                return

    threading.Thread(target=read, daemon=True, name="kvrt-attack-commands").start()
    return queue


# -- the producer's process --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProducerPlan:
    bind: str
    journal: str
    incarnation: int
    heartbeat_s: float
    buffer_bytes: int
    legit_rate_per_s: float = LEGIT_RATE_PER_S
    legit_bytes: int = LEGIT_BYTES


def producer_main(plan: ProducerPlan, control: multiprocessing.connection.Connection) -> None:
    """Serve, insert legitimate items at a steady rate, and attacked items as told:
    ("attack", per_s, nbytes) (per_s inf: as fast as the buffer has room; 0: none),
    ("quiesce",) stops inserting and answers "quiet", ("stop",) closes."""
    _log_to(plan.journal)
    asyncio.run(_producer(plan, control))


async def _producer(plan: ProducerPlan, control: multiprocessing.connection.Connection) -> None:
    journal = _Journal(plan.journal)
    ids = iter(range(plan.incarnation * INCARNATION_IDS + 1, (plan.incarnation + 1) * INCARNATION_IDS))
    commands = _commands(control, asyncio.get_running_loop())
    async with kvrt.Producer(bind=plan.bind, heartbeat_s=plan.heartbeat_s, buffer_bytes=plan.buffer_bytes) as producer:

        async def insert(kind: int, per_s: float, nbytes: int) -> None:
            loop = asyncio.get_running_loop()
            next_at = loop.time()
            while True:
                item_id = next(ids)
                # Made in a thread (torch and zlib let go of the GIL): making a 2 MiB item is the
                # suite's work, and must not hold the loop whose latency the suite measures.
                tokens, key, value, hidden = await asyncio.to_thread(_item, kind, item_id, nbytes)
                journal.write(f"I {item_id} {kind} {time.monotonic_ns()}")
                await producer.insert(tokens, None, key, value, hidden)
                journal.write(f"B {item_id}")
                if math.isinf(per_s):
                    await asyncio.sleep(0)
                    continue
                next_at = max(next_at + 1 / per_s, loop.time())  # fallen behind: no burst to catch up
                await asyncio.sleep(next_at - loop.time())

        tasks = {"legit": asyncio.create_task(insert(LEGIT, plan.legit_rate_per_s, plan.legit_bytes))}
        control.send(("ready", producer.endpoint))
        try:
            while (command := await commands.get())[0] != "stop":
                if command[0] == "attack":
                    _, per_s, nbytes = command
                    if "attack" in tasks:
                        tasks.pop("attack").cancel()
                    if per_s > 0:
                        tasks["attack"] = asyncio.create_task(insert(ATTACKED, per_s, nbytes))
                elif command[0] == "quiesce":
                    for task in tasks.values():
                        task.cancel()
                    await asyncio.gather(*tasks.values(), return_exceptions=True)
                    tasks.clear()
                    control.send("quiet")
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
    journal.close()


# -- consumers that take items ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TakerPlan:
    endpoint: str
    journal: str
    kind: int | None
    """Which items (their first token); None takes any."""
    consumers: int = 1
    in_flight: int = 1
    """Waiting lookups each consumer keeps posted (when `polls_per_s` is 0)."""
    heartbeat_s: float = 1.0
    polls_per_s: float = 0.0
    """Above 0: each consumer makes this many lookups a second that answer at once, each
    journaled with how long it took (the legitimate consumer's latency), instead of waiting ones."""
    hold_s: float = 0.0
    """How long a consumer works on an item it took before it asks for the next (a decode step)."""


def taker_main(plan: TakerPlan, control: multiprocessing.connection.Connection) -> None:
    """`consumers` kvrt.Consumers taking items of `kind`, journaling every item handed over and
    every failed call, until told ("stop",); answers "stopped"."""
    _log_to(plan.journal)
    asyncio.run(_taker(plan, control))


async def _taker(plan: TakerPlan, control: multiprocessing.connection.Connection) -> None:
    journal = _Journal(plan.journal)
    commands = _commands(control, asyncio.get_running_loop())
    query = None if plan.kind is None else torch.tensor([plan.kind])
    wait_s = 0.0 if plan.polls_per_s > 0 else LOOKUP_WAIT_S
    allowed_ns = int((wait_s + DEFAULT_REPLY_TIMEOUT_S + CALL_GRACE_S) * 1e9)

    async def take_one(consumer: kvrt.Consumer) -> bool:
        """One lookup; whether it failed."""
        started = time.monotonic_ns()
        failed = False
        try:
            item = await consumer.drop_select(query, None, timeout=wait_s)
        except kvrt.KVRTError as exc:
            journal.write(f"E {type(exc).__name__} {time.monotonic_ns()}")
            item, failed = None, True
        journal.write(f"L {started} {time.monotonic_ns() - started} {allowed_ns}")
        if item is not None:
            _journal_take(journal, item)
            if plan.hold_s:
                await asyncio.sleep(plan.hold_s)
        return failed

    async def take(consumer: kvrt.Consumer) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            failed = await take_one(consumer)
            if plan.polls_per_s > 0:
                next_at = max(next_at + 1 / plan.polls_per_s, loop.time())  # fallen behind: no burst
                await asyncio.sleep(next_at - loop.time())
            elif failed:
                await asyncio.sleep(ERROR_PAUSE_S)

    async with contextlib.AsyncExitStack() as stack:
        consumers = []
        for _ in range(plan.consumers):
            made = kvrt.Consumer(connect=plan.endpoint, heartbeat_s=plan.heartbeat_s)
            consumers.append(await stack.enter_async_context(made))
        lookups = 1 if plan.polls_per_s > 0 else plan.in_flight
        tasks = [asyncio.create_task(take(consumer)) for consumer in consumers for _ in range(lookups)]
        control.send("ready")
        while (await commands.get())[0] != "stop":
            pass
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    journal.close()
    control.send("stopped")


def _stop_when_told(control: multiprocessing.connection.Connection) -> threading.Event:
    """An event set once `control` says anything, or closes (a raw peer's only command is stop)."""
    stop = threading.Event()

    def wait() -> None:
        with contextlib.suppress(EOFError, OSError):
            control.recv()
        stop.set()

    threading.Thread(target=wait, daemon=True, name="kvrt-attack-stop").start()
    return stop


# -- raw peers (ZeroMQ and msgpack by hand, as docs/protocol.md describes them) -----------

_ENCODER: Final = msgspec.msgpack.Encoder()
_VERSION: Final = PROTOCOL_VERSION
"""Frames here are built by hand, as an outside client would, in the version kvrt speaks."""


def _frame(message: dict[str, Any]) -> bytes:
    return _ENCODER.encode([_VERSION, message])


def _hello(name: str) -> bytes:
    return _frame({"type": "hello", "version": _VERSION, "name": name})


def _tokens(values: list[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype="<i8").tobytes()


def _dealer(context: zmq.Context[zmq.Socket[bytes]], endpoint: str, **options: int) -> zmq.Socket[bytes]:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, 1000)
    for name, value in options.items():
        socket.setsockopt(getattr(zmq, name), value)
    socket.connect(endpoint)
    return socket


def _drain(socket: zmq.Socket[bytes]) -> int:
    """Read every reply waiting (a peer that reads), without waiting for more."""
    read = 0
    with contextlib.suppress(zmq.Again):
        while True:
            socket.recv_multipart(zmq.NOBLOCK)
            read += 1
    return read


DEEP_FRAME: Final = b"\x92\x01" + b"\x91" * 1000 + b"\xc0"
"""Nested arrays deeper than any decoder's recursion (the frame that once ended the serve loop)."""
HUGE_HEADERS: Final = (
    b"\x92\x01\xdd\xff\xff\xff\xff",  # an array of 4G elements
    b"\x92\x01\xdf\xff\xff\xff\xff",  # a map of 4G pairs
    b"\x92\x01\xc6\xff\xff\xff\xff",  # 4 GiB of bin
    b"\x92\x01\xdb\xff\xff\xff\xff",  # a 4 GiB string
    b"\x92\x01\xc9\xff\xff\xff\xff\x01",  # 4 GiB of ext
    b"\xdd\xff\xff\xff\xff" + b"\xc0" * 64,  # an envelope claiming 4G elements
)


def _hostile_messages(rng: random.Random) -> Iterator[bytes]:
    """Frames that decode as msgpack but break the protocol: wrong types, out-of-range numbers,
    unknown tags, messages a producer never accepts, lists past their bounds."""
    big = 2**64 - 1
    yield _frame({"type": "drop_select", "request_id": big, "tokens": None})
    yield _frame({"type": "drop_select", "request_id": -1, "tokens": None})
    yield _frame({"type": "drop_select", "request_id": 1, "tokens": b"\x01\x02\x03"})
    yield _frame({"type": "drop_select", "request_id": 2, "tokens": _tokens([NEVER]), "timeout_s": float("nan")})
    yield _frame({"type": "drop_select", "request_id": 3, "tokens": _tokens([NEVER]), "timeout_s": float("inf")})
    yield _frame({"type": "drop_select", "request_id": 4, "tokens": _tokens([NEVER]), "timeout_s": -5.0})
    yield _frame({"type": "drop_select", "request_id": "x"})
    yield _frame({"type": "drop_select_many", "request_id": 5, "queries": [None] * 1000})
    yield _frame({"type": "received", "item_ids": list(range(5000))})
    yield _frame({"type": "received", "item_ids": [rng.randrange(1 << 40) for _ in range(64)]})
    yield _frame({"type": "release", "item_id": rng.randrange(1 << 40)})
    yield _frame({"type": "deliver", "request_id": 1, "item_id": 1})
    yield _frame({"type": "welcome", "version": _VERSION, "producer_id": "me", "heartbeat_s": 1.0})
    yield _frame({"type": "no_such_message"})
    yield _frame({"type": "hello", "version": 99})
    yield _frame({"type": "list_items", "request_id": 6, "limit": big})
    yield _frame({"type": "evict", "request_id": 7, "item_id": big})
    yield _ENCODER.encode([2, {"type": "ping"}])
    yield _ENCODER.encode({"type": "ping"})
    yield _ENCODER.encode([_VERSION, {"type": "ping", "nonce": 1.5}, 3, 4])


def garbage_main(
    endpoint: str, seconds: float, per_s: float, seed: int, control: multiprocessing.connection.Connection
) -> None:
    """For `seconds`: random bytes, deep nesting, huge sizes and hostile messages at `per_s`,
    from a stranger and from a peer that said hello; now and then a 16 MiB and a 64 MiB frame
    (each on a connection of its own: libzmq drops a connection over its message limit) and
    a message of a thousand frames. Reads its replies. Answers ("sent", frames)."""
    rng = random.Random(seed)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    stranger = _dealer(context, endpoint)
    member = _dealer(context, endpoint)
    member.send(_hello("garbage"))
    hostile = list(_hostile_messages(rng))
    sent = 0
    deadline = time.monotonic() + seconds
    next_big = time.monotonic()
    try:
        while time.monotonic() < deadline:
            for _ in range(max(1, int(per_s / 100))):
                roll = rng.random()
                if roll < 0.4:
                    frame = rng.randbytes(rng.randrange(1, 4096))
                elif roll < 0.5:
                    frame = DEEP_FRAME if rng.random() < 0.5 else b"\x92\x01" + b"\x91" * 100_000 + b"\xc0"
                elif roll < 0.6:
                    frame = rng.choice(HUGE_HEADERS)
                else:
                    frame = rng.choice(hostile)
                with contextlib.suppress(zmq.Again):
                    (stranger if rng.random() < 0.3 else member).send(frame)
                    sent += 1
            if time.monotonic() >= next_big:
                next_big += 1.0
                for size in (16 << 20, (64 << 20) + 1):
                    big = _dealer(context, endpoint)
                    with contextlib.suppress(zmq.Again):
                        big.send(b"\x92\x01\xc6" + size.to_bytes(4, "big") + bytes(size))
                        sent += 1
                    big.close()
                with contextlib.suppress(zmq.Again):
                    member.send_multipart([_frame({"type": "ping"})] + [b"x"] * 1000)
                    sent += 1
            _drain(stranger)
            _drain(member)
            time.sleep(0.01)  # pacing: `per_s` frames a second
    finally:
        stranger.close()
        member.close()
        context.term()
    control.send(("sent", sent))


def connects_main(endpoint: str, sockets: int, seconds: float, control: multiprocessing.connection.Connection) -> None:
    """Waves of `sockets` connections for `seconds`: a third never speak, a third say hello and
    go silent, a third say hello and post a waiting lookup; each wave closes before the next.
    Answers ("opened", connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8 * sockets + 256)), hard))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 2 * sockets + 64)  # a wave opens while the last one's are reaped
    opened = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            wave: list[zmq.Socket[bytes]] = []
            try:
                for index in range(sockets):
                    socket = _dealer(context, endpoint, RCVHWM=4)
                    wave.append(socket)
                    if index % 3:
                        socket.send(_hello(f"storm-{index}"))
                    if index % 3 == 2:
                        lookup = {"type": "drop_select", "request_id": 1, "tokens": _tokens([NEVER, index])}
                        socket.send(_frame({**lookup, "timeout_s": None}))
                opened += len(wave)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))  # the wave stays a while
            finally:
                for socket in wave:
                    socket.close(linger=0)
    finally:
        context.term()
    control.send(("opened", opened))


def non_reader_main(endpoint: str, kind: int, control: multiprocessing.connection.Connection) -> None:
    """A peer that says hello, asks for items of `kind` and for stats again and again, and never
    reads a reply: the items sent to it wait in its queue. Stops when told; answers ("sent", n)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = _dealer(context, endpoint, RCVHWM=16, SNDHWM=1000)
    socket.send(_hello("non-reader"))
    sent = 0
    stop = _stop_when_told(control)
    request_id = 0
    while not stop.is_set():
        request_id += 1
        if request_id % 2:
            message = {"type": "drop_select", "request_id": request_id, "tokens": _tokens([kind]), "timeout_s": None}
        else:
            message = {"type": "stats", "request_id": request_id}
        try:
            socket.send(_frame(message))
            sent += 1
        except zmq.Again:
            stop.wait(0.05)  # its own queue is full: the producer read what it could
    socket.close()
    context.term()
    control.send(("sent", sent))


def parker_main(
    endpoint: str, waiters: int, heartbeat_s: float, control: multiprocessing.connection.Connection
) -> None:
    """A live peer (it pings, and reads) that parks lookups that never match: 8 MiB of tokens
    each until refused, then `waiters` small ones, sent in one burst (built first, so that the
    burst costs the host's CPU nothing while the producer reads it). Stops when told; answers
    ("refused", n)."""
    large = np.full(MAX_TOKENS, NEVER, dtype="<i8")
    burst = []
    for request_id in range(1, LARGE_LOOKUPS + 1):
        large[1] = request_id
        burst.append(
            _frame({"type": "drop_select", "request_id": request_id, "tokens": large.tobytes(), "timeout_s": None})
        )
    for request_id in range(LARGE_LOOKUPS + 1, LARGE_LOOKUPS + waiters + 1):
        lookup = {"type": "drop_select", "request_id": request_id, "tokens": _tokens([NEVER, request_id])}
        burst.append(_frame({**lookup, "timeout_s": None}))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = _dealer(context, endpoint, SNDHWM=0, RCVHWM=0)
    socket.send(_hello("parker"))
    for frame in burst:
        socket.send(frame, copy=False)
    del burst
    refused = 0
    stop = _stop_when_told(control)
    nonce = 0
    while not stop.wait(heartbeat_s):
        nonce += 1
        socket.send(_frame({"type": "ping", "nonce": nonce}))
        with contextlib.suppress(zmq.Again):
            while True:
                reply = msgspec.msgpack.decode(socket.recv_multipart(zmq.NOBLOCK)[0])
                refused += isinstance(reply, list) and reply[1].get("code") == "capacity"
    socket.send(_frame({"type": "bye", "reason": "done"}))
    socket.close(linger=1000)
    context.term()
    control.send(("refused", refused))


def hoarder_main(endpoint: str, kind: int, heartbeat_s: float, control: multiprocessing.connection.Connection) -> None:
    """A live peer (it pings) that keeps `HOARDER_LOOKUPS` waiting lookups for items of `kind`
    posted and reads every item it is sent, but never confirms or releases one. Says "asked"
    once its lookups wait at the producer, ("got", n) at each item; stops when told (its bye
    gives them back) and answers ("held", n)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socket = _dealer(context, endpoint)
    socket.send(_hello("hoarder"))
    request_ids = iter(range(1, 1 << 62))

    def ask(timeout_s: float | None) -> int:
        request_id = next(request_ids)
        lookup = {"type": "drop_select", "request_id": request_id, "tokens": _tokens([kind])}
        socket.send(_frame({**lookup, "timeout_s": timeout_s}))
        return request_id

    for _ in range(HOARDER_LOOKUPS):
        ask(None)
    probe = _tokens([NEVER])
    socket.send(_frame({"type": "drop_select", "request_id": 0, "tokens": probe, "timeout_s": 0.0}))
    held = 0
    stop = _stop_when_told(control)
    nonce = 0
    while not stop.is_set():
        nonce += 1
        socket.send(_frame({"type": "ping", "nonce": nonce}))
        deadline = time.monotonic() + heartbeat_s
        while (left := deadline - time.monotonic()) > 0 and socket.poll(int(left * 1000) + 1):
            reply = msgspec.msgpack.decode(socket.recv_multipart()[0])
            kind_of = reply[1].get("type") if isinstance(reply, list) else None
            if kind_of == "miss" and reply[1].get("request_id") == 0:
                control.send("asked")  # answered in order: the waiting lookups are parked
            elif kind_of == "deliver":
                held += 1
                control.send(("got", held))
                ask(None)
    socket.send(_frame({"type": "bye", "reason": "done"}))
    socket.close(linger=1000)
    context.term()
    control.send(("held", held))


HOARDER_LOOKUPS: Final = 8


LARGE_LOOKUPS: Final = 16
"""Lookups of `MAX_TOKENS` tokens (8 MiB each) the parking peer posts: twice what one peer may park."""


# -- the orchestrator --------------------------------------------------------------------


@dataclass(slots=True)
class _Child:
    name: str
    process: multiprocessing.process.BaseProcess
    control: multiprocessing.connection.Connection
    promised: bool
    """A kvrt process (producer, consumers): that it stops when told is one of the promises."""


def _rss_bytes(pid: int | None) -> int:
    """A process's resident set (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_s(pid: int | None) -> float:
    """CPU seconds a process has used (user and system; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Run:
    """One scenario's processes, journals and measurements. Leaving it (`async with`) resumes
    and kills whatever it started that still runs."""

    def __init__(self, timing: Timing, directory: Path, context: multiprocessing.context.ForkServerContext) -> None:
        self.timing = timing
        self.directory = directory
        self._context = context
        self._children: list[_Child] = []
        self.rng = random.Random(0x6B767274)
        self.producer: _Child | None = None
        self.endpoint = "tcp://127.0.0.1:0"
        self.incarnation = 0
        self.killed_incarnations: set[int] = set()
        self.buffer_bytes = 1 << 30
        self.hung: list[str] = []
        self.stopped: set[str] = set()
        """Children stopped with SIGSTOP at some point: their calls' durations include the stop."""
        self.notes: list[str] = []
        self.rss_peak = 0
        self.delivered_by_producer: int | None = None
        """The producer's own count of items confirmed, read once drained."""

    async def __aenter__(self) -> _Run:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for child in self._children:
            if child.process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    assert child.process.pid is not None
                    os.kill(child.process.pid, signal.SIGCONT)
                child.process.kill()
            await asyncio.to_thread(child.process.join)
            child.control.close()

    def journal(self, name: str) -> str:
        return str(self.directory / f"{name}.log")

    def event(self, what: str) -> None:
        """A line in the run's `events` file (phases, signals, kills), on the journals' clock."""
        with open(self.directory / "events", "a") as events:
            events.write(f"{time.monotonic_ns()} {what}\n")

    async def spawn(self, name: str, target: Callable[..., None], *args: object, promised: bool) -> _Child:
        control, end = self._context.Pipe()
        process = self._context.Process(target=target, args=(*args, end), name=f"kvrt-attack-{name}", daemon=True)
        await asyncio.to_thread(process.start)
        end.close()  # the child's end lives in the child: its death is our EOF
        child = _Child(name, process, control, promised)
        self._children.append(child)
        self.event(f"started {name} pid {process.pid}")
        return child

    async def receive(self, child: _Child, timeout_s: float) -> Any:
        """The child's next message; None if it said nothing in time or died."""
        if not await asyncio.to_thread(child.control.poll, timeout_s):
            return None
        try:
            return child.control.recv()
        except (EOFError, OSError):
            return None

    async def start_producer(self) -> None:
        self.incarnation += 1
        plan = ProducerPlan(
            bind=self.endpoint, journal=self.journal(f"producer-{self.incarnation}"), incarnation=self.incarnation,
            heartbeat_s=self.timing.heartbeat_s, buffer_bytes=self.buffer_bytes,
        )  # fmt: skip
        child = await self.spawn(f"producer-{self.incarnation}", producer_main, plan, promised=True)
        ready = await self.receive(child, START_S)
        if not (isinstance(ready, tuple) and ready[0] == "ready"):
            raise RuntimeError(f"the producer did not start: {ready!r}")
        self.producer, self.endpoint = child, ready[1]

    async def start_taker(self, name: str, kind: int | None, **plan: Any) -> _Child:
        taker = TakerPlan(
            endpoint=self.endpoint, journal=self.journal(name), kind=kind, heartbeat_s=self.timing.heartbeat_s, **plan
        )
        child = await self.spawn(name, taker_main, taker, promised=True)
        if await self.receive(child, START_S) != "ready":
            raise RuntimeError(f"consumer process {name} did not start")
        return child

    def attack_items(self, per_s: float, nbytes: int) -> None:
        """Have the producer insert items for the attacking consumers (per_s 0: stop)."""
        assert self.producer is not None
        self.producer.control.send(("attack", per_s, nbytes))

    def signal(self, child: _Child, signum: int) -> None:
        assert child.process.pid is not None
        os.kill(child.process.pid, signum)
        if signum == signal.SIGSTOP:
            self.stopped.add(child.name)  # its own clock ran while it stood still
        self.event(f"{signal.Signals(signum).name} {child.name}")

    async def kill(self, child: _Child) -> None:
        self.event(f"SIGKILL {child.name}")
        child.process.kill()
        await asyncio.to_thread(child.process.join)

    async def stop(self, child: _Child, answer: object = "stopped") -> Any:
        """Tell a child to stop and wait for its answer and its exit; a kvrt process that does
        not stop within `STOP_S` counts as hung."""
        if not child.process.is_alive():
            return None
        with contextlib.suppress(OSError):
            child.control.send(("stop",))
        said = await self.receive(child, STOP_S)
        await asyncio.to_thread(child.process.join, STOP_S)
        if child.process.is_alive() or (answer is not None and said != answer and child.promised):
            if child.promised and child.process.is_alive():
                self.hung.append(child.name)
            await self.kill(child)
        return said

    async def stop_attackers(self) -> None:
        """Resume every stopped process, then stop every one but the producer and the legitimate consumer."""
        for child in self._children:
            if child.process.is_alive():
                self.signal(child, signal.SIGCONT)
        for child in self._children:
            if child is not self.producer and child.name != "legit" and child.process.is_alive():
                await self.stop(child, answer="stopped" if child.promised else None)

    async def quiesce(self) -> None:
        assert self.producer is not None
        self.producer.control.send(("quiesce",))
        if await self.receive(self.producer, STOP_S) != "quiet":
            self.hung.append(self.producer.name)

    def rss(self) -> int:
        return _rss_bytes(None if self.producer is None else self.producer.process.pid)

    def cpu_s(self) -> float:
        return _cpu_s(None if self.producer is None else self.producer.process.pid)

    async def sample_rss(self) -> None:
        while True:
            self.rss_peak = max(self.rss_peak, self.rss())
            await asyncio.sleep(RSS_SAMPLE_S)

    async def drain(self) -> bool:
        """Take every item the producer still holds, once what dropped peers held is back;
        whether it ended holding nothing within the deadline."""
        journal = _Journal(self.journal("sweeper"))
        deadline = time.monotonic() + 3 * self.timing.lease_s + STOP_S
        try:
            async with (
                kvrt.Consumer(connect=self.endpoint, heartbeat_s=self.timing.heartbeat_s) as sweeper,
                kvrt.Client(self.endpoint) as client,
            ):
                while time.monotonic() < deadline:
                    item = await sweeper.drop_select(None, None, timeout=0.0)
                    if item is not None:
                        _journal_take(journal, item)
                        continue
                    stats = await client.stats()
                    if stats.items == 0 and stats.in_flight == 0:
                        self.delivered_by_producer = stats.totals.get("delivered_items")
                        return True
                    await asyncio.sleep(SETTLE_POLL_S)
        except kvrt.KVRTError as exc:
            self.notes.append(f"drain failed: {type(exc).__name__}: {exc}")
        finally:
            journal.close()
        return False

    async def wait(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


# -- scenarios ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    what: str
    attack: Callable[[_Run], Awaitable[None]]
    on_producer: bool = False
    """The producer itself is stopped or killed: its consumers cannot be served meanwhile, so
    the latency goal does not apply (its calls must still end, typed, within their bounds)."""
    buffer_bytes: int = 1 << 30


async def _garbage(run: _Run) -> None:
    timing = run.timing
    child = await run.spawn(
        "garbage", garbage_main, run.endpoint, timing.attack_s, timing.garbage_per_s, 7, promised=False
    )
    said = await run.receive(child, timing.attack_s + START_S)
    run.notes.append(f"{said[1] if said else '?'} garbage frames sent")


async def _connects(run: _Run) -> None:
    timing = run.timing
    child = await run.spawn("connects", connects_main, run.endpoint, timing.connects, timing.attack_s, promised=False)
    said = await run.receive(child, timing.attack_s + START_S)
    run.notes.append(f"{said[1] if said else '?'} connections opened")


async def _non_reader(run: _Run) -> None:
    run.attack_items(50.0, LEGIT_BYTES)
    child = await run.spawn("non-reader", non_reader_main, run.endpoint, ATTACKED, promised=False)
    await run.wait(run.timing.attack_s)
    said = await run.stop(child, answer=None)
    run.notes.append(f"{said[1] if said else '?'} requests sent, none read")


async def _parked(run: _Run) -> None:
    timing = run.timing
    run.attack_items(50.0, LEGIT_BYTES)
    await run.start_taker("taker", ATTACKED, in_flight=2)
    child = await run.spawn("parker", parker_main, run.endpoint, timing.parked, timing.heartbeat_s, promised=False)
    await run.wait(timing.attack_s)
    said = await run.stop(child, answer=None)
    run.notes.append(f"{timing.parked} lookups parked, {said[1] if said else '?'} refused (capacity)")


HOARD_BUFFER_BYTES: Final = 16 << 20
"""The producer's buffer in the hoarding scenario: the hoarder's unconfirmed items fill it in a second or two."""


async def _hoarder(run: _Run) -> None:
    timing = run.timing
    run.attack_items(50.0, 256 << 10)
    await run.start_taker("healthy", ATTACKED, in_flight=2)  # wants the same items as the hoarder
    child = await run.spawn("hoarder", hoarder_main, run.endpoint, ATTACKED, timing.heartbeat_s, promised=False)
    await run.wait(timing.attack_s)
    await run.stop(child, answer=None)
    said: Any = None
    while (message := await run.receive(child, 0)) is not None:  # its reports, then its last word
        said = message
    run.notes.append(f"{said[1] if isinstance(said, tuple) else '?'} items held unconfirmed by one live peer")


async def _stall_consumer(run: _Run) -> None:
    """A consumer with waiting lookups is stopped for longer than its lease, again and again,
    at random moments (mid-transfer, holding delivered items, between a hand-over and its receipt)."""
    timing = run.timing
    run.attack_items(50.0, 256 << 10)
    stalled = await run.start_taker("stalled", ATTACKED, consumers=2, in_flight=2)
    await run.start_taker("healthy", ATTACKED, in_flight=2)
    deadline = time.monotonic() + max(timing.attack_s, 2 * timing.stall_s + 1)
    stalls = 0
    while time.monotonic() < deadline:
        await run.wait(run.rng.uniform(0.05, 0.6))
        run.signal(stalled, signal.SIGSTOP)
        await run.wait(timing.stall_s)
        run.signal(stalled, signal.SIGCONT)
        stalls += 1
    run.notes.append(f"{stalls} stalls of {timing.stall_s:.1f} s (lease {timing.lease_s:.1f} s)")


async def _kill_consumer(run: _Run) -> None:
    timing = run.timing
    run.attack_items(20.0, 2 << 20)
    await run.start_taker("healthy", ATTACKED, in_flight=1)
    kills = 0
    deadline = time.monotonic() + timing.attack_s
    while time.monotonic() < deadline:
        victim = await run.start_taker(f"victim-{kills}", ATTACKED, in_flight=2)
        await run.wait(run.rng.uniform(0.2, 0.8))
        await run.kill(victim)
        kills += 1
    run.notes.append(f"{kills} consumers killed with SIGKILL")


async def _kill_producer(run: _Run) -> None:
    timing = run.timing
    run.attack_items(20.0, 2 << 20)
    await run.start_taker("taker", ATTACKED, in_flight=2)
    await run.wait(run.rng.uniform(0.3, 1.0))
    assert run.producer is not None
    await run.kill(run.producer)
    run.killed_incarnations.add(run.incarnation)
    await run.start_producer()  # the same endpoint: the consumers' links reconnect by themselves
    run.attack_items(20.0, 2 << 20)
    await run.wait(timing.attack_s)
    run.notes.append("producer killed with SIGKILL mid-transfer, a new one started at its endpoint")


async def _stall_producer(run: _Run) -> None:
    timing = run.timing
    run.attack_items(20.0, 2 << 20)
    await run.start_taker("taker", ATTACKED, in_flight=2)
    await run.wait(run.rng.uniform(0.3, 1.0))
    assert run.producer is not None
    run.signal(run.producer, signal.SIGSTOP)
    await run.wait(timing.stall_s)
    run.signal(run.producer, signal.SIGCONT)
    await run.wait(timing.attack_s)
    run.notes.append(f"producer stopped for {timing.stall_s:.1f} s mid-transfer (lease {timing.lease_s:.1f} s)")


FLOOD_ITEM_BYTES: Final = 256 << 10
FLOOD_BUFFER_BYTES: Final = 4 << 20
"""Small enough that the producer's inserts wait for room all through the flood."""
FLOOD_HOLD_S: Final = 0.25


async def _flood(run: _Run) -> None:
    timing = run.timing
    run.attack_items(math.inf, FLOOD_ITEM_BYTES)
    per_process = math.ceil(timing.flood_consumers / timing.flood_processes)
    for index in range(timing.flood_processes):
        await run.start_taker(f"flood-{index}", ATTACKED, consumers=per_process, hold_s=FLOOD_HOLD_S)
    await run.wait(timing.flood_s)
    run.notes.append(
        f"{per_process * timing.flood_processes} consumers for {timing.flood_s:.0f} s, "
        f"buffer {FLOOD_BUFFER_BYTES >> 20} MiB (inserts wait for room)"
    )


SCENARIOS: Final = (
    Scenario("garbage", "random bytes, deep nesting, huge sizes, hostile fields, 16 and 64 MiB frames", _garbage),
    Scenario("connects", "waves of thousands of connections: silent, hello then silent, parked lookups", _connects),
    Scenario("non-reader", "a peer that asks for items and stats and never reads a reply", _non_reader),
    Scenario("parked", "one live peer parks thousands of lookups and 8 MiB queries", _parked),
    Scenario(
        "hoarder",
        "one live peer takes every item it can and never confirms one, beside a healthy consumer",
        _hoarder,
        buffer_bytes=HOARD_BUFFER_BYTES,
    ),
    Scenario("stall-consumer", "SIGSTOP of a consumer holding items, past its lease, then SIGCONT", _stall_consumer),
    Scenario("kill-consumer", "SIGKILL of consumers mid-transfer (2 MiB items)", _kill_consumer),
    Scenario("kill-producer", "SIGKILL of the producer mid-transfer, then a new one", _kill_producer, on_producer=True),
    Scenario(
        "stall-producer", "SIGSTOP of the producer mid-transfer, past the lease", _stall_producer, on_producer=True
    ),
    Scenario("flood", "50 consumers with backpressure", _flood, buffer_bytes=FLOOD_BUFFER_BYTES),
)


# -- counting ----------------------------------------------------------------------------


@dataclass(slots=True)
class Tally:
    scenario: str
    inserted: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    gone_with_producer: int = 0
    damaged: int = 0
    p99_base_ms: float = math.nan
    p99_attack_ms: float = math.nan
    legit_errors: int = 0
    legit_rate: float = math.nan
    """Legitimate items inserted a second (and taken by the legitimate consumer) during the attack,
    as a share of that rate before it."""
    rss_before: int = 0
    rss_after: int = 0
    rss_peak: int = 0
    cpu_base: float = math.nan
    """The producer's CPU use (a share of one core) before the attack, and during it."""
    cpu_attack: float = math.nan
    hung: list[str] = field(default_factory=list)
    overlong_calls: int = 0
    """Lookups of processes never stopped that took longer than their timeout, the reply
    timeout and `CALL_GRACE_S` together: calls that hung."""
    drained: bool = True
    latency_applies: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.p99_attack_ms / self.p99_base_ms if self.p99_base_ms > 0 else math.inf

    def failures(self) -> list[str]:
        failed = []
        if self.lost:
            failed.append(f"{self.lost} lost")
        if self.duplicated:
            failed.append(f"{self.duplicated} taken twice")
        if self.damaged:
            failed.append(f"{self.damaged} damaged")
        if self.hung:
            failed.append(f"did not stop when told: {', '.join(self.hung)}")
        if self.overlong_calls:
            failed.append(f"{self.overlong_calls} calls outlived their timeout")
        if not self.drained:
            failed.append("the producer still held items at the end")
        if self.latency_applies and not self.legit_rate >= LEGIT_RATE_GOAL:
            failed.append(f"the legitimate consumer got {self.legit_rate:.0%} of its items a second")
        if self.latency_applies and not self.ratio <= P99_RATIO_GOAL:
            failed.append(f"p99 {self.ratio:.1f}x the baseline's (goal <= {P99_RATIO_GOAL:g}x)")
        if self.rss_after - self.rss_before > RSS_GROWTH_GOAL_BYTES:
            failed.append(f"RSS grew {(self.rss_after - self.rss_before) / 2**20:.0f} MiB")
        return failed


def _read(path: Path) -> Iterator[list[str]]:
    with open(path) as journal:
        for line in journal:
            if line.endswith("\n"):  # a line cut by SIGKILL is not a record
                yield line.split()


def _p99_ms(durations_ns: list[int]) -> float:
    return float(np.percentile(np.array(durations_ns), 99)) / 1e6 if durations_ns else math.nan


def tally(run: _Run, scenario: Scenario, windows: tuple[int, int, int]) -> Tally:
    """Count, over every journal of the run, what was inserted and what every consumer got."""
    base_start, attack_start, attack_end = windows
    intents: dict[int, int] = {}  # item id -> producer incarnation
    legit_intents: dict[int, int] = {}  # legitimate item id -> when its insert began
    legit_taken: set[int] = set()
    buffered: set[int] = set()
    takes: dict[int, int] = {}
    result = Tally(scenario.name, latency_applies=not scenario.on_producer)
    base_ns: list[int] = []
    attack_ns: list[int] = []
    for path in sorted(run.directory.glob("*.log")):
        for record in _read(path):
            kind = record[0]
            if kind == "I":
                intents[int(record[1])] = int(record[1]) // INCARNATION_IDS
                if int(record[2]) == LEGIT:
                    legit_intents[int(record[1])] = int(record[3])
            elif kind == "B":
                buffered.add(int(record[1]))
            elif kind == "T":
                item_id = int(record[1])
                takes[item_id] = takes.get(item_id, 0) + 1
                if path.stem == "legit":
                    legit_taken.add(item_id)
            elif kind == "V":
                result.damaged += record[2] != "1"
            elif kind == "L":
                started, took = int(record[1]), int(record[2])
                if path.stem not in run.stopped and took > int(record[3]):
                    result.overlong_calls += 1
                if path.stem != "legit":
                    continue
                if base_start <= started < attack_start:
                    base_ns.append(took)
                elif attack_start <= started < attack_end:
                    attack_ns.append(took)
            elif kind == "E" and path.stem == "legit":
                result.legit_errors += attack_start <= int(record[2]) < attack_end
    result.damaged += len(set(takes) - set(intents))  # an id nobody inserted: not an item of this run
    inserted = buffered | (set(intents) & set(takes))  # an insert cut by SIGKILL may still have buffered it
    untaken = inserted - set(takes)
    result.inserted = len(inserted)
    result.delivered = len(inserted & set(takes))
    result.duplicated = sum(1 for count in takes.values() if count > 1)
    result.gone_with_producer = sum(1 for item_id in untaken if intents[item_id] in run.killed_incarnations)
    result.lost = len(untaken) - result.gone_with_producer
    result.p99_base_ms, result.p99_attack_ms = _p99_ms(base_ns), _p99_ms(attack_ns)
    served = [legit_intents[item_id] for item_id in legit_taken if item_id in legit_intents]
    base_rate = sum(base_start <= at < attack_start for at in served) / (attack_start - base_start)
    attack_rate = sum(attack_start <= at < attack_end for at in served) / (attack_end - attack_start)
    result.legit_rate = attack_rate / base_rate if base_rate else math.nan
    return result


# -- running -----------------------------------------------------------------------------


async def run_scenario(
    scenario: Scenario, timing: Timing, context: multiprocessing.context.ForkServerContext, keep: Path | None = None
) -> Tally:
    """One scenario from start to end: baseline, attack, settling, counting. `keep`: a folder
    to leave the journals (and each process's log) in, under the scenario's name."""
    with contextlib.ExitStack() as stack:
        if keep is None:
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kvrt-attack-{scenario.name}-")))
        else:
            directory = keep / scenario.name
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
        async with _Run(timing, directory, context) as run:
            run.buffer_bytes = scenario.buffer_bytes
            await run.start_producer()
            legit = await run.start_taker("legit", LEGIT, polls_per_s=LEGIT_POLLS_PER_S)
            base_start, cpu_at_base = time.monotonic_ns(), run.cpu_s()
            run.event("baseline")
            await run.wait(timing.baseline_s)
            rss_before = run.rss()
            attack_start, cpu_at_attack = time.monotonic_ns(), run.cpu_s()
            run.event("attack")
            sampler = asyncio.create_task(run.sample_rss())
            try:
                await scenario.attack(run)
                attack_end, cpu_at_end = time.monotonic_ns(), run.cpu_s()
                run.event("attack over")
                await run.stop_attackers()
                await run.quiesce()
                await run.stop(legit)
                run.event("drain")
                drained = await run.drain()
                run.event("drained" if drained else "not drained")
            finally:
                sampler.cancel()
            rss_after = run.rss()
            assert run.producer is not None
            await run.stop(run.producer, answer=None)
            result = tally(run, scenario, (base_start, attack_start, attack_end))
            result.drained, result.hung, result.notes = drained, run.hung, run.notes
            result.rss_before, result.rss_after, result.rss_peak = rss_before, rss_after, run.rss_peak
            result.cpu_base = (cpu_at_attack - cpu_at_base) / ((attack_start - base_start) / 1e9)
            if not run.killed_incarnations:  # a new producer's clock started at zero
                result.cpu_attack = (cpu_at_end - cpu_at_attack) / ((attack_end - attack_start) / 1e9)
                if run.delivered_by_producer is not None and run.delivered_by_producer != result.delivered:
                    result.notes.append(
                        f"the producer counts {run.delivered_by_producer} items confirmed, the journals "
                        f"{result.delivered} (a consumer killed between its receipt and its journal)"
                    )
                    # A confirmed item was handed over (its receipt came): as many of the untaken
                    # ones as the producer confirmed past the journals are delivered, not lost.
                    unjournaled = min(max(0, run.delivered_by_producer - result.delivered), result.lost)
                    result.lost -= unjournaled
                    result.delivered += unjournaled
            if run.killed_incarnations:
                result.notes.append("RSS after: the new producer's")
            return result


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f}"


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


HEADER: Final = (
    "scenario", "inserted", "delivered", "lost", "dup", "gone", "damaged",
    "p99 base ms", "p99 attack ms", "ratio", "legit rate", "CPU base", "attack",
    "RSS before", "after", "peak MiB", "goal",
)  # fmt: skip


def _row(result: Tally) -> tuple[str, ...]:
    ratio = f"{result.ratio:.1f}x" if result.latency_applies else f"({result.ratio:.1f}x)"
    return (
        result.scenario, str(result.inserted), str(result.delivered), str(result.lost), str(result.duplicated),
        str(result.gone_with_producer), str(result.damaged), _ms(result.p99_base_ms), _ms(result.p99_attack_ms),
        ratio, _share(result.legit_rate), _share(result.cpu_base), _share(result.cpu_attack),
        _mib(result.rss_before), _mib(result.rss_after), _mib(result.rss_peak),
        "FAIL" if result.failures() else "ok",
    )  # fmt: skip


def _print_table(results: list[Tally]) -> None:
    rows = [HEADER, *(_row(result) for result in results)]
    widths = [max(len(row[column]) for row in rows) for column in range(len(HEADER))]
    for row in rows:
        print(
            "  ".join(
                cell.rjust(width) if index else cell.ljust(width)
                for index, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
        )


def _goal_line(result: Tally) -> str:
    latency = (
        f"p99 {result.ratio:.1f}x <= {P99_RATIO_GOAL:g}x"
        if result.latency_applies
        else "p99 goal n/a (the producer itself is attacked)"
    )
    growth = (result.rss_after - result.rss_before) / 2**20
    verdict = "PASS" if not result.failures() else "FAIL: " + "; ".join(result.failures())
    return (
        f"{result.scenario}: {result.lost} lost, {result.duplicated} duplicated, {result.damaged} damaged, "
        f"{result.gone_with_producer} gone with the producer, {result.overlong_calls} calls past their timeout; "
        f"{latency}; RSS {growth:+.0f} MiB "
        f"(<= {RSS_GROWTH_GOAL_BYTES >> 20}); legit errors {result.legit_errors} -> {verdict}"
        + (f"  [{'; '.join(result.notes)}]" if result.notes else "")
    )


def main(args: argparse.Namespace) -> int:
    timing = QUICK if args.quick else FULL
    chosen = [scenario for scenario in SCENARIOS if not args.only or scenario.name in args.only]
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    print(
        f"kvrt attack{' --quick' if args.quick else ''}: {len(chosen)} scenarios; heartbeat {timing.heartbeat_s} s "
        f"(lease {timing.lease_s:.1f} s), baseline {timing.baseline_s:g} s, attack {timing.attack_s:g} s",
        flush=True,
    )
    results = []
    for scenario in chosen:
        print(f"-- {scenario.name}: {scenario.what}", flush=True)
        result = asyncio.run(run_scenario(scenario, timing, context, None if args.keep is None else Path(args.keep)))
        print(_goal_line(result), flush=True)
        results.append(result)
    print()
    _print_table(results)
    failed = [result.scenario for result in results if result.failures()]
    if args.json:
        report = [
            {**dataclasses.asdict(result), "p99_ratio": result.ratio, "failures": result.failures()}
            for result in results
        ]
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(
        f"\noverall: {sum(r.lost for r in results)} lost, {sum(r.duplicated for r in results)} duplicated, "
        f"{sum(r.damaged for r in results)} damaged over {sum(r.inserted for r in results)} items; "
        + ("every goal met" if not failed else f"goals missed in {', '.join(failed)}")
    )
    print(
        f"goals: 0 lost, 0 duplicated, 0 damaged, every kvrt process stops when told and no call outlives its "
        f"timeout + reply_timeout_s + {CALL_GRACE_S:g} s; the legitimate consumer gets at least "
        f"{LEGIT_RATE_GOAL:.0%} of its items a second, and its "
        f"p99 under attack <= {P99_RATIO_GOAL:g}x its p99 before the attack (same run); the producer's RSS once "
        f"drained at most {RSS_GROWTH_GOAL_BYTES >> 20} MiB above its RSS right before the attack"
    )
    return 1 if failed else 0
