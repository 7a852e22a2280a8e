"""The first token at once: what the router asks a prefill and a decode instance, and how it
makes their two answers one completion, as a single instance writes it. Plain values in and
out (request bodies, answers, stream events as JSON objects); `proxy` moves them.

The prefill is asked for the prompt with `max_tokens` 1: its forward pass publishes the KV and
samples the first token, which the router answers to the client at once. The decode is then
asked to go on from the prompt plus the tokens the client has (the first one; after a decode
that failed mid-answer, also what that decode gave), with as many fewer to generate. It finds
the prompt's KV by its tokens (kvrt's lookup matches an item that is a prefix of what it is
asked), loads all but the last token of what it is asked and computes from there: greedy
answers are a single instance's, token for token.

    reason = fallback(path, body)        # None: the first token may come at once
    going = Continuation.of(body, prefill_answer)   # or None: the prefill gave no token
    going.first_event() / going.ended_answer()      # the client's first token
    going.decode_body(params)                        # what a decode is asked, now
    going.event(decode_event) / going.answer(decode_answer)   # the decode's, rewritten

Where one completion cannot be made of two, the router keeps the plain path (the decode
computes every output token; `Fallback` says why).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Final, TypeGuard

COMPLETIONS: Final = "/v1/completions"

DEFAULT_MAX_TOKENS: Final = 16
"""vLLM's `max_tokens` for a completion that names none (OpenAI's default)."""

STRUCTURED_KEYS: Final = (
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern",
)  # fmt: skip
"""Requests for structured output (vLLM's current name and its older ones)."""


class Fallback(enum.StrEnum):
    """Why a request's first token comes from its decode (the plain path), or why the prefill's
    KV is not used at all (`PREFILL_FAILED`, `NO_PREFILL`)."""

    OFF = "off"
    """The router runs with `--first-token decode`."""
    CHAT = "chat"
    """A chat completion: a decode cannot be asked to go on from tokens in a chat request."""
    SEVERAL_PROMPTS = "several_prompts"
    """A batch of prompts: one answer holds several completions."""
    SEVERAL_CHOICES = "several_choices"
    """`n` > 1, `best_of` or beam search: one first token cannot begin several choices."""
    LOGPROBS = "logprobs"
    """`logprobs` or `prompt_logprobs`: the first token's would come from another instance's
    answer, and the decode's prompt logprobs would hold it."""
    ECHO = "echo"
    """`echo`: the answer begins with the prompt, as the decode would echo its own."""
    STRUCTURED_OUTPUT = "structured_output"
    """A grammar or a schema: the decode's would start anew after the first token."""
    STOP_STRINGS = "stop_strings"
    """`stop` strings: the decode sees only the text after the first token, and a stop string
    that begins in the first token's text would pass unseen."""
    SEEDED_SAMPLING = "seeded_sampling"
    """A `seed` with sampling: the decode's generator would start at the second token, not
    where a single instance's stands."""
    OUTPUT_PENALTIES = "output_penalties"
    """Presence or frequency penalties, bad words, repetition detection, a thinking budget:
    they count output tokens, and the first would be in the decode's prompt."""
    PROMPT_FORM = "prompt_form"
    """A prompt the decode cannot be given as tokens plus one: a `suffix`, prompt embeddings,
    `truncate_prompt_tokens`, no prompt."""
    MAX_TOKENS = "max_tokens"
    """`max_tokens` or `min_tokens` that are not counts (the decode answers the error)."""
    NO_TOKEN = "no_token"
    """The prefill's answer holds no first token or no prompt tokens."""
    PREFILL_FAILED = "prefill_failed"
    """No prefill answered (two tried, or one refused the request): the decode computes the
    prompt."""
    NO_PREFILL = "no_prefill"
    """Every prefill instance is out: the decode computes the prompt."""


def fallback(path: str, body: dict[str, Any]) -> Fallback | None:
    """Why `body`, posted to `path`, keeps the plain path; None: its first token may come at once."""
    if path != COMPLETIONS:
        return Fallback.CHAT
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(token, list) for token in prompt):
        return Fallback.SEVERAL_PROMPTS
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(text, str) for text in prompt):
        return Fallback.SEVERAL_PROMPTS
    if not (isinstance(prompt, str) and prompt) and not (isinstance(prompt, list) and prompt):
        return Fallback.PROMPT_FORM
    if any(body.get(key) is not None for key in ("suffix", "prompt_embeds", "truncate_prompt_tokens")):
        return Fallback.PROMPT_FORM
    if body.get("n", 1) not in (1, None) or body.get("best_of", 1) not in (1, None) or body.get("use_beam_search"):
        return Fallback.SEVERAL_CHOICES
    if body.get("logprobs") is not None or body.get("prompt_logprobs") is not None:
        return Fallback.LOGPROBS
    if body.get("echo"):
        return Fallback.ECHO
    response_format = body.get("response_format")
    structured = isinstance(response_format, dict) and response_format.get("type", "text") != "text"
    if structured or any(body.get(key) is not None for key in STRUCTURED_KEYS):
        return Fallback.STRUCTURED_OUTPUT
    if body.get("stop"):
        return Fallback.STOP_STRINGS
    if body.get("seed") is not None and body.get("temperature") != 0:
        return Fallback.SEEDED_SAMPLING
    penalties = any(body.get(key) for key in ("presence_penalty", "frequency_penalty", "bad_words"))
    if penalties or any(body.get(key) is not None for key in ("repetition_detection", "thinking_token_budget")):
        return Fallback.OUTPUT_PENALTIES
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    min_tokens = body.get("min_tokens", 0)
    if not _count(max_tokens, at_least=1, none=True) or not _count(min_tokens, at_least=0, none=False):
        return Fallback.MAX_TOKENS
    return None


