"""The connector's worker side, in each vLLM worker process: kvrt's producer and consumers over
vLLM's paged KV cache. Plain values in and out (`Save`, `Load`, layer indexes): `connector.py`
maps vLLM's calls onto it, so a test drives it with no vLLM installed (on a GPU host too).

Who calls what, each from vLLM's model-runner thread, once a step in this order:

    start_loads(loads)         before the forward pass: every load's stream opened at once
                               (one message each, all in flight together), into vLLM's blocks;
                               posted to kvrt's loop: returns at once
    wait_layer(i)              before attention of layer i: returns once layer i of every load
                               is written (on a GPU: the caller's stream waits for the writes)
    save_layer(saves, i)       after layer i is written: layer i of the step's finished
                               prompts published from the pages (the first layer opens them;
                               on the host each prompt whole at the step's end); posted:
                               returns at once
    end_step() -> StepOutcome  after the forward pass: the step's streams ended; which loads
                               failed, whose blocks vLLM recomputes

All of kvrt's work runs on one loop thread this object owns. The calls that start work post it
there and return at once (`LoopThread.post`: they never wait for that thread); only the two
waits vLLM's interface documents wait for it, `wait_layer` (`wait_for_layer_load`) and
`end_step` (`wait_for_save`), each bounded. The pools are vLLM's own pages, read and written
in place: nothing here copies them aside.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import torch

import kvrt
from kvrt._caller_stream import caller_stream
from kvrt._loop_thread import LoopThread
from kvrt._loop_watch import WatchIntervals
from kvrt._messages import MAX_BATCH
from kvrt._protocol import DEFAULT_HEARTBEAT_S
from kvrt.integrations.vllm._lookups import SILENT_BACKOFF_S
from kvrt.integrations.vllm._scheduler import Load, Save
from kvrt.integrations.vllm._tp import Piece, heads_of, pieces_for, publishes

log = logging.getLogger("kvrt.integrations.vllm")

OPEN_BOUND_FACTOR: Final = 3
OPEN_BOUND_SLACK_S: Final = 10.0
"""The longest `wait_layer` waits for the step's loads to be opened: a consumer's handshake and
its open each answer within the lookup timeout, so this many of them and the slack (a loop
thread that waits for the GIL on a busy host) bound it; past it, kvrt's loop is stuck."""

END_BOUND_FACTOR: Final = 6
"""As `OPEN_BOUND_FACTOR` for `end_step`, which also waits for the loads' ends and the saves'."""


LOOP_REPORT_EVERY_S: Final = 1.0
"""How often the worker's loop figures go out with its counters (vLLM asks every step)."""


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What the worker side needs of the connector's configuration and of its rank."""

    produces: bool
    consumes: bool
    bind: str | None
    """The address this rank's producer binds (prefill)."""
    buffer_bytes: int
    item_ttl_s: float | None
    connect_timeout_s: float
    """How long a producer may take to connect, or to answer a load (`lookup_timeout_s`)."""
    rank: int = 0
    tp: int = 1
    """This rank and the instance's tensor-parallel size."""
    total_heads: int = 1
    """The model's KV heads, over every rank."""
    mla: bool = False
    transport: str | None = None
    """kvrt's data plane (None: chosen by kvrt, e.g. cuda_ipc between GPUs of one host)."""
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    """How often kvrt's peers hear from each other (ten silent periods: lost)."""
    cores: frozenset[int] | None = None
    """The CPU cores kvrt's threads run on (None: those of the thread that makes this side)."""
    layers_as_computed: bool | None = None
    """Whether a prefill publishes each layer as the forward pass wrote it (a stream a decode
    may read while the prefill runs), or the step's layers at its end, in one hand-off to kvrt's
    thread (each prompt whose every layer the step wrote published whole, `Producer.publish`).
    None: as computed on a GPU, where a layer's gather overlaps the next layer's pass;
    at the step's end on the host, where nothing overlaps it and a hand-off a layer costs the
    model runner's thread a wait for the GIL each."""

    @property
    def heads(self) -> slice | None:
        """The model's KV heads this rank holds (None for a latent: every rank holds it whole)."""
        return None if self.mla else heads_of(self.rank, self.tp, self.total_heads)

    @property
    def publishes(self) -> bool:
        """Whether this prefill rank publishes (where ranks hold copies, the first of them)."""
        return self.produces and publishes(self.rank, self.tp, self.total_heads, mla=self.mla)


