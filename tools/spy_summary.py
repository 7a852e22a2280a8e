"""Where a process's time went, from a py-spy raw profile (a diagnostic).

    py-spy record --subprocesses --native -r 400 -f raw -o spy.txt -- python3 tools/nccl_timeline.py OUT 16 32
    python3 tools/spy_summary.py spy.txt [FRAME_SUBSTRING [LINES]]

Prints the frames with the most samples of their own and, with FRAME_SUBSTRING (default
`_run_once`: asyncio's loop), the stacks through that frame only, by inclusive samples. py-spy
is on PyPI (`pip download py-spy --only-binary :all: -d .whl` for the GPU host, which
installs every wheel in .whl/; the binary lands in /tmp/site/bin).
"""

from __future__ import annotations

import collections
import sys


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    through = sys.argv[2] if len(sys.argv) > 2 else "_run_once"
    lines = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    with open(sys.argv[1]) as raw:
        for line in raw:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if not any(through in frame for frame in frames):
                continue
            samples = int(count)
            total += samples
            own[frames[-1]] += samples
            for frame in set(frames):
                inclusive[frame] += samples
    print(f"{total} samples through {through!r}")
    print("most samples of their own:")
    for frame, samples in own.most_common(lines):
        print(f"  {100 * samples / max(1, total):5.1f}%  {frame[:140]}")
    print("most samples with their callees:")
    for frame, samples in inclusive.most_common(lines):
        print(f"  {100 * samples / max(1, total):5.1f}%  {frame[:140]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
