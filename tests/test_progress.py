"""The progress bar: a line per tenth when not on a terminal, always the last step."""

from __future__ import annotations

import io

from kvrt._progress import Progress


def test_off_a_terminal_the_bar_prints_a_line_per_tenth_from_the_first_step_to_the_end() -> None:
    stream = io.StringIO()
    bar = Progress(100, "work", stream=stream)
    for _ in range(100):
        bar.advance()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11 and lines[0].endswith("1/100 ") and lines[-1].endswith("100/100 ")
    assert "[" + "#" * 40 + "]" in lines[-1]
