"""kvrt as a vLLM v1 KV connector: `KvrtConnector` (`pip install 'kvrt[vllm]'`).

vLLM loads it from its KV transfer config:

    KVTransferConfig(
        kv_connector="KvrtConnector",
        kv_connector_module_path="kvrt.integrations.vllm",
        kv_role="kv_producer",                 # the prefill instance; "kv_consumer": the decode
        kv_connector_extra_config={"bind": "tcp://0.0.0.0:5555"},
        kv_load_failure_policy="recompute",    # a consumer needs it: a failed load is recomputed
    )

What each instance does, and who calls what (vLLM makes one connector in its scheduler's
process, role SCHEDULER, and one in each worker, role WORKER):

Producer (the prefill instance, `kv_producer` or `kv_both`):
    The worker binds a `kvrt.blocking.Producer` at `bind` and registers vLLM's own paged KV
    cache as its pools (`register_kv_caches`, once). In the step that computes the last
    prompt token of a request (`build_connector_meta` on the scheduler says which), the worker
    opens a kvrt stream of the pools at the request's slots on the first layer's
    `save_kv_layer`, and publishes each layer from the pages as the forward pass writes it:
    kvrt reads the pages, no copy is made for it here. `wait_for_save` ends the stream; nobody
    read it by then, and it stays in the producer as an item. Once a request finished,
    `request_finished` puts the producer's endpoint in its `kv_transfer_params`
    (`{"kvrt_endpoint": ...}`) for the router to hand to the decode instance. A request that
    is aborted has its KV evicted from the producer.

Consumer (the decode instance, `kv_consumer` or `kv_both`):
    The scheduler asks the producer named by the request's `kv_transfer_params` (or
    `connect`) how much of the prompt it holds (`get_num_new_matched_tokens`: a kvrt probe by
    the prompt's tokens, prefix matching is kvrt's), and takes at most all tokens but the last
    (vLLM computes the last one itself, for its logits). After vLLM allocated the request's
    blocks (`update_state_after_alloc`) the load travels to the worker in the step's metadata.
    There `start_load_kv`, before the forward pass, takes the request's stream from the
    producer with vLLM's blocks as its destination; kvrt writes each layer into them as it
    lands, and `wait_for_layer_load` returns for layer i once layer i is written, so that
    attention of layer i starts while later layers are still on the wire. A lookup that
    misses, or fails, loads nothing: vLLM computes the prompt. A load that fails after the
    lookup (the producer gone, the item taken by another consumer, an aborted stream) reports
    the request's blocks as failed (`get_block_ids_with_load_errors`), and vLLM recomputes
    them (`kv_load_failure_policy="recompute"`): no page that kvrt did not write is read as
    loaded. A request that finishes on the decode instance without having loaded its KV (aborted
    before its lookup, or after a lookup found it) has its KV evicted from the producer.

Settings (`kv_connector_extra_config`): `bind` (producer; the address its worker binds, with
a fixed port: the scheduler advertises it), `endpoint` (producer; the address advertised, if
not `bind`), `connect` (consumer; the producer to ask when a request names none),
`buffer_bytes` (producer), `lookup_timeout_s` (consumer; how long the scheduler waits for a
producer to answer, 2 s by default). One worker per instance (tensor and pipeline parallel
size 1); the full-attention models of one KV cache group.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import torch

# vLLM's connector interface (KVConnectorBase_V1 and its role and metadata types) is its public
# surface for third-party KV transfer; the only other name of vLLM used at run time is its CPU
# backend's choice of attention kernel, which decides how the pages are laid out (`_as_pool`).
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvrt
import kvrt.blocking

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvrt.integrations.vllm")

ENDPOINT_PARAM: Final = "kvrt_endpoint"
"""The key of a request's `kv_transfer_params` that names the producer holding its KV."""

DEFAULT_LOOKUP_TIMEOUT_S: Final = 2.0
"""How long a consumer's scheduler waits for a producer to connect or answer a lookup."""

SILENT_PRODUCER_BACKOFF_S: Final = (1.0, 30.0)
"""A producer that did not answer is not asked again (its requests are computed here at once)
for the first figure, doubled at each failure up to the second: every lookup holds vLLM's
scheduler, and with it every request of the instance, for up to `lookup_timeout_s`."""

MAX_SILENT_PRODUCERS: Final = 1024
"""Silent producers remembered at most (endpoints come with the requests)."""


class ConnectorConfigError(kvrt.InvalidInputError):
    """The KV transfer config cannot be used with kvrt (the message names the setting)."""


