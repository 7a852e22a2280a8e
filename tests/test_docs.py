"""The examples in docs/ run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_embedded_example_runs_and_prints_what_the_guide_says() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / "embedded.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "got KV for 64 tokens, 48 matched" in result.stdout
    assert "second lookup: miss" in result.stdout
    assert "refused: drop_select: input_tokens must be a 1-D integer tensor" in result.stdout
