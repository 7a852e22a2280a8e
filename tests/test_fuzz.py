"""The control decoder under coverage-guided fuzzing (atheris): only typed refusals, bounded memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris", reason="atheris has no wheel for this platform")


@pytest.mark.timeout(180)
def test_the_decoder_survives_a_hundred_thousand_fuzzed_frames() -> None:
    script = Path(__file__).with_name("fuzz_decoder.py")
    result = subprocess.run(
        [sys.executable, str(script), "-runs=100000", "-max_len=4096", "-seed=2026"],
        capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Done 100000 runs" in result.stderr
