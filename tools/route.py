"""The kvrt files one request passes through: a CPU `insert`, then a `drop_select` over TCP until
the caller holds the tensors, in one process (a producer and a consumer on one event loop),
after a few warm-up requests. A profiler (`sys.setprofile`) watches every call the loop's
thread makes meanwhile and prints, per kvrt file, the functions called there:

* the route: the files on the call stacks at the request's milestones (the item packed,
  buffered, taken; its delivery built, its frames posted and received, its tensors rebuilt),
  in the order the request first reaches them;
* the files touched: every kvrt file any call of the loop's thread entered meanwhile (helpers,
  checks, metrics, the loops' own bookkeeping too).

    python tools/route.py          (prints both lists and their counts)
"""

from __future__ import annotations

import asyncio
import os
import sys
from types import FrameType
from typing import Any

MILESTONES = (
    ("_tensors.py", "pack"),
    ("lookup_buffer.py", "add"),
    ("lookup_buffer.py", "take"),
    ("outgoing.py", "deliver_message"),
    ("tcp.py", "_frame"),
    ("_zmqio.py", "post"),
    ("_zmqio.py", "send_frames"),
    ("_zmqio.py", "send_nowait"),
    ("_zmqio.py", "recv_frames"),
    ("tcp.py", "receive"),
    ("_tensors.py", "unpack"),
)
"""(file, function) where something happens to the request or its bytes."""
WARM_UP = 3


async def trace() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The route and the files touched (see the module's docstring), each file's functions."""
    import torch

    import kvrt
    import kvrt.transports

    roots = [os.path.dirname(module.__file__ or "") + os.sep for module in (kvrt, kvrt.transports)]

    def kvrt_file(path: str) -> str | None:
        for root in roots:
            if path.startswith(root):
                return os.path.relpath(path, os.path.dirname(root.rstrip(os.sep)))
        return None

    route: dict[str, list[str]] = {}
    touched: dict[str, list[str]] = {}

    def note(into: dict[str, list[str]], name: str, function: str) -> None:
        functions = into.setdefault(name, [])
        if function not in functions:
            functions.append(function)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or (name := kvrt_file(frame.f_code.co_filename)) is None:
            return
        note(touched, name, frame.f_code.co_name)
        if any(name.endswith(file) and frame.f_code.co_name == function for file, function in MILESTONES):
            stack: list[FrameType] = []
            walker: FrameType | None = frame
            while walker is not None:
                stack.append(walker)
                walker = walker.f_back
            for outer in reversed(stack):  # outermost first: the order the request reaches them
                if (outer_name := kvrt_file(outer.f_code.co_filename)) is not None:
                    note(route, outer_name, outer.f_code.co_name)

    tokens, key = torch.arange(64), torch.randn(2, 64, 2, 8)
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        for _ in range(WARM_UP):  # imports, connections and first calls' caches
            await producer.insert(tokens, None, key, key)
            if await consumer.drop_select(tokens) is None:
                raise RuntimeError("a warm-up lookup missed")
        sys.setprofile(profile)
        try:
            await producer.insert(tokens, None, key, key)
            item = await consumer.drop_select(tokens)
        finally:
            sys.setprofile(None)
    if item is None:
        raise RuntimeError("the traced lookup missed")
    return route, touched


def main() -> int:
    route, touched = asyncio.run(trace())
    for title, files in (("route", route), ("touched", touched)):
        print(f"{title}: {len(files)} files")
        for name, functions in files.items():
            print(f"  {name}: {', '.join(functions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