def _count(value: object, *, at_least: int, none: bool) -> bool:
    if value is None:
        return none
    return isinstance(value, int) and not isinstance(value, bool) and value >= at_least


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What a prefill instance is asked: the prompt, one output token, its KV kept for a decode,
    the prompt's token ids in the answer (to name the KV, and to hand the decode)."""
    asked = {
        **body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True},
        "return_token_ids": True,
    }  # fmt: skip
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 1:
        asked["min_tokens"] = 1  # the first token is no end (as with min_tokens > 1 alone)
    for key in ("stream_options", "max_completion_tokens"):
        asked.pop(key, None)
    return asked


def prompt_tokens(answer: dict[str, Any]) -> list[int]:
    """The prompt's token ids in a completion's answer (`return_token_ids`): in its choice for
    /v1/completions, at the top for /v1/chat/completions; [] when it has none."""
    tokens = answer.get("prompt_token_ids")
    choice = _first_choice(answer)
    if tokens is None and choice is not None:
        tokens = choice.get("prompt_token_ids")
    return tokens if _tokens(tokens) else []


def _first_choice(answer: dict[str, Any]) -> dict[str, Any] | None:
    choices = answer.get("choices")
    if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
        return choices[0]
    return None


def _tokens(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(token, int) and not isinstance(token, bool) for token in value)


