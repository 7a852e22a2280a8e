"""Coverage-guided fuzzing of the control decoder with atheris (run by tests/test_fuzz.py).

    python tests/fuzz_decoder.py -runs=100000

Any exception other than a ProtocolError, or memory growing past a bound, stops the run
with a non-zero exit and the input that did it.
"""

from __future__ import annotations

import sys
import tracemalloc

import atheris

with atheris.instrument_imports():
    from kvrt import _messages as m
    from kvrt._errors import ProtocolError

PEAK_BYTES_BOUND = 64 << 20


def one_input(data: bytes) -> None:
    try:
        m.decode(data)
    except ProtocolError:
        pass
    _, peak = tracemalloc.get_traced_memory()
    if peak > PEAK_BYTES_BOUND:
        raise MemoryError(f"decoding a {len(data)}-byte frame peaked at {peak} bytes")


def main() -> None:
    tracemalloc.start()
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
