"""Prometheus metrics, opt-in: `kvrt.serve_metrics(port)` exposes every producer and consumer
of the process on an HTTP port (prometheus-client, the `metrics` extra).

Counters and gauges are read from the live producers and consumers when Prometheus
scrapes, so they cost nothing on the request path. Only the latency histograms are
observed per operation, and only once metrics are served.

    kvrt_producer_buffer_bytes{endpoint}               bytes held (buffered and in flight)
    kvrt_producer_buffer_items{endpoint}               items buffered
    kvrt_producer_in_flight_items{endpoint}            items delivered, not yet confirmed
    kvrt_producer_waiting_requests{endpoint}           drop-selects waiting for an insert
    kvrt_producer_peers{endpoint}                      connected consumers and clients
    kvrt_producer_items_total{endpoint,event}          inserted, delivered, returned, evicted, expired
    kvrt_producer_bytes_total{endpoint,event}          inserted, delivered
    kvrt_producer_refusals_total{endpoint,code}        error replies sent, by error code
    kvrt_consumer_pending_requests{endpoint}           calls waiting for an answer
    kvrt_consumer_items_total{endpoint}                items received
    kvrt_consumer_bytes_total{endpoint}                bytes received
    kvrt_consumer_errors_total{endpoint,type}          failed calls, by error class
    kvrt_operation_seconds{op}                         latency histogram: insert, drop_select
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvrt._errors import KVRTError

if TYPE_CHECKING:
    from kvrt._consumer import Consumer
    from kvrt._producer import Producer

_producers: weakref.WeakSet[Producer] = weakref.WeakSet()
_consumers: weakref.WeakSet[Consumer] = weakref.WeakSet()
_latency: Any = None
_server: Any = None


def track_producer(producer: Producer) -> None:
    _producers.add(producer)


def track_consumer(consumer: Consumer) -> None:
    _consumers.add(consumer)


class Timer:
    """Observes the latency of one operation, if metrics are served."""

    __slots__ = ("_op", "_started")

    def __init__(self, op: str) -> None:
        self._op = op
        self._started = time.perf_counter() if _latency is not None else 0.0

    def done(self) -> None:
        if _latency is not None and self._started:
            _latency.labels(self._op).observe(time.perf_counter() - self._started)


class _Collector:
    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        gauges = {
            name: GaugeMetricFamily(f"kvrt_producer_{name}", text, labels=["endpoint"])
            for name, text in (
                ("buffer_bytes", "Bytes held: buffered and in flight"),
                ("buffer_items", "Items buffered"),
                ("in_flight_items", "Items delivered and not yet confirmed"),
                ("waiting_requests", "Drop-selects waiting for an insert"),
                ("peers", "Connected consumers and clients"),
            )
        }
        items = CounterMetricFamily("kvrt_producer_items", "Items, by event", labels=["endpoint", "event"])
        moved = CounterMetricFamily("kvrt_producer_bytes", "Bytes, by event", labels=["endpoint", "event"])
        refusals = CounterMetricFamily("kvrt_producer_refusals", "Error replies sent", labels=["endpoint", "code"])
        for producer in list(_producers):
            stats = producer.stats()
            endpoint = stats.endpoint
            for name, value in (
                ("buffer_bytes", stats.buffer_bytes),
                ("buffer_items", stats.items),
                ("in_flight_items", stats.in_flight),
                ("waiting_requests", stats.waiting_requests),
                ("peers", stats.peers),
            ):
                gauges[name].add_metric([endpoint], value)
            totals = stats.totals
            for event, value in (
                ("inserted", totals.inserted_items),
                ("delivered", totals.delivered_items),
                ("returned", totals.returned_items),
                ("evicted", totals.evicted_items),
                ("expired", totals.expired_items),
            ):
                items.add_metric([endpoint, event], value)
            moved.add_metric([endpoint, "inserted"], totals.inserted_bytes)
            moved.add_metric([endpoint, "delivered"], totals.delivered_bytes)
            for code, count in producer.refusals().items():
                refusals.add_metric([endpoint, code], count)
        yield from gauges.values()
        yield from (items, moved, refusals)

        pending = GaugeMetricFamily("kvrt_consumer_pending_requests", "Calls waiting", labels=["endpoint"])
        received = CounterMetricFamily("kvrt_consumer_items", "Items received", labels=["endpoint"])
        received_bytes = CounterMetricFamily("kvrt_consumer_bytes", "Bytes received", labels=["endpoint"])
        errors = CounterMetricFamily("kvrt_consumer_errors", "Failed calls", labels=["endpoint", "type"])
        for consumer in list(_consumers):
            counters = consumer.counters
            endpoint = ",".join(consumer.endpoints)
            pending.add_metric([endpoint], consumer.pending_requests)
            received.add_metric([endpoint], counters.items)
            received_bytes.add_metric([endpoint], counters.bytes)
            for error_type, count in counters.errors.items():
                errors.add_metric([endpoint, error_type], count)
        yield from (pending, received, received_bytes, errors)


def serve_metrics(port: int = 0, addr: str = "127.0.0.1") -> int:
    """Serve Prometheus metrics over HTTP (once per process); returns the port bound."""
    global _latency, _server
    try:
        import prometheus_client
    except ImportError:
        raise KVRTError("metrics need prometheus-client: pip install 'kvrt[metrics]'") from None
    if _server is None:
        registry = prometheus_client.CollectorRegistry()
        registry.register(_Collector())
        _latency = prometheus_client.Histogram(
            "kvrt_operation_seconds",
            "Latency of kvrt operations",
            ["op"],
            registry=registry,
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0),
        )
        _server, _ = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    bound: int = _server.server_port
    return bound