def event_bytes(data: dict[str, Any] | str) -> bytes:
    """One server-sent event as vLLM writes one (`data: ...` and a blank line)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


@dataclass
class Continuation:
    """One completion made of a prefill's first token and a decode's answer (or, when a decode
    fails mid-answer, of several decodes' answers): what the client has been given so far."""

    body: dict[str, Any]
    """The client's request."""
    prompt: list[int]
    """The client's prompt, as tokens."""
    id: str
    created: int
    model: str
    tokens: list[int] = field(default_factory=list)
    """The output tokens the client has."""
    text: str = ""
    """Their text."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    asked_from: int = 0
    """How many output tokens the decode now answering was given in its prompt."""
    usage_sent: bool = False
    prefilled: dict[str, Any] = field(default_factory=dict)
    """The prefill's answer: a whole completion of one token."""

    @classmethod
    def of(cls, body: dict[str, Any], answer: dict[str, Any]) -> Continuation | None:
        """The completion a prefill's answer begins (None: it holds no first token)."""
        choice = _first_choice(answer)
        prompt = prompt_tokens(answer)
        if choice is None or not prompt:
            return None
        tokens, text = choice.get("token_ids"), choice.get("text", "")
        if not _tokens(tokens) or len(tokens) != 1 or not isinstance(text, str):
            return None
        created = answer.get("created")
        going = cls(
            body, prompt, str(answer.get("id", "")), created if isinstance(created, int) else 0,
            str(answer.get("model", body.get("model") or "")), list(tokens), text, prefilled=answer,
        )  # fmt: skip
        reason = choice.get("finish_reason")
        if reason == "stop" or (reason == "length" and going.max_tokens == 1):
            going.finish_reason, going.stop_reason = reason, choice.get("stop_reason")
        return going

    @property
    def max_tokens(self) -> int | None:
        max_tokens: int | None = self.body.get("max_tokens", DEFAULT_MAX_TOKENS)
        return max_tokens

    @property
    def ended(self) -> bool:
        """Whether the completion is whole (the first token ended it, or a decode's finished)."""
        return self.finish_reason is not None

    def ends_at_its_length(self) -> bool:
        """Whether the client has every token it asked for, though no decode said so (one
        was cut off after its last token, before the chunk with its finish reason): the
        completion then ends there, as `length` (a decode asked for no more tokens refuses)."""
        if self.finish_reason is None and self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
        return self.ended

    def end_events(self) -> bytes:
        """The chunk that says the completion ended (no text, its finish reason), and what
        ends a stream."""
        chunk: dict[str, Any] = {**self._head(), "choices": [self._choice("", [], first=False)]}
        return event_bytes(chunk) + self.last_events()

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def _wants_tokens(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    def _usage(self, prompt_tokens: int | None = None, completion_tokens: int | None = None) -> dict[str, int]:
        prompt = len(self.prompt) if prompt_tokens is None else prompt_tokens
        completion = len(self.tokens) if completion_tokens is None else completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _stream_options(self) -> tuple[bool, bool]:
        """Whether the client asked for a usage chunk at the end, and for usage in every chunk."""
        options = self.body.get("stream_options")
        if not isinstance(options, dict) or not options.get("include_usage"):
            return False, False
        return True, bool(options.get("continuous_usage_stats"))

    def decode_body(self, params: dict[str, Any] | None) -> dict[str, Any]:
        """What a decode is asked now: the prompt and the output so far as its prompt, as many
        fewer tokens to generate, the prefill's `kv_transfer_params` (verbatim)."""
        asked: dict[str, Any] = {**self.body, "prompt": self.prompt + self.tokens, "return_token_ids": True}
        if self.max_tokens is not None:
            asked["max_tokens"] = self.max_tokens - len(self.tokens)
        min_tokens = self.body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > 0:
            asked["min_tokens"] = max(0, min_tokens - len(self.tokens))
        asked.pop("kv_transfer_params", None)
        if params:
            asked["kv_transfer_params"] = params
        self.asked_from = len(self.tokens)
        return asked

    def _choice(self, text: str, tokens: list[int], *, first: bool) -> dict[str, Any]:
        return {
            "index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason, "prompt_token_ids": self.prompt if first and self._wants_tokens else None,
            "token_ids": tokens if self._wants_tokens else None,
        }  # fmt: skip

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def first_event(self) -> bytes:
        """The streamed chunk of the first token (with its finish reason if it ended the
        completion), and, if it did, what a stream's end holds."""
        chunk: dict[str, Any] = {**self._head(), "choices": [self._choice(self.text, self.tokens, first=True)]}
        _, continuous = self._stream_options()
        if continuous:
            chunk["usage"] = self._usage()
        events = event_bytes(chunk)
        if self.ended:
            events += self.last_events()
        return events

    def last_events(self) -> bytes:
        """What ends a stream: its usage chunk (if asked for and not sent yet), `[DONE]`."""
        include, _ = self._stream_options()
        events = b""
        if include and not self.usage_sent:
            events += event_bytes({**self._head(), "choices": [], "usage": self._usage()})
            self.usage_sent = True
        return events + event_bytes("[DONE]")

    def ended_answer(self) -> dict[str, Any]:
        """The whole answer of a completion that its first token ended (not streamed): the
        prefill's, which is one, without its `kv_transfer_params` (nobody will take that KV)."""
        choice = _first_choice(self.prefilled) or {}
        return {**self.prefilled, "kv_transfer_params": None, "choices": [{
            **choice, "token_ids": self.tokens if self._wants_tokens else None,
            "prompt_token_ids": self.prompt if self._wants_tokens else None,
        }]}  # fmt: skip

    def event(self, data: dict[str, Any]) -> dict[str, Any]:
        """A decode's stream chunk as the client reads it: of this completion (its id), the
        client's prompt in its usage, its tokens only if the client asked. Counts its tokens."""
        data = {**data, **self._head()}
        choice = _first_choice(data)
        if choice is not None:
            tokens = choice.get("token_ids")
            if _tokens(tokens):
                self.tokens += tokens
            text = choice.get("text")
            if isinstance(text, str):
                self.text += text
            if choice.get("finish_reason") is not None:
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
            data["choices"] = [{
                **choice, "prompt_token_ids": None, "token_ids": tokens if self._wants_tokens else None,
            }]  # fmt: skip
        usage = data.get("usage")
        if isinstance(usage, dict):
            data["usage"] = self._rewritten_usage(usage)
            if data.get("choices") == []:
                self.usage_sent = True
        return data

    def _rewritten_usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A decode's usage with the output it was given as prompt counted as output."""
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return usage
        rewritten = {**usage, **self._usage(prompt - self.asked_from, completion + self.asked_from)}
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            cached = min(details["cached_tokens"], rewritten["prompt_tokens"])
            rewritten["prompt_tokens_details"] = {**details, "cached_tokens": cached}
        return rewritten

    def answer(self, decoded: dict[str, Any]) -> dict[str, Any]:
        """A decode's whole answer (not streamed) as the client's: the output so far before
        its own, the client's prompt."""
        choice = _first_choice(decoded)
        if choice is None:
            return decoded
        tokens = choice.get("token_ids")
        text = choice.get("text")
        self.tokens += tokens if _tokens(tokens) else []
        self.text += text if isinstance(text, str) else ""
        self.finish_reason, self.stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
        merged = {**decoded, **self._head(), "choices": [{
            **choice, "text": self.text, "token_ids": self.tokens if self._wants_tokens else None,
            "prompt_token_ids": self.prompt if self._wants_tokens else None,
        }]}  # fmt: skip
        usage = decoded.get("usage")
        if isinstance(usage, dict):
            merged["usage"] = self._rewritten_usage(usage)
        return merged
