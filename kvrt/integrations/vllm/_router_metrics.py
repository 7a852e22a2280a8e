"""The router's Prometheus metrics (prometheus-client, which comes with vLLM), served on the
router's port at `GET /metrics`. A registry each router: several in one process (tests) keep theirs apart.

    kvrt_router_requests_total{route}          requests by the way they went: first_token (the
                                               prefill's first token at once, then a decode),
                                               first_token_only (the first token ended it),
                                               decode (the plain path)
    kvrt_router_time_to_first_token_seconds{route}  a streamed request's arrival to its first
                                               token written to the client
    kvrt_router_prefill_seconds                a prefill's request to its answer
    kvrt_router_handoff_seconds                the prefill's answer to the decode's first answer
                                               (what the client no longer waits for)
    kvrt_router_in_flight{kind,instance}       requests on their way to each instance
    kvrt_router_instance_up{kind,instance}     1 while an instance is up, 0 while it is out
    kvrt_router_failures_total{kind,instance,error}  requests an instance failed (connect,
                                               disconnected, timeout, status_5xx)
    kvrt_router_retries_total{kind}            requests sent to another instance of that kind
                                               after one failed
    kvrt_router_fallbacks_total{reason}        requests on the plain path, and why
                                               (`_first_token.Fallback`)
    kvrt_router_releases_total                 prompts whose KV the router released on their
                                               producers (no decode would take it)
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvrt.integrations.vllm._instances import Instance

SECONDS_BUCKETS: Final = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


class RouterMetrics:
    """The router's metrics (see the module docstring), in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter("kvrt_router_requests", "Requests, by route", ["route"], registry=registry)
        self.time_to_first_token = Histogram(
            "kvrt_router_time_to_first_token_seconds", "A streamed request's arrival to its first token written",
            ["route"], buckets=SECONDS_BUCKETS, registry=registry,
        )  # fmt: skip
        self.prefill = Histogram(
            "kvrt_router_prefill_seconds", "A prefill's request to its answer", buckets=SECONDS_BUCKETS,
            registry=registry,
        )  # fmt: skip
        self.handoff = Histogram(
            "kvrt_router_handoff_seconds", "The prefill's answer to the decode's first answer",
            buckets=SECONDS_BUCKETS, registry=registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "kvrt_router_in_flight", "Requests on their way", ["kind", "instance"], registry=registry
        )
        self.up = Gauge("kvrt_router_instance_up", "1: up, 0: out", ["kind", "instance"], registry=registry)
        self.failures = Counter(
            "kvrt_router_failures", "Requests an instance failed", ["kind", "instance", "error"], registry=registry
        )
        self.retries = Counter(
            "kvrt_router_retries", "Requests sent to another instance after one failed", ["kind"], registry=registry
        )
        self.fallbacks = Counter(
            "kvrt_router_fallbacks", "Requests on the plain path, and why", ["reason"], registry=registry
        )
        self.releases = Counter("kvrt_router_releases", "Prompts whose KV the router released", registry=registry)

    def instance_changed(self, instance: Instance) -> None:
        self.in_flight.labels(instance.kind, instance.url).set(instance.in_flight)
        self.up.labels(instance.kind, instance.url).set(1 if instance.up else 0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
