"""Coverage-guided fuzzing of the control decoder with atheris (run by tests/test_fuzz.py).

    python tests/fuzz_decoder.py -runs=100000

Any exception other than a ProtocolError, or memory growing past a bound, stops the run
with a non-zero exit and the input that did it.
"""

from __future__ import annotations

import sys
import tracemalloc

import atheris

from kvrt import _messages as m
from kvrt._errors import ProtocolError

# Coverage guidance for the decoder's own branches; instrumenting everything it imports
# (torch among them) would cost a minute for nothing (msgspec's parser is compiled code).
atheris.instrument_func(m.decode)
atheris.instrument_func(m.peek_request_id)

PEAK_BYTES_BOUND = 64 << 20


def one_input(data: bytes) -> None:
    try:
        m.decode(data)
    except ProtocolError:
        m.peek_request_id(data)
    _, peak = tracemalloc.get_traced_memory()
    if peak > PEAK_BYTES_BOUND:
        raise MemoryError(f"decoding a {len(data)}-byte frame peaked at {peak} bytes")


def main() -> None:
    tracemalloc.start()
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
