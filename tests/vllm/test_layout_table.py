"""The table of vLLM's GPU KV cache layouts that kvrt's GPU tests build is what this vLLM's own
code allocates (a vLLM upgrade that changes a layout shows up here first)."""

from __future__ import annotations

import json

from tests.vllm.layout_table import TABLE, table


def test_the_committed_table_is_what_vllms_own_code_allocates() -> None:
    assert json.loads(TABLE.read_text()) == json.loads(json.dumps(table())), (
        "vLLM lays its KV cache out otherwise now: run `python -m tests.vllm.layout_table` and check kvrt's moves"
    )
