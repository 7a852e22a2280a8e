"""Prometheus metrics of every producer and consumer in the process (prometheus-client, the
`metrics` extra), in a registry the engine already serves or on a port of their own:

    kvrt.register_metrics(registry)   # into the engine's registry (default: the global REGISTRY)
    kvrt.serve_metrics(port)          # or an HTTP endpoint of kvrt's own

Counters, gauges and histograms are kept by the producers and consumers themselves, as
plain numbers updated on kvrt's loop (no lock, no prometheus-client call on the request
path), and read when Prometheus scrapes. Every producer carries `producer` (its name) and
`endpoint` labels, every consumer `consumer` (its name: set `name=` to tell them apart on a
dashboard; the default is host-pid-random) and `endpoint` (the producers it connects to).

The table of every metric, its type and its labels is in docs/guide.md ("Metrics").

A lookup's outcome: `hit` (an item), `miss` (none, answered at once), `timeout` (none within
the call's `timeout`, or a `KVRTTimeoutError`), `error` (any other error). The wait for a
prefill (a lookup waiting for its match to be inserted) is in `lookup_wait_seconds`; the
transfer histograms start once the item was found, so they hold the data plane alone
(single-item lookups and pulls; a batch's or a stream's transfer is not in them).
"""

from __future__ import annotations

import bisect
import enum
import errno
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from kvrt._errors import InvalidInputError, KVRTError, KVRTTimeoutError
from kvrt._loop_watch import LAG_BUCKETS_S, watches
from kvrt._protocol import ProducerCore, ProducerCounters

LATENCY_BUCKETS_S: Final = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
WAIT_BUCKETS_S: Final = (*LATENCY_BUCKETS_S, 30.0, 100.0, 300.0)
"""A lookup may wait for a whole prefill: minutes, for a long prompt on a busy instance."""
SIZE_BUCKETS_BYTES: Final = tuple(float(1 << shift) for shift in range(12, 37, 2))
"""4 KiB to 64 GiB, by factors of 4."""


class LookupOutcome(enum.StrEnum):
    HIT = "hit"
    MISS = "miss"
    TIMEOUT = "timeout"
    ERROR = "error"


def outcome_of_error(error: KVRTError) -> LookupOutcome:
    return LookupOutcome.TIMEOUT if isinstance(error, KVRTTimeoutError) else LookupOutcome.ERROR


class Histogram:
    """Cumulative buckets, their count and sum: observed on kvrt's loop (one writer), read by
    a scrape on another thread (a snapshot, consistent to within the observation under way)."""

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = tuple(bounds)
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs as prometheus-client's HistogramMetricFamily takes them."""
        counts, running, pairs = list(self._counts), 0, []
        for bound, count in zip((*self._bounds, float("inf")), counts, strict=True):
            running += count
            pairs.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return pairs

    @property
    def sum(self) -> float:
        return self._sum


@dataclass(slots=True)
class ConsumerMetrics:
    """What one consumer's lookups and transfers did, for its metrics."""

    lookups: dict[LookupOutcome, int] = field(default_factory=lambda: dict.fromkeys(LookupOutcome, 0))
    lookup_wait: Histogram = field(default_factory=lambda: Histogram(WAIT_BUCKETS_S))
    transfer_seconds: dict[str, Histogram] = field(default_factory=dict)
    transfer_bytes: dict[str, Histogram] = field(default_factory=dict)
    integrity_failures: int = 0
    """Deliveries whose bytes did not match their checksum (each went back, its call failed)."""

    def looked_up(self, outcome: LookupOutcome, count: int = 1) -> None:
        self.lookups[outcome] += count

    def transferred(self, transport: str, seconds: float, nbytes: int) -> None:
        if transport not in self.transfer_seconds:
            # Sizes first: a scrape on another thread finds them for every transport it sees.
            self.transfer_bytes[transport] = Histogram(SIZE_BUCKETS_BYTES)
            self.transfer_seconds[transport] = Histogram(LATENCY_BUCKETS_S)
        self.transfer_seconds[transport].observe(seconds)
        self.transfer_bytes[transport].observe(float(nbytes))


@dataclass(frozen=True, slots=True)
class ProducerStats:
    """A snapshot of what the producer holds and has done."""

    endpoint: str
    items: int
    buffer_bytes: int
    in_flight: int
    waiting_requests: int
    peers: int
    totals: ProducerCounters
    transports: dict[str, int]
    """Connected consumers by the transport their items travel over ("nccl", "gloo", "tcp")."""


@dataclass(slots=True)
class ConsumerCounters:
    """What a consumer received and what failed, since start (for stats and metrics)."""

    items: int = 0
    bytes: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class TrackedProducer(Protocol):
    """What a scrape reads of a producer (`kvrt.Producer`). The drivers import this module, so
    it names none of them: they register themselves (`track_producer`)."""

    @property
    def buffer_bytes(self) -> int: ...

    @property
    def _core(self) -> ProducerCore: ...

    def stats(self) -> ProducerStats: ...

    def refusals(self) -> dict[str, int]: ...


