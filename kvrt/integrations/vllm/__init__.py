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
    Each worker binds a kvrt producer (`bind`) and registers vLLM's own paged KV cache as its
    pools (`register_kv_caches`, once). In the step that computes the last prompt token of a
    request that asks for a remote decode (`do_remote_decode` in its `kv_transfer_params`, as
    routers send it; `build_connector_meta` on the scheduler says which), the worker opens a kvrt
    stream of the pools at the request's slots on the first layer's `save_kv_layer` and
    publishes each layer from the pages as the forward pass writes it. `wait_for_save` ends
    the stream; nobody read it by then, and it stays in the producer as an item (a producer
    over its `buffer_bytes` publishes nothing: the decode then computes the prompt). Once a
    request finished, `request_finished` gives its word in its `kv_transfer_params` for the
    router to hand to the decode instance: what it published, on which producers, until when
    (`{"kvrt_published": {...}, "kvrt_endpoints": [...], "kvrt_endpoint": ...}`, see `_word`).
    An aborted request's KV is released from the producers.

Consumer (the decode instance, `kv_consumer` or `kv_both`):
    The scheduler reads what the prefill's word in the request's `kv_transfer_params` says its
    producers hold, and `get_num_new_matched_tokens` answers from it in the step that first
    sees the request; a word that cannot be read (forged, damaged, for another prompt) is
    refused and the prompt computed here. Without a word (no router, a prefill of the previous
    release), it asks the producer the params name (or `connect`) without waiting:
    `get_num_new_matched_tokens` answers None ("ask again next step") until the answer came;
    a step's lookups travel to each producer as one message. It takes at most all tokens but
    the last (vLLM computes the last one itself, for its logits), and none of those vLLM holds
    in its own prefix cache. After
    vLLM allocated the request's blocks (`update_state_after_alloc`) the load travels to the
    workers in the step's metadata. There `start_load_kv`, before the forward pass, takes the
    request's stream from the producer with vLLM's blocks as its destination; kvrt writes each
    layer into them as it lands, and `wait_for_layer_load` returns for layer i once layer i is
    written. A lookup that misses, or fails, loads nothing: vLLM computes the prompt. A load
    that fails after the lookup reports its blocks as failed (`get_block_ids_with_load_errors`)
    and vLLM recomputes them (`kv_load_failure_policy="recompute"`): no page that kvrt did not
    write is read as loaded. A request is loaded at most once (preempted and resumed, it
    computes its prompt). KV that was found and never loaded is released from its producer: at
    once when a lookup or a load fails (whatever the failure), when the request ends if it
    never loaded (an abort); what nobody takes leaves with the producer's `item_ttl_s`.

The parts: `connector` (the only module that imports vLLM), `layouts` (vLLM's pages as kvrt
pools), `_config` (settings), `_scheduler`, `_word` and `_lookups` (the scheduler side), `_worker` (the
worker side). `_config`'s docstring lists the settings of `kv_connector_extra_config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvrt.integrations.vllm._config import ConnectorConfigError
from kvrt.integrations.vllm._scheduler import ENDPOINT_PARAM, ENDPOINTS_PARAM

if TYPE_CHECKING:
    from kvrt.integrations.vllm.connector import KvrtConnector, KvrtConnectorMetadata

_CONNECTOR_NAMES = ("KvrtConnector", "KvrtConnectorMetadata")


def __getattr__(name: str) -> Any:
    # The connector imports vLLM; the rest of the package (layouts, the router) does not, and
    # is imported on hosts without it: vLLM's loader asks for the class by name, here.
    if name in _CONNECTOR_NAMES:
        from kvrt.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ENDPOINTS_PARAM", "ENDPOINT_PARAM", "ConnectorConfigError", "KvrtConnector", "KvrtConnectorMetadata"]
