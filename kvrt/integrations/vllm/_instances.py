"""The instances a router sends to, of one kind (prefill or decode): which is least busy, which
failed and is out, and the health checks that bring one back.

    instances = Instances("decode", urls, on_change=...)
    chosen = instances.pick(exclude={...})      # the least busy that is up (None: none left)
    with instances.using(chosen): ...           # counted in flight meanwhile
    instances.failed(chosen, "ServerDisconnectedError: ...")   # out; health-checked until back
    instances.succeeded(chosen)                 # an answer: up (if it was out)
    instances.view()                            # each one's state, for GET /health

An instance that fails (it refused or dropped a connection, timed out, answered a 5xx) is out:
requests go to the others of its kind, and its `/health` is asked after `PROBE_S[0]`, then
at doubling intervals up to `PROBE_S[1]`, until it answers 200; then it is up again. Where
every instance of a kind is out, `pick` offers the out ones too, least busy first (a request
has nowhere better to go; one that succeeds brings its instance back at once). One owned
task per out instance does the checks; `aclose` cancels them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

log = logging.getLogger("kvrt.integrations.vllm.proxy")

PROBE_S: Final = (0.5, 8.0)
"""An out instance's health is checked after the first figure, then at doubling intervals up
to the second."""

PROBE_TIMEOUT_S: Final = 5.0
"""The longest one health check may take."""


@dataclass(slots=True, eq=False)
class Instance:
    """One instance: its URL and what the router knows of it."""

    kind: str
    url: str
    up: bool = True
    in_flight: int = 0
    failures: int = 0
    """Failures since the router started."""
    error: str | None = None
    """Why it is out (its last failure), while it is."""
    out_since: float | None = None
    """When it went out (monotonic), while it is."""


class Instances:
    """The instances of one kind (see the module docstring). One event loop: the router's."""

    def __init__(self, kind: str, urls: Sequence[str], *, on_change: Callable[[Instance], None] | None = None) -> None:
        self.kind = kind
        self.all = [Instance(kind, url.rstrip("/")) for url in urls]
        self._turn = itertools.count()
        """Ties in load go to each instance in turn."""
        self._on_change = on_change or (lambda instance: None)
        self._probes: dict[Instance, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        """Health checks go out on `session` (the router's)."""
        self._session = session
        for instance in self.all:
            self._on_change(instance)

    async def aclose(self) -> None:
        probes = list(self._probes.values())
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)

    def pick(self, exclude: Collection[Instance] = (), *, out_too: bool = True) -> Instance | None:
        """The least busy instance that is up and not in `exclude`; when none is up, the least
        busy out one (unless not `out_too`); None when none is left."""
        left = [instance for instance in self.all if instance not in exclude]
        candidates = [instance for instance in left if instance.up] or (left if out_too else [])
        if not candidates:
            return None
        least = min(instance.in_flight for instance in candidates)
        tied = [instance for instance in candidates if instance.in_flight == least]
        return tied[next(self._turn) % len(tied)]

    @contextlib.contextmanager
    def using(self, instance: Instance) -> Iterator[Instance]:
        """`instance` counted in flight while the block runs."""
        instance.in_flight += 1
        self._on_change(instance)
        try:
            yield instance
        finally:
            instance.in_flight -= 1
            self._on_change(instance)

    def failed(self, instance: Instance, error: str) -> None:
        """`instance` failed a request: it is out until a health check says otherwise."""
        instance.failures += 1
        instance.error = error
        if instance.up:
            instance.up = False
            instance.out_since = time.monotonic()
            log.warning("%s instance %s is out (%s): checking its health", self.kind, instance.url, error)
            self._on_change(instance)
        if instance not in self._probes and self._session is not None:
            probe = asyncio.get_running_loop().create_task(self._probe(instance, self._session))
            self._probes[instance] = probe
            probe.add_done_callback(lambda done: self._forget_probe(instance, done))

    def _forget_probe(self, instance: Instance, probe: asyncio.Task[None]) -> None:
        if self._probes.get(instance) is probe:  # not a later one, started since it ended
            del self._probes[instance]

    def succeeded(self, instance: Instance) -> None:
        """`instance` answered a request: up, if it was out."""
        if not instance.up:
            self._back(instance, "it answered a request")

    def _back(self, instance: Instance, why: str) -> None:
        instance.up, instance.error, instance.out_since = True, None, None
        log.info("%s instance %s is back (%s)", self.kind, instance.url, why)
        self._on_change(instance)
        probe = self._probes.pop(instance, None)
        if probe is not None and probe is not asyncio.current_task():
            probe.cancel()

    async def _probe(self, instance: Instance, session: aiohttp.ClientSession) -> None:
        """Ask `instance` for its health until it answers 200 (an owned task; `aclose` ends it).
        A health check is a question asked at intervals by nature: no event tells that a
        process elsewhere is serving again."""
        wait_s, longest_s = PROBE_S
        while not instance.up:
            await asyncio.sleep(wait_s)
            try:
                timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
                async with session.get(instance.url + "/health", timeout=timeout) as answer:
                    healthy = answer.status == 200
            except (aiohttp.ClientError, TimeoutError):
                healthy = False
            if healthy and not instance.up:
                self._back(instance, "its health check answered")
                return
            wait_s = min(2 * wait_s, longest_s)

    def view(self) -> list[dict[str, Any]]:
        """Each instance's state, for `GET /health`."""
        now = time.monotonic()
        return [
            {
                "url": instance.url, "state": "up" if instance.up else "out", "in_flight": instance.in_flight,
                "failures": instance.failures, "error": instance.error,
                "out_for_s": None if instance.out_since is None else round(now - instance.out_since, 3),
            }
            for instance in self.all
        ]  # fmt: skip