@dataclass(frozen=True, slots=True)
class _Save:
    """A request whose prompt this step completes: publish its KV (producer worker)."""

    request_id: str
    tokens: list[int]
    slots: list[int]


@dataclass(frozen=True, slots=True)
class _Load:
    """A request whose first `len(tokens)` tokens the worker loads into `slots` (consumer)."""

    request_id: str
    endpoint: str
    tokens: list[int]
    slots: list[int]
    block_ids: list[int]


@dataclass
class KvrtConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the worker for one step: the prefills to publish, the loads."""

    saves: list[_Save] = field(default_factory=list)
    loads: list[_Load] = field(default_factory=list)


def _slots(block_ids: list[int], block_size: int, tokens: int) -> list[int]:
    """The slot of each of a request's first `tokens` tokens, from its block ids."""
    return [block_ids[token // block_size] * block_size + token % block_size for token in range(tokens)]


class KvrtConnector(KVConnectorBase_V1):
    """kvrt as vLLM's KV connector (see the module docstring for who calls what)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        extra: dict[str, Any] = dict(transfer.kv_connector_extra_config or {})
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ConnectorConfigError("KvrtConnector runs one worker per instance: tensor and pipeline parallel 1")
        self._produces = bool(transfer.is_kv_producer)
        self._consumes = bool(transfer.is_kv_consumer)
        if self._consumes and transfer.kv_load_failure_policy != "recompute":
            raise ConnectorConfigError(
                'a consuming KvrtConnector needs kv_load_failure_policy="recompute": a load that fails is recomputed'
            )
        self._block_size: int = vllm_config.cache_config.block_size
        self._bind: str | None = extra.get("bind")
        if self._produces and not self._bind:
            raise ConnectorConfigError('a producing KvrtConnector needs kv_connector_extra_config["bind"]')
        self._endpoint: str | None = extra.get("endpoint", self._bind)
        self._connect: str | None = extra.get("connect")
        self._buffer_bytes = int(extra.get("buffer_bytes", 1 << 30))
        self._lookup_timeout_s = float(extra.get("lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S))
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self)
        else:
            self._worker = _WorkerSide(self)

    # -- scheduler side: vLLM's scheduler thread ------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvrt can load beyond the `num_computed_tokens` vLLM holds (0: none), loaded
        in the forward pass (never asynchronously). A lookup, at most once per request."""
        return self._scheduler.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Plan the load of the tokens counted above into the blocks vLLM allocated."""
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's saves and loads, for the worker."""
        return self._scheduler.step(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The blocks are vLLM's to free at once (kvrt copied what it sends); the producer's
        endpoint for the router; an aborted request's KV evicted from its producer."""
        return False, self._scheduler.finished(request)

    def shutdown(self) -> None:
        """Close kvrt's sides (their threads and sockets)."""
        side = getattr(self, "_scheduler", None) or getattr(self, "_worker", None)
        if side is not None:
            side.close()

    # -- worker side: vLLM's model runner thread ------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's paged KV cache, per layer: kvrt's pools from now on (once, at start)."""
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Take this step's streams from their producers, into the requests' blocks."""
        self._worker.start_loads(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this step's loads wrote layer `layer_name` (a failed load is noted)."""
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Publish layer `layer_name` of this step's finished prompts from the pages."""
        self._worker.save_layer(self._get_connector_metadata(), layer_name)

    def wait_for_save(self) -> None:
        """End this step's streams (the last layer was published)."""
        self._worker.finish_saves()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of loads that failed since the last call: vLLM recomputes them."""
        return self._worker.take_failed_blocks()


class _SchedulerSide:
    """The scheduler's half: lookups, the plan of each step, and evictions (one thread)."""

    def __init__(self, connector: KvrtConnector) -> None:
        self._c = connector
        self._clients: dict[str, kvrt.blocking.Client] = {}
        self._matched: dict[str, int] = {}
        """Per request: the tokens a lookup found loadable (one lookup per request)."""
        self._loads: list[_Load] = []
        self._loaded: set[str] = set()
        self._published: set[str] = set()
        self._prompts: dict[str, list[int]] = {}
        self._blocks: dict[str, list[int]] = {}
        """Per request in flight on a producer: its prompt and its blocks, for the step that
        computes its last prompt token (vLLM sends both only when the request is new)."""
        self._silent: dict[str, tuple[float, float]] = {}
        """Per producer that did not answer: when it is asked again (monotonic), and the backoff
        that led there (`SILENT_PRODUCER_BACKOFF_S`); oldest first."""

    def _endpoint_of(self, request: Request) -> str | None:
        params = request.kv_transfer_params or {}
        endpoint = params.get(ENDPOINT_PARAM, self._c._connect)
        return str(endpoint) if endpoint else None

    def _client(self, endpoint: str) -> kvrt.blocking.Client:
        client = self._clients.get(endpoint)
        if client is None:
            client = kvrt.blocking.Client(endpoint, connect_timeout_s=self._c._lookup_timeout_s)
            self._clients[endpoint] = client
        return client

    def _drop_client(self, endpoint: str) -> None:
        client = self._clients.pop(endpoint, None)
        if client is not None:
            client.close()

    def _asks(self, endpoint: str) -> bool:
        """Whether `endpoint` may be asked now: not while it is in its backoff after failing."""
        silent = self._silent.get(endpoint)
        return silent is None or time.monotonic() >= silent[0]

    def _failed(self, endpoint: str) -> None:
        """`endpoint` did not answer: its client goes, and it is not asked for a while."""
        self._drop_client(endpoint)
        first, longest = SILENT_PRODUCER_BACKOFF_S
        _, backoff = self._silent.pop(endpoint, (0.0, first / 2))
        backoff = min(2 * backoff, longest)
        self._silent[endpoint] = (time.monotonic() + backoff, backoff)
        while len(self._silent) > MAX_SILENT_PRODUCERS:
            del self._silent[next(iter(self._silent))]

    def matched(self, request: Request, num_computed_tokens: int) -> int:
        if not self._c._consumes:
            return 0
        if request.request_id not in self._matched:
            self._matched[request.request_id] = self._lookup(request)
        return max(0, self._matched[request.request_id] - num_computed_tokens)

    def _lookup(self, request: Request) -> int:
        endpoint = self._endpoint_of(request)
        prompt = list(request.prompt_token_ids or [])
        if endpoint is None or len(prompt) < 2 or not self._asks(endpoint):
            return 0
        try:
            found = self._client(endpoint).probe(torch.tensor(prompt, dtype=torch.int64))
        except kvrt.KVRTError as exc:
            log.warning("lookup of %s at %s failed (%s): it is computed here", request.request_id, endpoint, exc)
            self._failed(endpoint)
            return 0
        self._silent.pop(endpoint, None)
        # The last prompt token is always computed here: its logits give the first output token.
        return min(found.matched, len(prompt) - 1)

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        endpoint = self._endpoint_of(request)
        assert endpoint is not None  # only a request with an endpoint was matched
        (block_ids,) = blocks.get_block_ids()
        tokens = self._matched[request.request_id]
        prompt = list(request.prompt_token_ids or [])
        self._loads.append(
            _Load(request.request_id, endpoint, prompt[:tokens], _slots(block_ids, self._c._block_size, tokens),
                  list(block_ids[: -(-tokens // self._c._block_size)]))
        )  # fmt: skip
        self._loaded.add(request.request_id)

    def step(self, output: SchedulerOutput) -> KvrtConnectorMetadata:
        meta = KvrtConnectorMetadata(loads=self._loads)
        self._loads = []
        if self._c._produces:
            meta.saves = self._saves(output)
        return meta

    def _saves(self, output: SchedulerOutput) -> list[_Save]:
        """The requests whose last prompt token this step computes, each published once."""
        saves = []
        for new in output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            done = new.num_computed_tokens + output.num_scheduled_tokens.get(new.req_id, 0)
            if done >= len(prompt) and new.req_id not in self._published:
                saves.append(_Save(new.req_id, prompt, _slots(new.block_ids[0], self._c._block_size, len(prompt))))
                self._published.add(new.req_id)
        self._prompts.update({new.req_id: list(new.prompt_token_ids or []) for new in output.scheduled_new_reqs})
        self._blocks.update({new.req_id: list(new.block_ids[0]) for new in output.scheduled_new_reqs})
        cached = output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            known = self._prompts.get(request_id)
            if known is None or request_id in self._published:
                continue
            prompt = known
            new_blocks = cached.new_block_ids[index]
            if new_blocks is not None:
                if request_id in cached.resumed_req_ids:
                    self._blocks[request_id] = list(new_blocks[0])
                else:
                    self._blocks[request_id].extend(new_blocks[0])
            done = cached.num_computed_tokens[index] + output.num_scheduled_tokens.get(request_id, 0)
            if done >= len(prompt):
                slots = _slots(self._blocks[request_id], self._c._block_size, len(prompt))
                saves.append(_Save(request_id, prompt, slots))
                self._published.add(request_id)
        return saves

    def finished(self, request: Request) -> dict[str, Any] | None:
        request_id = request.request_id
        found = self._matched.pop(request_id, 0)
        self._prompts.pop(request_id, None)
        self._blocks.pop(request_id, None)
        loaded = request_id in self._loaded
        self._loaded.discard(request_id)
        published = request_id in self._published
        self._published.discard(request_id)
        # By name: vLLM's RequestStatus is not part of the connector interface.
        aborted = request.status.name == "FINISHED_ABORTED"
        if self._c._consumes and not loaded and (found or aborted):
            # Its KV was found and never taken, or the request was aborted before its lookup:
            # release it on the producer.
            self._evict(self._endpoint_of(request), request)
        if not self._c._produces or not published:
            return None
        if aborted:
            self._evict(self._c._endpoint, request)
            return None
        return {ENDPOINT_PARAM: self._c._endpoint}

    def _evict(self, endpoint: str | None, request: Request) -> None:
        prompt = list(request.prompt_token_ids or [])
        if endpoint is None or not prompt or not self._asks(endpoint):
            return  # a silent producer cannot be told: its item stays there until taken or evicted
        try:
            client = self._client(endpoint)
            found = client.probe(torch.tensor(prompt, dtype=torch.int64))
            if found.item_id is not None and found.matched == len(prompt):
                client.evict(found.item_id)
        except kvrt.NotFoundError:
            pass  # taken or evicted meanwhile
        except kvrt.KVRTError as exc:
            log.warning("could not release the KV of request %s at %s: %s", request.request_id, endpoint, exc)
            self._failed(endpoint)

    def close(self) -> None:
        for endpoint in list(self._clients):
            self._drop_client(endpoint)


class _WorkerSide:
    """The worker's half: kvrt's producer or consumers over vLLM's pages (the model runner's
    thread; `close` from any)."""

    def __init__(self, connector: KvrtConnector) -> None:
        self._c = connector
        self._pools: kvrt.PoolTable | None = None
        self._layers: dict[str, int] = {}
        self._producer: kvrt.blocking.Producer | None = None
        self._consumers: dict[str, kvrt.blocking.Consumer] = {}
        self._reading: dict[str, tuple[kvrt.blocking.ConsumerStream, _Load]] = {}
        self._writing: list[kvrt.blocking.ProducerStream] = []
        self._failed_blocks: set[int] = set()
        self._lock = threading.Lock()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pools = []
        for index, (name, cache) in enumerate(kv_caches.items()):
            self._layers[name] = index
            pools.append(_as_pool(cache, self._c._block_size))
        self._pools = kvrt.PoolTable([[pools]], kvrt.Layout.BLOCK_HEAD_MAJOR)
        if self._c._produces:
            assert self._c._bind is not None  # checked in the constructor
            self._producer = kvrt.blocking.Producer(bind=self._c._bind, buffer_bytes=self._c._buffer_bytes)
            self._producer.register_pools(self._pools)
            log.info("kvrt producer bound at %s", self._producer.endpoint)

    def _consumer(self, endpoint: str) -> kvrt.blocking.Consumer:
        consumer = self._consumers.get(endpoint)
        if consumer is None:
            consumer = kvrt.blocking.Consumer(connect=endpoint, connect_timeout_s=self._c._lookup_timeout_s)
            self._consumers[endpoint] = consumer
        return consumer

    def _fail(self, load: _Load, why: object) -> None:
        log.warning("loading request %s from %s failed (%s): vLLM recomputes it", load.request_id, load.endpoint, why)
        self._reading.pop(load.request_id, None)
        with self._lock:
            self._failed_blocks.update(load.block_ids)

    def start_loads(self, meta: KvrtConnectorMetadata) -> None:
        for load in meta.loads:
            assert self._pools is not None  # vLLM registers the caches first
            tokens = torch.tensor(load.tokens, dtype=torch.int64)
            try:
                stream = self._consumer(load.endpoint).open_stream(
                    tokens, into=self._pools, slots=torch.tensor(load.slots, dtype=torch.int64)
                )
            except kvrt.KVRTError as exc:
                consumer = self._consumers.pop(load.endpoint, None)
                if consumer is not None and isinstance(exc, kvrt.PeerLostError):
                    consumer.close()
                self._fail(load, exc)
                continue
            if stream is None:
                self._fail(load, "nothing matched: the KV was taken or evicted since the lookup")
            elif stream.matched < len(load.tokens):
                self._fail(load, f"only {stream.matched} of {len(load.tokens)} tokens matched")
            else:
                self._reading[load.request_id] = (stream, load)

    def wait_layer(self, layer_name: str) -> None:
        layer = self._layers.get(layer_name)
        if layer is None:
            return
        for stream, load in list(self._reading.values()):
            try:
                stream.layer(layer)
            except kvrt.KVRTError as exc:
                self._fail(load, exc)

    def save_layer(self, meta: KvrtConnectorMetadata, layer_name: str) -> None:
        layer = self._layers.get(layer_name)
        if self._producer is None or layer is None:
            return
        if layer == 0:
            self._open_saves(meta)
        for stream in list(self._writing):
            try:
                stream.put_layer()
            except kvrt.KVRTError as exc:
                log.warning("publishing layer %d failed: %s", layer, exc)
                self._writing.remove(stream)

    def _open_saves(self, meta: KvrtConnectorMetadata) -> None:
        assert self._producer is not None
        for save in meta.saves:
            try:
                self._writing.append(
                    self._producer.open_stream(
                        torch.tensor(save.tokens, dtype=torch.int64), slots=torch.tensor(save.slots, dtype=torch.int64)
                    )
                )
            except kvrt.KVRTError as exc:
                log.warning("request %s is not published: %s", save.request_id, exc)

    def finish_saves(self) -> None:
        writing, self._writing = self._writing, []
        for stream in writing:
            try:
                if stream.published == stream.layers:
                    stream.finish()
                else:
                    stream.abort("the forward pass did not publish every layer")
            except kvrt.KVRTError as exc:
                log.warning("a stream did not end: %s", exc)
        reading, self._reading = self._reading, {}
        for reader, load in reading.values():
            try:
                reader.finished()
            except kvrt.KVRTError as exc:
                # Every layer was written (wait_layer saw each); only the end was lost.
                log.info("the stream of request %s ended with %s after its layers landed", load.request_id, exc)

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def close(self) -> None:
        for consumer in self._consumers.values():
            consumer.close()
        self._consumers.clear()
        if self._producer is not None:
            self._producer.close()
            self._producer = None


READABLE_CPU_KERNELS: Final = ("vec", "vec16")
"""vLLM's CPU attention kernels whose pages kvrt reads and writes (`Layout.BLOCK_HEAD_MAJOR`);
its AMX kernel (bfloat16 on an AMX host) packs keys otherwise."""


def _as_pool(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """One layer of vLLM's CPU KV cache as kvrt's head-major block pool. vLLM's CPU backend
    (`vllm/v1/attention/backends/cpu_attn.py`) allocates [blocks, heads, block_size,
    2 * head_dim] and cuts each block and head in two halves: the keys, which its vec and
    vec16 kernels keep transposed ([head_dim, block_size]), then the values ([block_size,
    head_dim]). kvrt's view is [blocks, heads, 2, block_size, head_dim], the same memory."""
    if cache.device.type != "cpu" or cache.dim() != 4 or cache.shape[2] != block_size or cache.shape[3] % 2:
        raise ConnectorConfigError(
            f"KvrtConnector reads vLLM's CPU KV cache [blocks, heads, block_size, 2*head_dim]; got "
            f"{tuple(cache.shape)} on {cache.device}"
        )
    blocks, heads, _, two_dims = cache.shape
    kernel = _cpu_kernel(cache.dtype, block_size, two_dims // 2)
    if kernel not in READABLE_CPU_KERNELS:
        raise ConnectorConfigError(
            f"vLLM's {kernel!r} CPU attention kernel lays out {cache.dtype} pages in a way kvrt does not read: "
            f"KvrtConnector reads those of its {' and '.join(READABLE_CPU_KERNELS)} kernels (dtype float32 or float16)"
        )
    return cache.view(blocks, heads, 2, block_size, two_dims // 2)


def _cpu_kernel(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The attention kernel vLLM's CPU backend picks for these pages (its own choice, asked of it)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:
        raise ConnectorConfigError(
            f"this vLLM does not say which CPU attention kernel it uses ({exc}): KvrtConnector is tested with vLLM 0.32"
        ) from exc
    return str(_get_attn_isa(dtype, block_size, head_dim))


__all__ = ["ENDPOINT_PARAM", "ConnectorConfigError", "KvrtConnector", "KvrtConnectorMetadata"]
