"""The connector's scheduler side, in vLLM's scheduler process: what each request finds on its
producer, the plan of each step, and the KV no load will take, released. Plain values in and
out (request ids, token lists, block ids): `connector.py` maps vLLM's objects onto them.

A decode request's life here, one record (`_Wanted`) from the first lookup to its end:

    event (who calls)                          what happens
    matched (get_num_new_matched_tokens)       first call: the prefill's word in its params
                                               (`_word`) says what its producers hold: the
                                               tokens to load, in this very step; a word that
                                               cannot be read is refused and the prompt
                                               computed here; params without a word (no
                                               router, a prefill of the previous release):
                                               its probe is queued and, until the answer
                                               came, None ("ask again next step")
    step end (build_connector_meta)            the step's probes leave, one message a producer;
                                               a step that scheduled nothing, every request
                                               waiting for a lookup, waits for the first
                                               answer (bounded), not spinning the engine
    matched, answered                          the tokens to load past what vLLM holds itself;
                                               a lookup that failed, or a producer backed off
                                               (a load from it failed): 0, and the KV it may
                                               hold released at once
    allocated (update_state_after_alloc)       a `Load` of those tokens into its new blocks;
                                               never asked again: its item is taken (preempted
                                               and resumed, the request computes its prompt)
    outcome (update_connector_output)          the workers say the load failed: its KV is
                                               released at once, whatever the failure (what
                                               one rank took of it included)
    finished (request_finished)                KV found (or maybe there: an abort before any
                                               lookup, a lookup that failed: again) and never
                                               planned: released

A prefill request whose `kv_transfer_params` ask for a remote decode (`do_remote_decode`, as
routers send it): the step that computes its last prompt token publishes it (`Save`), once;
when it finishes, its `kv_transfer_params` carry its word (what it published, on which
producers, until when: `_word`) and name its producers, or, aborted, its KV is released
there. A request that asks for nothing is served as by an instance without a connector: none
of the producer's buffer goes to KV nobody will take.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvrt.integrations.vllm._lookups import CONTINUED_TOKENS, Lookups
from kvrt.integrations.vllm._tp import publishes
from kvrt.integrations.vllm._word import WORD_PARAM, TransferParamsError, Word, read_word

log = logging.getLogger("kvrt.integrations.vllm")

ENDPOINT_PARAM: Final = "kvrt_endpoint"
"""The key of a request's `kv_transfer_params` that names the producer holding its KV (the
first of several)."""

REMOTE_DECODE_PARAM: Final = "do_remote_decode"
"""The key of a prefill request's `kv_transfer_params` that asks for its KV to be kept for a
decode instance (vLLM's name, which every router of vLLM's connectors sends)."""

ENDPOINTS_PARAM: Final = "kvrt_endpoints"
"""The key that names every prefill rank's producer, in rank order (tensor parallel prefill)."""

IDLE_WAIT_S: Final = 0.02
"""How long a step that scheduled nothing waits for a lookup's answer at most. vLLM's engine
steps without a pause while it has requests, even empty steps, and each wakes every worker:
with only lookups on their way that spin takes the host's cores from the producers that must
answer them (on a small host, for tens of seconds). The wait ends at the first answer; a
request that arrives meanwhile starts this much later at most."""

MAX_AWAITING: Final = 4096
"""Finished requests whose load outcome is awaited, at most (the oldest are dropped)."""

REFUSAL_LOG_EVERY_S: Final = 1.0
"""At most one log line this often for words refused (a client decides what they say)."""


@dataclass(frozen=True, slots=True)
class Save:
    """A request whose prompt this step completes: its worker publishes its KV."""

    request_id: str
    tokens: list[int]
    slots: list[int]


@dataclass(frozen=True, slots=True)
class Load:
    """A request's load: the first `len(tokens)` tokens of its prompt are on `endpoints`; the
    worker writes tokens [skip, len(tokens)) into `slots` (vLLM holds the first `skip` in its
    own prefix cache). `block_ids` are the blocks those slots lie in: what vLLM recomputes if
    the load fails."""

    request_id: str
    endpoints: tuple[str, ...]
    tokens: list[int]
    skip: int
    slots: list[int]
    block_ids: list[int]
    published: bool = False
    """Planned from the prefill's word, which says its KV is whole on its producers: the
    worker fetches it with the step's other such loads from that producer, in one message.
    Else (a probe found it: a prefill may still be publishing it) it is read as a stream."""


