"""The prefill's word (`kvrt.integrations.vllm._word`, no vLLM needed): what a prefill says it
published reads back as it was said, for the prompt it was said for and no other."""

from __future__ import annotations

import pytest

from kvrt.integrations.vllm._word import WORD_PARAM, TransferParamsError, Word, read_word, tokens_digest

PROMPT = list(range(100, 170))


def test_a_word_reads_back_as_it_was_given_for_its_prompt_and_any_longer_one() -> None:
    word = Word.of(["tcp://10.0.0.1:7100", "tcp://10.0.0.1:7101"], PROMPT, 120.0)
    params = {WORD_PARAM: word.params()}
    assert read_word(params, PROMPT) == word
    assert read_word(params, [*PROMPT, 1, 2]) == word
    assert word.held() and not word.held(now=word.held_until)


def test_a_word_for_another_prompt_is_refused_naming_its_digest() -> None:
    params = {WORD_PARAM: Word.of(["tcp://10.0.0.1:7100"], PROMPT, None).params()}
    with pytest.raises(TransferParamsError, match="digest"):
        read_word(params, [PROMPT[0] + 1, *PROMPT[1:]])
    with pytest.raises(TransferParamsError, match="tokens"):
        read_word(params, PROMPT[:-1])


def test_params_without_a_word_or_with_a_later_ones_are_read_as_none() -> None:
    assert read_word(None, PROMPT) is None
    assert read_word({"kvrt_endpoint": "tcp://10.0.0.1:7100"}, PROMPT) is None
    assert read_word({WORD_PARAM: {"v": 2, "anything": "else"}}, PROMPT) is None


def test_the_digest_is_of_int64_little_endian_tokens() -> None:
    assert tokens_digest([1]) == tokens_digest((1,)) != tokens_digest([256])
    assert len(tokens_digest(PROMPT)) == 16