class TrackedConsumer(Protocol):
    """What a scrape reads of a consumer (`kvrt.Consumer`), which registers itself (`track_consumer`)."""

    @property
    def name(self) -> str: ...

    @property
    def endpoints(self) -> list[str]: ...

    @property
    def metrics(self) -> ConsumerMetrics: ...

    @property
    def counters(self) -> ConsumerCounters: ...

    @property
    def pending_requests(self) -> int: ...


_producers: weakref.WeakSet[TrackedProducer] = weakref.WeakSet()
_consumers: weakref.WeakSet[TrackedConsumer] = weakref.WeakSet()
_operations: dict[str, Histogram] = {}
_registries: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_registering = threading.Lock()
_server: Any = None


def track_producer(producer: TrackedProducer) -> None:
    _producers.add(producer)


def track_consumer(consumer: TrackedConsumer) -> None:
    _consumers.add(consumer)


class Timer:
    """Observes the latency of one whole call (`kvrt_operation_seconds{op}`)."""

    __slots__ = ("_op", "_started")

    def __init__(self, op: str) -> None:
        self._op = op
        self._started = time.perf_counter()

    def done(self) -> None:
        histogram = _operations.get(self._op)
        if histogram is None:
            histogram = _operations.setdefault(self._op, Histogram(LATENCY_BUCKETS_S))
        histogram.observe(time.perf_counter() - self._started)


class _Collector:
    """Reads the live producers and consumers at each scrape."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        producer_labels = ["producer", "endpoint"]
        gauges = {
            name: GaugeMetricFamily(f"kvrt_producer_{name}", text, labels=producer_labels)
            for name, text in (
                ("buffer_bytes", "Bytes held: buffered and in flight"),
                ("buffer_limit_bytes", "The buffer's limit (buffer_bytes): insert waits while it holds more"),
                ("buffer_items", "Items buffered"),
                ("in_flight_items", "Items delivered and not yet confirmed"),
                ("waiting_requests", "Drop-selects waiting for an insert"),
                ("peers", "Connected consumers and clients"),
            )
        }
        items = CounterMetricFamily("kvrt_producer_items", "Items, by event", labels=[*producer_labels, "event"])
        moved = CounterMetricFamily("kvrt_producer_bytes", "Bytes, by event", labels=[*producer_labels, "event"])
        refusals = CounterMetricFamily(
            "kvrt_producer_refusals", "Error replies sent", labels=[*producer_labels, "code"]
        )
        for producer in list(_producers):
            stats = producer.stats()
            labels = [producer._core.producer_id, stats.endpoint]
            for name, value in (
                ("buffer_bytes", stats.buffer_bytes),
                ("buffer_limit_bytes", producer.buffer_bytes),
                ("buffer_items", stats.items),
                ("in_flight_items", stats.in_flight),
                ("waiting_requests", stats.waiting_requests),
                ("peers", stats.peers),
            ):
                gauges[name].add_metric(labels, value)
            totals = stats.totals
            for event, value in (
                ("inserted", totals.inserted_items),
                ("delivered", totals.delivered_items),
                ("returned", totals.returned_items),
                ("evicted", totals.evicted_items),
                ("expired", totals.expired_items),
            ):
                items.add_metric([*labels, event], value)
            moved.add_metric([*labels, "inserted"], totals.inserted_bytes)
            moved.add_metric([*labels, "delivered"], totals.delivered_bytes)
            for code, count in producer.refusals().items():
                refusals.add_metric([*labels, code], count)
        yield from gauges.values()
        yield from (items, moved, refusals)

        consumer_labels = ["consumer", "endpoint"]
        lookups = CounterMetricFamily(
            "kvrt_consumer_lookups", "Lookups, by outcome", labels=[*consumer_labels, "outcome"]
        )
        waits = HistogramMetricFamily(
            "kvrt_consumer_lookup_wait_seconds",
            "From a lookup's request to the producer's answer (a wait for a prefill included)",
            labels=consumer_labels,
        )
        transfer_seconds = HistogramMetricFamily(
            "kvrt_consumer_transfer_seconds", "From an item's header to its bytes landed",
            labels=[*consumer_labels, "transport"],
        )  # fmt: skip
        transfer_bytes = HistogramMetricFamily(
            "kvrt_consumer_transfer_bytes", "An item's payload bytes", labels=[*consumer_labels, "transport"]
        )
        pending = GaugeMetricFamily("kvrt_consumer_pending_requests", "Calls waiting", labels=consumer_labels)
        received = CounterMetricFamily("kvrt_consumer_items", "Items received", labels=consumer_labels)
        received_bytes = CounterMetricFamily("kvrt_consumer_bytes", "Bytes received", labels=consumer_labels)
        errors = CounterMetricFamily("kvrt_consumer_errors", "Failed calls", labels=[*consumer_labels, "type"])
        integrity = CounterMetricFamily(
            "kvrt_integrity_failures", "Deliveries whose bytes did not match their checksum", labels=consumer_labels
        )
        for consumer in list(_consumers):
            labels = [consumer.name, ",".join(consumer.endpoints)]
            metrics = consumer.metrics
            for outcome, count in list(metrics.lookups.items()):
                lookups.add_metric([*labels, outcome.value], count)
            waits.add_metric(labels, metrics.lookup_wait.buckets(), metrics.lookup_wait.sum)
            for transport, histogram in list(metrics.transfer_seconds.items()):
                transfer_seconds.add_metric([*labels, transport], histogram.buckets(), histogram.sum)
                sizes = metrics.transfer_bytes[transport]
                transfer_bytes.add_metric([*labels, transport], sizes.buckets(), sizes.sum)
            counters = consumer.counters
            pending.add_metric(labels, consumer.pending_requests)
            received.add_metric(labels, counters.items)
            received_bytes.add_metric(labels, counters.bytes)
            for error_type, count in list(counters.errors.items()):
                errors.add_metric([*labels, error_type], count)
            integrity.add_metric(labels, metrics.integrity_failures)
        yield from (
            lookups, waits, transfer_seconds, transfer_bytes, pending, received, received_bytes, errors, integrity
        )  # fmt: skip

        operations = HistogramMetricFamily("kvrt_operation_seconds", "Latency of kvrt operations", labels=["op"])
        for op, histogram in list(_operations.items()):
            operations.add_metric([op], histogram.buckets(), histogram.sum)
        yield operations
        yield from _loop_families()


def _loop_families() -> Iterator[Any]:
    """Each watched loop's lag and its thread's time (`kvrt._loop_watch`), labelled by the
    loop's name and its thread's native id."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    labels = ["loop", "thread"]
    lag = HistogramMetricFamily(
        "kvrt_loop_lag_seconds", "How late each turn of the loop's watch timer ran (the loop was busy, or its "
        "thread was not running)", labels=labels,
    )  # fmt: skip
    late = CounterMetricFamily(
        "kvrt_loop_late_turns", "Turns later than the logged bound (LOOP_LAG_LOG_S)", labels=labels
    )
    cpu = CounterMetricFamily("kvrt_loop_cpu_seconds", "CPU time of the loop's thread", labels=labels)
    runqueue = CounterMetricFamily(
        "kvrt_loop_runqueue_seconds", "Time the loop's thread was ready to run and waited for a core (Linux)",
        labels=labels,
    )  # fmt: skip
    for watch in watches():
        names = [watch.name, str(watch.thread_id)]
        counts, running, pairs = list(watch.lag_counts), 0, []
        for bound, count in zip((*LAG_BUCKETS_S, float("inf")), counts, strict=True):
            running += count
            pairs.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        lag.add_metric(names, pairs, watch.lag_s)
        late.add_metric(names, watch.late_turns)
        cpu.add_metric(names, watch.cpu_s)
        if watch.runqueue_s is not None:
            runqueue.add_metric(names, watch.runqueue_s)
    yield from (lag, late, cpu, runqueue)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise KVRTError("metrics need prometheus-client: pip install 'kvrt[metrics]'") from None
    return prometheus_client


