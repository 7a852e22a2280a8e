"""A progress bar on stderr for long runs: redrawn in place on a terminal, a line per tenth
otherwise (so logs of CI or a device run stay short)."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, width: int = 40) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self._stream = stream or sys.stderr
        self._width = width
        self._tty = self._stream.isatty()
        self._last_tenth = -1

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + steps)
        tenth = 10 * self.done // self.total
        if not self._tty and tenth == self._last_tenth and self.done != self.total:
            return
        self._last_tenth = tenth
        filled = self._width * self.done // self.total
        bar = f"  {self.label} [{'#' * filled}{'.' * (self._width - filled)}] {self.done}/{self.total} {note}"
        end = "" if self._tty and self.done < self.total else "\n"
        print(("\r" if self._tty else "") + bar, end=end, file=self._stream, flush=True)
