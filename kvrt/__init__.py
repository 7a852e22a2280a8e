"""kvrt: move the KV cache of LLM requests from prefill (producer) to decode (consumer).

    async with kvrt.Producer(bind="tcp://127.0.0.1:0") as producer:
        await producer.insert(input_tokens, roi, key, value, hidden)

    async with kvrt.Consumer(connect=producer.endpoint) as consumer:
        item = await consumer.drop_select(input_tokens, roi, timeout=0.0)

Everything public is re-exported here; modules with a leading underscore are internal.
"""

from kvrt import blocking
from kvrt._auth import CurveKeys, make_keys
from kvrt._client import Client
from kvrt._consumer import Consumer, Fetch
from kvrt._errors import (
    AuthError,
    CapacityError,
    ClosedError,
    ErrorCode,
    IntegrityError,
    InvalidInputError,
    KVRTError,
    KVRTTimeoutError,
    LeaseExpiredError,
    LocalProtocolError,
    NotFoundError,
    PeerLostError,
    ProtocolError,
    RemoteProtocolError,
    StreamAbortedError,
    TransportUnavailableError,
    VersionMismatchError,
)
from kvrt._item import KVBuffers, KVItem
from kvrt._logs import JsonFormatter, log_json
from kvrt._messages import PROTOCOL_VERSION
from kvrt._metrics import register_metrics, serve_metrics
from kvrt._pools import Layout, PoolGeometry, PoolTable
from kvrt._producer import Producer, ProducerStats
from kvrt._settings import consumer_settings, producer_settings
from kvrt._streams import ConsumerStream, ProducerStream
from kvrt._trace import TraceEvent, add_trace_callback, tracing
from kvrt._version import __version__

__all__ = [
    "PROTOCOL_VERSION",
    "AuthError",
    "CapacityError",
    "Client",
    "ClosedError",
    "Consumer",
    "ConsumerStream",
    "CurveKeys",
    "ErrorCode",
    "Fetch",
    "InvalidInputError",
    "JsonFormatter",
    "KVBuffers",
    "KVItem",
    "KVRTError",
    "KVRTTimeoutError",
    "Layout",
    "IntegrityError",
    "LeaseExpiredError",
    "LocalProtocolError",
    "NotFoundError",
    "PeerLostError",
    "PoolGeometry",
    "PoolTable",
    "Producer",
    "ProducerStats",
    "ProducerStream",
    "ProtocolError",
    "RemoteProtocolError",
    "StreamAbortedError",
    "TraceEvent",
    "TransportUnavailableError",
    "VersionMismatchError",
    "__version__",
    "add_trace_callback",
    "blocking",
    "consumer_settings",
    "log_json",
    "make_keys",
    "producer_settings",
    "register_metrics",
    "serve_metrics",
    "tracing",
]