def register_metrics(registry: Any = None) -> None:
    """Add kvrt's metrics (every producer and consumer of this process, those made later
    too) to `registry`, a `prometheus_client.CollectorRegistry`; None means prometheus-client's
    global `REGISTRY`, the one an engine's `/metrics` serves as a rule. Once per registry:
    a second call changes nothing."""
    prometheus_client = _prometheus()
    target = prometheus_client.REGISTRY if registry is None else registry
    with _registering:
        if target in _registries:
            return
        collector = _Collector()
        target.register(collector)
        _registries[target] = collector


def serve_metrics(port: int = 0, addr: str = "127.0.0.1") -> int:
    """Serve kvrt's metrics over HTTP on a registry of their own (once per process; a later
    call returns the port bound first); returns the port bound. A port in use is refused
    with `InvalidInputError`. An engine that serves metrics already needs no second port:
    `register_metrics(its_registry)`."""
    global _server
    prometheus_client = _prometheus()
    with _registering:
        if _server is None:
            registry = prometheus_client.CollectorRegistry()
            collector = _Collector()
            registry.register(collector)
            _registries[registry] = collector
            try:
                _server, _ = prometheus_client.start_http_server(port, addr=addr, registry=registry)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise InvalidInputError(
                        f"metrics port {addr}:{port} is already in use: pick another port or 0, or add kvrt's "
                        "metrics to the registry your engine serves (kvrt.register_metrics)"
                    ) from None
                raise InvalidInputError(f"cannot serve metrics on {addr}:{port}: {exc.strerror}") from None
    bound: int = _server.server_port
    return bound