def slots_of(block_ids: Sequence[int], block_size: int, first: int, end: int) -> list[int]:
    """The slot of each token in [first, end) of a request, from its block ids."""
    return [block_ids[token // block_size] * block_size + token % block_size for token in range(first, end)]


def endpoints_of(params: dict[str, Any] | None, default: str | None) -> tuple[str, ...]:
    """The producers a request's `kv_transfer_params` name (or `default`), in rank order."""
    params = params or {}
    many = params.get(ENDPOINTS_PARAM)
    if isinstance(many, list) and many and all(isinstance(endpoint, str) for endpoint in many):
        return tuple(many)
    one = params.get(ENDPOINT_PARAM, default)
    return (str(one),) if one else ()


@dataclass(slots=True)
class _Wanted:
    """A decode request's record (see the module docstring)."""

    endpoints: tuple[str, ...]
    prompt: list[int]
    asked: bool = False
    found: int | None = None
    """Tokens its producer holds (0: none), once the lookup answered."""
    local: int = 0
    """Tokens vLLM held itself (block-aligned) when it last asked."""
    unanswered: bool = False
    """The lookup failed (0 tokens taken): the producer may hold the KV all the same, and
    may not have heard its release either: released again when the request ends."""
    planned: bool = False
    settled: bool = False
    """The workers reported its load's outcome."""
    failed: bool = False
    published: bool = False
    """Found by the prefill's word: its KV is whole on its producers (fetched, not streamed)."""
    released: bool = False
    """Its KV was released on its producers (a failed lookup or load, a load never planned)."""


class DecodeScheduler:
    """The decode instance's half of the scheduler side (one thread: vLLM's scheduler)."""

    def __init__(
        self, lookups: Lookups, *, block_size: int, default_endpoint: str | None, total_heads: int = 1,
        mla: bool = False,
    ) -> None:  # fmt: skip
        self._lookups = lookups
        self._block_size = block_size
        self._default = default_endpoint
        self._total_heads = total_heads
        self._mla = mla
        self._wanted: dict[str, _Wanted] = {}
        self._loads: list[Load] = []
        self._awaiting: collections.OrderedDict[str, _Wanted] = collections.OrderedDict()
        """Finished requests with a load whose outcome the workers have not reported yet."""
        self.counters: collections.Counter[str] = collections.Counter()
        """lookups, words (prefills' words read), refused_words, expired_words, hits, loads,
        loaded_tokens, failed_loads, releases."""
        self._next_refusal_log = 0.0

    def matched(self, request_id: str, prompt: list[int], params: dict[str, Any] | None, local: int) -> int | None:
        """Tokens to load past the `local` ones vLLM holds; None while the lookup is out."""
        wanted = self._wanted.get(request_id)
        if wanted is None:
            wanted = self._wanted[request_id] = self._first_sight(request_id, prompt, params)
        if wanted.planned or not wanted.endpoints or len(prompt) < 2:
            return 0
        if wanted.found is None:
            if not wanted.asked:
                wanted.asked = True
                if not self._lookups.asks(wanted.endpoints[0]):
                    # Its producer failed a load moments ago: computed here, and the KV it
                    # may hold all the same is released now (nobody else will take it).
                    wanted.found = 0
                    self._release(wanted)
                    return 0
                self._lookups.ask(request_id, wanted.endpoints[0], prompt)
                self.counters["lookups"] += 1
                return None
            found = self._lookups.answer(request_id)
            if found is None:
                return None
            wanted.found = found
            self.counters["hits"] += found > 0
            if self._lookups.unanswered(request_id):
                wanted.unanswered = True
                self._release(wanted)  # the lookup failed: the KV may be there all the same
        if wanted.found and not self._lookups.asks(wanted.endpoints[0]):
            # Answered, but a load from that producer failed since: computed here, and its KV
            # released now.
            self._release(wanted)
            wanted.found = 0
            return 0
        wanted.local = local
        # The last prompt token is always computed here: its logits give the first output token.
        return max(0, min(wanted.found, len(prompt) - 1) - local)

    def _first_sight(self, request_id: str, prompt: list[int], params: dict[str, Any] | None) -> _Wanted:
        """A request's record when the scheduler first shows it: found at once where the
        prefill's word says what its producers hold."""
        try:
            word = read_word(params, prompt)
        except TransferParamsError as exc:
            self.counters["refused_words"] += 1
            self._log_refusal(request_id, exc)
            return _Wanted((), prompt, found=0)
        if word is None:
            return _Wanted(endpoints_of(params, self._default), prompt)
        self.counters["words"] += 1
        if not word.held():
            self.counters["expired_words"] += 1
            return _Wanted((), prompt, found=0)  # dropped by its producer: nothing to load or release
        self.counters["hits"] += 1
        return _Wanted(word.endpoints, prompt, asked=True, found=word.tokens, published=True)

    def _log_refusal(self, request_id: str, error: TransferParamsError) -> None:
        now = time.monotonic()
        if now >= self._next_refusal_log:
            self._next_refusal_log = now + REFUSAL_LOG_EVERY_S
            log.warning("request %s: its kv_transfer_params are refused, its prompt is computed here: %s "
                        "(%d refused so far)", request_id, error, self.counters["refused_words"])  # fmt: skip

    def allocated(self, request_id: str, block_ids: Sequence[int], external: int) -> None:
        """vLLM gave the request its blocks, `external` tokens of them to load."""
        wanted = self._wanted.get(request_id)
        if external <= 0 or wanted is None:
            return
        wanted.planned = True
        first, end = wanted.local, wanted.local + external
        blocks = list(block_ids[first // self._block_size : -(-end // self._block_size)])
        slots = slots_of(block_ids, self._block_size, first, end)
        self._loads.append(
            Load(request_id, wanted.endpoints, wanted.prompt[:end], first, slots, blocks, published=wanted.published)
        )
        self.counters["loads"] += 1
        self.counters["loaded_tokens"] += external

    def step(self, *, idle: bool = False) -> list[Load]:
        """This step's loads (once); the step's lookups leave now. A step that scheduled
        nothing (`idle`) while every request waits for a lookup then waits for the first
        answer on its way (`IDLE_WAIT_S` at most)."""
        self._lookups.send()
        loads, self._loads = self._loads, []
        if idle and not loads and self._only_lookups():
            self._lookups.wait_answer(IDLE_WAIT_S)
        return loads

    def _only_lookups(self) -> bool:
        """Whether every request the scheduler has shown waits for its lookup's answer: none
        runs, so the engine has nothing to do meanwhile (with vLLM's async scheduling a step
        can be empty while a batch runs: that one does not wait)."""
        return all(wanted.asked and wanted.found is None for wanted in self._wanted.values())

    def outcome(self, failed: set[str], settled: set[str], lost: Collection[str] = ()) -> None:
        """The workers' word on this step's loads: `failed` ones did not land; `settled` are
        all the step's loads, failed or not; producers in `lost` were gone or too slow to load
        from: no load is planned from them for a while (their lookups answer 0 meanwhile)."""
        for endpoint in lost:
            self._lookups.silence(endpoint, "a load from it failed")
        for request_id in settled:
            wanted = self._wanted.get(request_id) or self._awaiting.pop(request_id, None)
            if wanted is None:
                continue
            wanted.failed = request_id in failed
            wanted.settled = True
            self.counters["failed_loads"] += wanted.failed
            if wanted.failed:
                self._release(wanted)  # now: the request computes its prompt, whenever it ends

    def finished(
        self, request_id: str, aborted: bool, prompt: list[int] | None = None, params: dict[str, Any] | None = None
    ) -> None:
        """The request ended. One aborted before the scheduler ever looked it up (its client
        left as it arrived) releases the KV its `params` name: nobody else will take it."""
        wanted = self._wanted.pop(request_id, None)
        self._lookups.forget(request_id)
        if wanted is None:
            if aborted and prompt is not None and len(prompt) >= 2:
                unseen = _Wanted(endpoints_of(params, self._default), prompt)
                if unseen.endpoints:
                    self._release(unseen)
            return
        if wanted.planned and not wanted.settled:
            self._awaiting[request_id] = wanted  # the step's outcome may still say it failed
            while len(self._awaiting) > MAX_AWAITING:
                self._awaiting.popitem(last=False)
            return
        if wanted.unanswered:
            wanted.released = False  # its producer was too slow for the lookup: maybe for the release too
        if (wanted.found or wanted.unanswered or (aborted and wanted.found is None)) and not wanted.planned:
            self._release(wanted)  # found and never loaded, or maybe there: nobody else will take it

    def _release(self, wanted: _Wanted) -> None:
        """Release the request's KV on its producers (once)."""
        if wanted.released:
            return
        wanted.released = True
        tp = len(wanted.endpoints)
        for rank, endpoint in enumerate(wanted.endpoints):
            if publishes(rank, tp, self._total_heads, mla=self._mla):
                self._lookups.release(endpoint, wanted.prompt, shorter_by=CONTINUED_TOKENS)
        self.counters["releases"] += 1


@dataclass(slots=True)
class _Prefill:
    """A prefill request in flight: its prompt and its blocks, for the step that computes its
    last prompt token (vLLM names both only when the request is new)."""

    prompt: list[int]
    blocks: list[int] = field(default_factory=list)
    published: bool = False


class PrefillScheduler:
    """The prefill instance's half of the scheduler side (one thread: vLLM's scheduler)."""

    def __init__(
        self, lookups: Lookups, *, block_size: int, endpoints: tuple[str, ...], total_heads: int = 1, mla: bool = False,
        item_ttl_s: float | None = None,
    ) -> None:  # fmt: skip
        self._lookups = lookups
        self._block_size = block_size
        self._item_ttl_s = item_ttl_s
        """How long the producers hold what nobody takes: the word's `held_until`."""
        self.endpoints = endpoints
        """Every rank's producer, in rank order: what a finished request names."""
        self._publishing = [
            endpoint for rank, endpoint in enumerate(endpoints) if publishes(rank, len(endpoints), total_heads, mla=mla)
        ]
        self._requests: dict[str, _Prefill] = {}
        self._kept: set[str] = set()
        """Requests that asked for a remote decode, until they are scheduled (`new`) or end."""

    def asked(self, request_id: str, params: dict[str, Any] | None) -> None:
        """vLLM allocated the request's blocks; its `kv_transfer_params` say whether a decode
        instance will take its KV."""
        if params and params.get(REMOTE_DECODE_PARAM):
            self._kept.add(request_id)

    def new(self, request_id: str, prompt: list[int], block_ids: Sequence[int]) -> None:
        if request_id in self._kept:
            self._kept.discard(request_id)
            self._requests[request_id] = _Prefill(prompt, list(block_ids))

    def more_blocks(self, request_id: str, block_ids: Sequence[int], *, resumed: bool) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        if resumed:
            request.blocks = list(block_ids)
        else:
            request.blocks.extend(block_ids)

    def computed(self, request_id: str, computed: int) -> Save | None:
        """The request has `computed` prompt tokens done after this step: its `Save` if that is
        the whole prompt, once."""
        request = self._requests.get(request_id)
        if request is None or request.published or computed < len(request.prompt):
            return None
        request.published = True
        return Save(request_id, request.prompt, slots_of(request.blocks, self._block_size, 0, len(request.prompt)))

    def finished(self, request_id: str, prompt: list[int], aborted: bool) -> dict[str, Any] | None:
        """The `kv_transfer_params` a finished request hands on (None: nothing published)."""
        self._kept.discard(request_id)
        request = self._requests.pop(request_id, None)
        if request is None or not request.published:
            return None
        if aborted:
            for endpoint in self._publishing:
                self._lookups.release(endpoint, prompt)
            return None
        word = Word.of(self.endpoints, prompt, self._item_ttl_s)
        return {ENDPOINT_PARAM: self.endpoints[0], ENDPOINTS_PARAM: list(self.endpoints), WORD_PARAM: word.params()}