@dataclass(slots=True)
class StepOutcome:
    """What a step's loads came to, for the scheduler and for vLLM."""

    settled: set[str] = field(default_factory=set)
    """Every load of the step, landed or not."""
    failed: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)
    """The blocks of the failed loads: vLLM recomputes them (on every rank: it joins the
    ranks' reports, so the group loads a request on all ranks or on none)."""
    lost: set[str] = field(default_factory=set)
    """Producers a load found gone or too slow: the scheduler plans no load from them for a while."""


@dataclass(slots=True)
class _Reading:
    """A load in flight: one stream per piece of this rank's heads (one, without TP)."""

    load: Load
    streams: list[kvrt.ConsumerStream]
    failed: bool = False
    landed: list[list[torch.cuda.Event | None]] | None = None
    """Per stream, every layer's landing event, once all layers are there (a finished item
    comes whole): `wait_layer` then waits on them in the caller's thread."""


class WorkerSide:
    """kvrt's side of one vLLM worker (see the module docstring)."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self._settings = settings
        self._loop = LoopThread("kvrt-worker", "connector's worker", cores=settings.cores)
        self._loop_intervals = WatchIntervals(self._loop.watch, "worker_")
        self._pools: kvrt.PoolTable | None = None
        self._producer: kvrt.Producer | None = None
        self._consumers: dict[tuple[str, int], kvrt.Consumer] = {}
        """On the loop: one consumer per producer (and its readers), kept while it answers."""
        self._starting: dict[tuple[str, int], asyncio.Future[kvrt.Consumer]] = {}
        """On the loop: the handshakes of consumers not yet started."""
        self._lost: dict[str, tuple[float, float]] = {}
        """Per producer that failed a load: until when its loads fail at once, and the backoff."""
        self._reading: list[_Reading] = []
        """On the loop: the step's loads, once opened."""
        self._opening: concurrent.futures.Future[None] | None = None
        """The step's loads being opened (posted by `start_loads`), until `end_step`."""
        self._writing: list[kvrt.ProducerStream] = []
        """On the loop: the streams of the step's saves."""
        self._saving = False
        """Whether the step posted saves (their streams end in `end_step`)."""
        self._held_layers: list[tuple[Sequence[Save], int, torch.cuda.Stream | None]] = []
        """On the host: the step's layers to publish, posted with the step's end in one hand-off."""
        self._last_post: concurrent.futures.Future[None] | None = None
        """What `_post_in_order` posted last."""
        self._open_bound_s = OPEN_BOUND_FACTOR * settings.connect_timeout_s + OPEN_BOUND_SLACK_S
        self._end_bound_s = END_BOUND_FACTOR * settings.connect_timeout_s + OPEN_BOUND_SLACK_S
        self._outcome = StepOutcome()
        self.counters: collections.Counter[str] = collections.Counter()
        """Since the last `take_counters`: loads, failed_loads, loaded_tokens, saves, refused_saves."""

    @property
    def endpoint(self) -> str | None:
        """Where this rank's producer is bound (None on a decode rank, or a prefill rank whose
        heads an earlier rank publishes)."""
        return None if self._producer is None else self._producer.endpoint

    def register(self, pools: kvrt.PoolTable) -> None:
        """vLLM's KV cache as kvrt's pools (once, at start); a publishing rank binds here."""
        self._pools = pools
        if self._settings.publishes:
            self._loop.call(self._start_producer, "starting the producer")

    async def _start_producer(self) -> None:
        settings = self._settings
        assert settings.bind is not None and self._pools is not None
        producer = kvrt.Producer(
            bind=settings.bind, device=self._pools.device, buffer_bytes=settings.buffer_bytes,
            item_ttl_s=settings.item_ttl_s, heads=settings.heads, transport=settings.transport,
            heartbeat_s=settings.heartbeat_s,
        )  # fmt: skip
        await producer.start()
        producer.register_pools(self._pools)
        self._producer = producer
        log.info("kvrt producer bound at %s", producer.endpoint)

    # -- loads (decode) ------------------------------------------------------------------------

    def start_loads(self, loads: Sequence[Load]) -> None:
        """Post the opening of the step's loads (their streams, into vLLM's blocks) and return."""
        if not loads:
            return
        stream = caller_stream(None, self._device())  # the model runner's: the writes wait for its work
        self._opening = self._post_in_order(lambda: self._open_all(loads, stream), "start_load_kv")

    def _post_in_order(self, function: Callable[[], Awaitable[None]], what: str) -> concurrent.futures.Future[None]:
        """Post `function` to run once what was posted before it ended (the layers of a save in
        their order, the step's end after them), and return at once."""
        previous = self._last_post

        async def in_order() -> None:
            if previous is not None and not previous.done():
                await asyncio.wait([asyncio.wrap_future(previous)])  # whatever came of it
            await function()

        self._last_post = self._loop.post(in_order, what)
        return self._last_post

    def _device(self) -> torch.device:
        assert self._pools is not None, "vLLM registers its KV cache before the first step"
        return self._pools.device

    def _opened(self) -> None:
        """Wait for the step's loads to be opened (bounded: each open is, by the lookup timeout,
        and this wait by `OPEN_BOUND_FACTOR` of them and the slack), after which `_reading`
        holds them."""
        opening = self._opening
        if opening is None or opening.done():
            return
        try:
            opening.result(self._open_bound_s)
        except concurrent.futures.TimeoutError:
            raise kvrt.KVRTTimeoutError(
                f"the step's loads were not opened within {self._open_bound_s:.0f} s (kvrt's loop thread is held): "
                "raise lookup_timeout_s on a host whose cores are all busy", phase="reply",
            ) from None  # fmt: skip

    async def _open_all(self, loads: Sequence[Load], stream: torch.cuda.Stream | None) -> None:
        published = [load for load in loads if load.published]
        streamed = [load for load in loads if not load.published]
        opening = asyncio.gather(*(self._open(load, stream) for load in streamed), return_exceptions=True)
        opened, outcomes = await asyncio.gather(self._fetch_all(published, stream), opening)  # all at once
        for load, outcome in zip(streamed, outcomes, strict=True):
            if isinstance(outcome, BaseException):  # a bug: the load fails, the others go on
                log.error("opening the load of request %s failed", load.request_id, exc_info=outcome)
                failed = _Reading(load, [])
                self._fail(failed, type(outcome).__name__)
                outcome = failed
            opened.append(outcome)
        for reading in opened:
            landed = [piece.landed_layers() for piece in reading.streams]
            if not reading.failed and all(events is not None for events in landed):
                reading.landed = [events for events in landed if events is not None]
        self._reading += opened

    async def _fetch_all(self, loads: Sequence[Load], stream: torch.cuda.Stream | None) -> list[_Reading]:
        """The step's loads that the prefills' words name, fetched into vLLM's blocks: one
        `Consumer.fetch` per producer (and head range), all started before any is waited for.
        A load fails when a piece of it did not land whole."""
        if not loads:
            return []
        settings = self._settings
        readings = [_Reading(load, [], landed=[]) for load in loads]
        groups: dict[tuple[str, int, int], tuple[Piece, list[_Reading]]] = {}
        for reading in readings:
            self.counters["loads"] += 1
            self._outcome.settled.add(reading.load.request_id)
            prefill_tp = len(reading.load.endpoints)
            for piece in pieces_for(settings.rank, settings.tp, prefill_tp, settings.total_heads, mla=settings.mla):
                key = (reading.load.endpoints[piece.prefill_rank], piece.prefill_rank, prefill_tp)
                groups.setdefault(key, (piece, []))[1].append(reading)
        started = [self._fetch(key[0], piece, members, stream) for key, (piece, members) in groups.items()]
        await asyncio.gather(*started)
        return readings

    async def _fetch(
        self, endpoint: str, piece: Piece, readings: list[_Reading], stream: torch.cuda.Stream | None
    ) -> None:
        """One producer's share of the step's fetched loads (one head range of each)."""
        assert self._pools is not None
        lost = self._lost.get(endpoint)
        if lost is not None and time.monotonic() < lost[0]:
            for reading in readings:
                self._fail(reading, f"the producer at {endpoint} was unreachable moments ago")
            return
        try:
            consumer = await self._consumer(endpoint, piece.readers)
            fetches = [
                consumer.fetch(
                    [_int64(reading.load.tokens) for reading in chunk],
                    into=self._pools,
                    slots=[_int64(reading.load.slots) for reading in chunk],
                    skip=[reading.load.skip for reading in chunk],
                    heads=piece.heads,
                    stream=stream,
                )
                for chunk in _chunks(readings, MAX_BATCH)
            ]
            # Every one ended before the step goes on, failed or not: no write lands later.
            outcomes = await asyncio.gather(*(fetch.landed() for fetch in fetches), return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
            found = [matched for outcome in outcomes if isinstance(outcome, list) for matched in outcome]
        except kvrt.KVRTError as exc:
            if isinstance(exc, kvrt.PeerLostError | kvrt.ClosedError | kvrt.KVRTTimeoutError):
                await self._drop_consumer((endpoint, piece.readers))
                self._lose(endpoint)
            for reading in readings:
                self._fail(reading, f"{endpoint}: {exc}")
            return
        self._lost.pop(endpoint, None)
        for reading, matched in zip(readings, found, strict=True):
            if matched < len(reading.load.tokens):
                wanted = len(reading.load.tokens)
                why = "nothing matched" if not matched else f"only {matched} of {wanted} tokens matched"
                self._fail(reading, f"{why} at {endpoint}: the KV was taken or evicted since the prefill's word")

    async def _open(self, load: Load, stream: torch.cuda.Stream | None) -> _Reading:
        """Every piece of a load's stream opened at once; a load with a piece that failed is
        failed, its other streams kept until their writes are done (`end_step`)."""
        self.counters["loads"] += 1
        self._outcome.settled.add(load.request_id)
        settings = self._settings
        pieces = pieces_for(settings.rank, settings.tp, len(load.endpoints), settings.total_heads, mla=settings.mla)
        opened = await asyncio.gather(*(self._open_piece(load, piece, stream) for piece in pieces))
        # A stream that matched too few tokens is kept all the same: its layers land in the
        # load's first slots, and end_step waits for their writes.
        reading = _Reading(load, [result for result in opened if isinstance(result, kvrt.ConsumerStream)])
        failures = [result for result in opened if isinstance(result, str)]
        failures += [
            f"only {piece.matched} of {len(load.tokens)} tokens matched"
            for piece in reading.streams
            if piece.matched < len(load.tokens)
        ]
        if failures:
            self._fail(reading, failures[0])
        return reading

    async def _open_piece(
        self, load: Load, piece: Piece, stream: torch.cuda.Stream | None
    ) -> kvrt.ConsumerStream | str:
        """One piece's stream, or why it is not there."""
        assert self._pools is not None
        endpoint = load.endpoints[piece.prefill_rank]
        lost = self._lost.get(endpoint)
        if lost is not None and time.monotonic() < lost[0]:
            return f"the producer at {endpoint} was unreachable moments ago: not asked again for {lost[1]:.0f} s"
        try:
            consumer = await self._consumer(endpoint, piece.readers)
            opened = await consumer.open_stream(
                _int64(load.tokens), into=self._pools,
                slots=_int64(load.slots), skip=load.skip, stream=stream, heads=piece.heads,
            )  # fmt: skip
        except kvrt.KVRTError as exc:
            if isinstance(exc, kvrt.PeerLostError | kvrt.ClosedError | kvrt.KVRTTimeoutError):
                # Gone, or too slow to load from: its later loads fail at once for a while
                # (each would hold the forward pass up to the timeout), and the scheduler
                # plans none from it meanwhile.
                await self._drop_consumer((endpoint, piece.readers))
                self._lose(endpoint)
            return f"{endpoint}: {exc}"
        self._lost.pop(endpoint, None)
        if opened is None:
            return f"nothing matched at {endpoint}: the KV was taken or evicted since the lookup"
        return opened

    async def _consumer(self, endpoint: str, readers: int) -> kvrt.Consumer:
        """The consumer of a producer (one per producer, whose handshake every load waits for)."""
        key = (endpoint, readers)
        consumer = self._consumers.get(key)
        if consumer is None:
            consumer = self._consumers[key] = kvrt.Consumer(
                connect=endpoint, device=self._device(), connect_timeout_s=self._settings.connect_timeout_s,
                reply_timeout_s=self._settings.connect_timeout_s, readers=readers, transport=self._settings.transport,
                heartbeat_s=self._settings.heartbeat_s,
            )  # fmt: skip
            self._starting[key] = asyncio.ensure_future(consumer.start())
        starting = self._starting.get(key)
        if starting is not None:
            try:
                await asyncio.shield(starting)
            except BaseException:
                if self._consumers.get(key) is consumer:  # a failed start closed it: the next load connects afresh
                    del self._consumers[key]
                raise
            finally:
                if starting.done() and self._starting.get(key) is starting:
                    del self._starting[key]
        return consumer

    async def _drop_consumer(self, key: tuple[str, int]) -> None:
        consumer = self._consumers.pop(key, None)
        starting = self._starting.pop(key, None)
        if starting is not None and not starting.done():
            starting.cancel()
        if consumer is not None:
            await consumer.aclose()

    def _lose(self, endpoint: str) -> None:
        """`endpoint` failed a load: loads from it fail at once for a while (doubling while it
        keeps failing), and the step's outcome names it for the scheduler."""
        first, longest = SILENT_BACKOFF_S
        _, backoff = self._lost.pop(endpoint, (0.0, first / 2))
        backoff = min(2 * backoff, longest)
        self._lost[endpoint] = (time.monotonic() + backoff, backoff)
        self._outcome.lost.add(endpoint)

    def _fail(self, reading: _Reading, why: object) -> None:
        if reading.failed and reading.load.request_id in self._outcome.failed:
            return
        load = reading.load
        log.warning("loading request %s from %s failed (%s): vLLM recomputes it", load.request_id, load.endpoints, why)
        reading.failed = True
        self.counters["failed_loads"] += 1
        self._outcome.failed.add(load.request_id)
        self._outcome.failed_blocks.update(load.block_ids)

    def wait_layer(self, layer: int) -> None:
        """Return once layer `layer` of every load of the step is written (on a GPU: the
        caller's stream waits for the writes). Loads whose layers are all there (finished
        items) are waited for here, on the caller's thread; others on kvrt's loop."""
        stream = caller_stream(None, self._device())
        self._opened()
        streaming = False
        for reading in self._reading:
            if reading.failed:
                continue
            if reading.landed is None:
                streaming = True
                continue
            for events in reading.landed:
                event = events[layer]
                if event is not None and stream is not None:
                    stream.wait_event(event)
        if streaming:
            self._loop.call(lambda: self._wait_layer(layer, stream), "wait_for_layer_load")

    async def _wait_layer(self, layer: int, stream: torch.cuda.Stream | None) -> None:
        async def one(reading: _Reading) -> None:
            try:
                await asyncio.gather(*(piece.layer(layer, stream=stream) for piece in reading.streams))
            except kvrt.KVRTError as exc:
                self._fail(reading, exc)

        await asyncio.gather(
            *(one(reading) for reading in self._reading if not reading.failed and reading.landed is None)
        )

    # -- saves (prefill) -----------------------------------------------------------------------

    def save_layer(self, saves: Sequence[Save], layer: int) -> None:
        """Publish layer `layer` of the step's finished prompts (the first layer opens them)."""
        if self._producer is None or (not saves and not self._saving):
            return
        self._saving = True
        stream = caller_stream(None, self._device())
        as_computed = self._settings.layers_as_computed
        if not (self._device().type == "cuda" if as_computed is None else as_computed):
            self._held_layers.append((saves, layer, stream))  # published with the step's end
            return
        self._post_in_order(lambda: self._save_layer(saves, layer, stream), "save_kv_layer")

    async def _save_layer(self, saves: Sequence[Save], layer: int, stream: torch.cuda.Stream | None) -> None:
        """Publish layer `layer` of the step's finished prompts, as the forward pass wrote it
        (the first layer opens their streams)."""
        producer = self._producer
        assert producer is not None
        if layer == 0:
            for save in saves:
                tokens, slots = _int64(save.tokens), _int64(save.slots)
                try:
                    self._writing.append(await producer.open_stream(tokens, slots=slots, timeout=0, stream=stream))
                    self.counters["saves"] += 1
                except kvrt.KVRTError as exc:
                    self.counters["refused_saves"] += 1
                    log.warning("request %s is not published: %s", save.request_id, exc)
        for writing in list(self._writing):
            try:
                await writing.put_layer(stream=stream)
            except kvrt.KVRTError as exc:
                log.warning("publishing layer %d failed: %s", layer, exc)
                self._writing.remove(writing)
                await writing.abort(str(exc))

    async def _publish_held(self, held: Sequence[tuple[Sequence[Save], int, torch.cuda.Stream | None]]) -> None:
        """The step's finished prompts, every layer in the pages by the step's end (the host's):
        each published whole (`Producer.publish`: every layer gathered straight into its item,
        one copy and one hand-off to kvrt's gather thread a prompt), not as a stream (a gather a
        layer and a second copy into the whole item at its finish). A step that saved only some
        layers (a forward pass that stopped short) publishes none of its prompts: pages that
        are not all of a prompt's KV are never offered, and a decode's load of it fails."""
        producer, pools = self._producer, self._pools
        assert producer is not None and pools is not None
        saves, _, stream = held[0]
        layers = [layer for _, layer, _ in held]
        if layers != list(range(pools.layers)):
            log.warning("the step saved layers %s of %d: its %d prompts are not published", layers, pools.layers,
                        len(saves))  # fmt: skip
            return
        outcomes = await asyncio.gather(
            *(producer.publish(_int64(save.tokens), _int64(save.slots), timeout=0, stream=stream) for save in saves),
            return_exceptions=True,
        )
        for save, outcome in zip(saves, outcomes, strict=True):
            if isinstance(outcome, kvrt.KVRTError):
                self.counters["refused_saves"] += 1
                log.warning("request %s is not published: %s", save.request_id, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                self.counters["saves"] += 1

    # -- the step's end ------------------------------------------------------------------------

    def take_counters(self) -> dict[str, float]:
        """What happened since the last call (vLLM's connector stats report it per interval),
        with the worker's loop's figures once a `LOOP_REPORT_EVERY_S` (`worker_loop_*`)."""
        counters, self.counters = self.counters, collections.Counter()
        return {**counters, **self._loop_intervals.take(LOOP_REPORT_EVERY_S)}

    def end_step(self) -> StepOutcome:
        """End the step's streams; what its loads came to."""
        if self._saving or self._opening is not None:
            stream = caller_stream(None, self._device())
            opening, self._opening, self._saving = self._opening, None, False
            held, self._held_layers = self._held_layers, []
            ending = self._post_in_order(lambda: self._end_step(opening, stream, held), "wait_for_save")
            try:
                ending.result(self._end_bound_s)
            except TimeoutError:
                raise kvrt.KVRTTimeoutError(
                    f"the step's loads and saves did not end within {self._end_bound_s:.0f} s (kvrt's loop thread is "
                    "held): raise lookup_timeout_s on a host whose cores are all busy", phase="transfer",
                ) from None  # fmt: skip
        outcome, self._outcome = self._outcome, StepOutcome()
        return outcome

    async def _end_step(
        self, opening: concurrent.futures.Future[None] | None, stream: torch.cuda.Stream | None,
        held: Sequence[tuple[Sequence[Save], int, torch.cuda.Stream | None]] = (),
    ) -> None:  # fmt: skip
        if held:
            await self._publish_held(held)
        if opening is not None:  # posted before: started already; bounded by the lookup timeout
            await asyncio.wrap_future(opening)
        writing, self._writing = self._writing, []
        for written in writing:
            try:
                if written.published == written.layers:
                    await written.finish(stream=stream)
                else:
                    await written.abort("the forward pass did not publish every layer")
            except kvrt.KVRTError as exc:
                log.warning("a stream did not end: %s", exc)
        reading, self._reading = self._reading, []
        for read in reading:
            for piece in read.streams:
                if read.failed:
                    # vLLM recomputes these pages: no late write of kvrt's may land over its own.
                    await piece.writes_done(stream=stream)
                    continue
                try:
                    await piece.finished()
                except kvrt.IntegrityError as exc:
                    # A GPU producer's layers are checked at the stream's end: what landed is
                    # not what it wrote. The load fails in this step: vLLM drops what the step
                    # made of these pages and recomputes them.
                    self._fail(read, exc)
                except kvrt.KVRTError as exc:
                    # Every layer was written (wait_layer saw each); only the end was lost.
                    log.info("request %s's stream ended with %s after its layers landed", read.load.request_id, exc)
            if not read.failed:
                self.counters["loaded_tokens"] += len(read.load.tokens) - read.load.skip

    def close(self) -> None:
        """Close the producer and the consumers, then the loop thread."""
        try:
            self._loop.call(self._close, "close", timeout_s=kvrt.blocking.CLOSE_TIMEOUT_S)
        except Exception as exc:  # shutting down goes on whatever a peer does
            log.debug("closing the worker's kvrt side: %s", exc)
        self._loop.stop()

    async def _close(self) -> None:
        for key in list(self._consumers):
            await self._drop_consumer(key)
        if self._producer is not None:
            await self._producer.aclose()
            self._producer = None


def _chunks(readings: list[_Reading], size: int) -> list[list[_Reading]]:
    return [readings[start : start + size] for start in range(0, len(readings), size)]


def _int64(values: Sequence[int]) -> torch.Tensor:
    """A request's tokens or slots (a list from the scheduler) as an int64 tensor on the host,
    through numpy: a quarter of `torch.tensor`'s time on a list of thousands (a long prompt's
    load is waited for by the model runner)."""
    return torch.from_numpy(np.fromiter(values, dtype=np.int64, count=len(values)))
