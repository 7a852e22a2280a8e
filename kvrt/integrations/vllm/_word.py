"""The prefill's word: what a finished prefill request says it published, carried to the decode
instance in its `kv_transfer_params`, so that the decode plans the load in the step that first
sees the request, without asking the producer first.

    {"kvrt_published": {"v": 1, "endpoints": [...], "tokens": 70, "digest": "9f0c...",
                        "held_until": 1796000000.0}}

`endpoints`: every prefill rank's producer, in rank order (which ranks hold which heads follows
from their count, as for `kvrt_endpoints`); `tokens`: the prompt tokens published (a prefix of
the decode's prompt); `digest`: XXH3-64 of those tokens (int64, little-endian), so that the word
is read only for the prompt it was given for; `held_until`: when the producer drops the KV if
nobody took it (seconds since the epoch; null: never).

The params come back through a router, from a client: they are untrusted. `read_word` checks
every field and its size before anything is planned from it; a word that cannot be read is
refused (`TransferParamsError`, the request is computed at the decode); a word of a later
version is not read (the decode asks the producer instead, as with a prefill of the previous
release, whose params carry only `kvrt_endpoints`). A word that was true when it was given can
be stale when it is read (the KV taken, evicted, expired): the load then fails and vLLM
recomputes its blocks.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import xxhash

import kvrt

WORD_PARAM: Final = "kvrt_published"
"""The key of a finished prefill's `kv_transfer_params` that carries its word."""

WORD_VERSION: Final = 1

MAX_ENDPOINTS: Final = 256
"""Most producers one word may name (a prefill's tensor-parallel ranks)."""

MAX_ENDPOINT_CHARS: Final = 256

MAX_WORD_TOKENS: Final = 1 << 24

_ENDPOINT: Final = re.compile(r"^tcp://[^\s/]+:\d{1,5}$")
_DIGEST: Final = re.compile(r"^[0-9a-f]{16}$")
_FIELDS: Final = frozenset({"v", "endpoints", "tokens", "digest", "held_until"})


class TransferParamsError(kvrt.InvalidInputError):
    """A request's `kv_transfer_params` say something about kvrt that cannot be used (the
    message names the field): its prompt is computed here."""


def tokens_digest(tokens: Sequence[int]) -> str:
    """XXH3-64 of `tokens` as int64 little-endian, in hex: what a word's `digest` is."""
    return xxhash.xxh3_64_hexdigest(np.asarray(tokens, dtype="<i8").tobytes())


@dataclass(frozen=True, slots=True)
class Word:
    """What a prefill published: `tokens` of its prompt, on `endpoints`, until `held_until`."""

    endpoints: tuple[str, ...]
    tokens: int
    digest: str
    held_until: float | None

    @staticmethod
    def of(endpoints: Sequence[str], prompt: Sequence[int], item_ttl_s: float | None) -> Word:
        """The word of a prefill that published the whole of `prompt` just now."""
        held_until = None if item_ttl_s is None else time.time() + item_ttl_s
        return Word(tuple(endpoints), len(prompt), tokens_digest(prompt), held_until)

    def params(self) -> dict[str, Any]:
        return {
            "v": WORD_VERSION, "endpoints": list(self.endpoints), "tokens": self.tokens, "digest": self.digest,
            "held_until": self.held_until,
        }  # fmt: skip

    def held(self, now: float | None = None) -> bool:
        """Whether the producer still holds the KV by its own word (it may have been taken since)."""
        return self.held_until is None or (time.time() if now is None else now) < self.held_until


def read_word(params: dict[str, Any] | None, prompt: Sequence[int]) -> Word | None:
    """The word in a request's `kv_transfer_params`, checked against its `prompt`; None when
    there is none (or of a later version). Raises `TransferParamsError` naming the field that
    cannot be used."""
    if not params or WORD_PARAM not in params:
        return None
    word = params[WORD_PARAM]
    if not isinstance(word, dict):
        raise TransferParamsError(f"{WORD_PARAM} must be an object, got {type(word).__name__}")
    version = word.get("v")
    if type(version) is not int:
        raise TransferParamsError(f"{WORD_PARAM}.v must be an integer, got {type(version).__name__}")
    if version > WORD_VERSION:
        return None
    if version < 1 or set(word) != _FIELDS:
        raise TransferParamsError(f"{WORD_PARAM} must hold exactly {sorted(_FIELDS)} at version {version}")
    endpoints = word["endpoints"]
    if not isinstance(endpoints, list) or not 1 <= len(endpoints) <= MAX_ENDPOINTS:
        raise TransferParamsError(f"{WORD_PARAM}.endpoints must be a list of 1 to {MAX_ENDPOINTS} producers")
    for endpoint in endpoints:
        if not isinstance(endpoint, str) or len(endpoint) > MAX_ENDPOINT_CHARS or not _ENDPOINT.match(endpoint):
            raise TransferParamsError(f"{WORD_PARAM}.endpoints: {str(endpoint)[:80]!r} is not a tcp://host:port")
    tokens = word["tokens"]
    if type(tokens) is not int or not 1 <= tokens <= min(len(prompt), MAX_WORD_TOKENS):
        raise TransferParamsError(
            f"{WORD_PARAM}.tokens must be an integer from 1 to the prompt's {len(prompt)} tokens, got {tokens!r}"[:200]
        )
    digest = word["digest"]
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise TransferParamsError(f"{WORD_PARAM}.digest must be 16 hex digits")
    if digest != tokens_digest(prompt[:tokens]):
        raise TransferParamsError(f"{WORD_PARAM}.digest is not that of the prompt's first {tokens} tokens")
    held_until = word["held_until"]
    if held_until is not None and (type(held_until) not in (int, float) or not math.isfinite(held_until)):
        raise TransferParamsError(f"{WORD_PARAM}.held_until must be null or seconds since the epoch")
    return Word(tuple(endpoints), tokens, digest, None if held_until is None else float(held_until))
