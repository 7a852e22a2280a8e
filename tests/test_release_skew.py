"""Peers one release apart: this tree against the last release, installed from the
repository's own history, in both roles (docs/protocol.md, Versions).

The last release is the newest `## [x.y.z]` section of CHANGELOG.md; its source is the commit
tagged `vx.y.z` (or, in a clone without tags, the commit that added that section). It is
installed with pip into a directory of its own and run by `tests/_release_peer.py` in its own
interpreter, which imports it before this tree's kvrt. The two releases must move every kind
of request intact (one at a time, a batch, a piece of the heads, a stream), or, where the
protocol's version changed between them, refuse at hello with `VersionMismatchError` naming
both releases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

import kvrt
from kvrt import _messages as m
from kvrt._errors import ErrorCode
from tests import _release_peer as peer
from tests._checks import raw_exchange

ROOT = Path(__file__).resolve().parent.parent
PEER = Path(peer.__file__).resolve()
START_S = 60.0
"""How long the last release's process may take to import torch and start (a loaded host)."""


@dataclass(frozen=True)
class Release:
    version: str
    commit: str
    site: Path
    """Where it is installed: first on the peer process's path."""


def _git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()} (the skew test needs the history)")
    return done.stdout.strip()


def last_release_version() -> str:
    found = re.search(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert found, "CHANGELOG.md names no release"
    return found.group(1)


def release_commit(version: str) -> str:
    """The commit tagged `v<version>`, or else the one that added its changelog section."""
    with contextlib.suppress(RuntimeError):
        return _git("rev-parse", "--verify", "--quiet", f"refs/tags/v{version}^{{commit}}")
    added = _git("log", "--format=%H", "--reverse", "-S", f"## [{version}]", "--", "CHANGELOG.md").splitlines()
    assert added, f"no commit adds the changelog section of {version}"
    return added[0]


@pytest.fixture(scope="module")
def last_release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    version = last_release_version()
    commit = release_commit(version)
    work = tmp_path_factory.mktemp(f"kvrt-{version}")
    source, site = work / "source", work / "site"
    source.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit], capture_output=True, timeout=120, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, timeout=120, check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-compile",
         "--target", str(site), str(source)],
        capture_output=True, timeout=300, check=True,
    )  # fmt: skip
    return Release(version, commit, site)


def _environment(release: Release) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("KVRT_")}
    environment["PYTHONPATH"] = str(release.site)
    return environment


async def _line(process: asyncio.subprocess.Process, what: str) -> dict[str, Any]:
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), START_S)
    if not line:
        _, errors = await process.communicate()
        raise AssertionError(f"the last release's {what} ended without a word:\n{errors.decode()[-4000:]}")
    said: dict[str, Any] = json.loads(line)
    return said


def _assert_is(said: dict[str, Any], release: Release) -> None:
    """The peer process runs the installed release, not this tree."""
    assert said["release"] == release.version
    assert Path(said["module"]).resolve().is_relative_to(release.site.resolve())


@contextlib.asynccontextmanager
async def last_release_producer(release: Release) -> AsyncIterator[dict[str, Any]]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-P", str(PEER), "produce", cwd=release.site, env=_environment(release),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        said = await _line(process, "producer")
        _assert_is(said, release)
        yield said
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()


async def last_release_takes(release: Release, endpoint: str) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-P", str(PEER), "take", endpoint, cwd=release.site, env=_environment(release),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        said = await _line(process, "consumer")
        _assert_is(said, release)
        assert await asyncio.wait_for(process.wait(), 30) == 0
        return said
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def _speaks_this_protocol(said: dict[str, Any]) -> bool:
    return bool(said["protocol"] == kvrt.PROTOCOL_VERSION)


async def test_a_consumer_of_this_tree_takes_every_kind_of_request_from_a_producer_of_the_last_release(
    last_release: Release,
) -> None:
    async with last_release_producer(last_release) as said:
        if not _speaks_this_protocol(said):
            with pytest.raises(kvrt.VersionMismatchError, match=re.escape(kvrt.__version__)):
                await kvrt.Consumer(connect=said["endpoint"]).start()
            return
        async with kvrt.Consumer(connect=said["endpoint"]) as consumer:
            assert await asyncio.wait_for(peer.take(consumer), 60) == peer.expected()


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
async def test_a_consumer_of_the_last_release_takes_every_kind_of_request_from_a_producer_of_this_tree(
    last_release: Release, checksum: bool
) -> None:
    async with kvrt.Producer(bind="tcp://127.0.0.1:0", checksum=checksum) as producer:
        await peer.produce(producer)
        said = await last_release_takes(last_release, producer.endpoint)
        assert _speaks_this_protocol(said), (
            f"kvrt {last_release.version} speaks protocol {said['protocol']}, this tree {kvrt.PROTOCOL_VERSION}: "
            "releases one minor version apart speak one protocol (rule 6, kvrt/_messages.py)"
        )
        assert said["report"] == peer.expected()
        async with kvrt.Consumer(connect=producer.endpoint) as consumer:
            assert await consumer.drop_select_many([peer.tokens_of(index) for index in range(6)]) == [None] * 6


# -- a peer of another protocol version: refused at hello, both releases named -----------------

NEXT = kvrt.PROTOCOL_VERSION + 1


async def test_a_producer_refuses_a_hello_of_another_protocol_version_naming_both_releases() -> None:
    hello = msgspec.msgpack.encode([NEXT, {"type": "hello", "version": NEXT, "release": "9.0.0"}])
    async with kvrt.Producer(bind="tcp://127.0.0.1:0") as producer:
        reply = await raw_exchange(producer.endpoint, [hello])
    assert isinstance(reply, m.ErrorReply) and reply.code is ErrorCode.VERSION
    for named in ("kvrt 9.0.0", f"version {NEXT}", f"kvrt {kvrt.__version__}", f"speaks {kvrt.PROTOCOL_VERSION}"):
        assert named in reply.message


async def test_a_consumer_refused_by_a_producer_of_another_protocol_version_raises_naming_both_releases() -> None:
    """The refusal comes in the newer producer's envelope: `error` is read under any version."""
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def refuse_the_hello() -> m.Hello:
        peer_id, frame = await router.recv_multipart()
        hello = m.decode(frame)
        assert isinstance(hello, m.Hello)
        text = f"the peer (kvrt {hello.release}) speaks {hello.version}; this side (kvrt 9.0.0) speaks {NEXT}"
        error = {"type": "error", "request_id": None, "code": "version", "message": text}
        await router.send_multipart([peer_id, msgspec.msgpack.encode([NEXT, error])])
        return hello

    try:
        refusing = asyncio.create_task(refuse_the_hello())
        with pytest.raises(kvrt.VersionMismatchError) as refused:
            await kvrt.Consumer(connect=f"tcp://127.0.0.1:{port}", connect_timeout_s=30).start()
        assert (await refusing).release == kvrt.__version__
        assert "kvrt 9.0.0" in str(refused.value) and f"kvrt {kvrt.__version__}" in str(refused.value)
    finally:
        router.close()
        context.term()


@pytest.mark.parametrize("welcome_is", ["of the next protocol version", "unreadable in this one", "with no heartbeat"])
async def test_a_welcome_this_release_cannot_read_fails_start_at_once_saying_why(welcome_is: str) -> None:
    """A producer that welcomes instead of refusing (a newer one under a version this side does
    not speak, or one that broke the protocol's rules: a heartbeat of 0 would have the consumer
    ping without pause): `start()` raises why, not a timeout."""
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    version = NEXT if welcome_is == "of the next protocol version" else kvrt.PROTOCOL_VERSION
    heartbeat_s = 0.0 if welcome_is == "with no heartbeat" else "soon"
    welcome = {"type": "welcome", "version": version, "producer_id": "p", "heartbeat_s": heartbeat_s,
               "lease_s": 10.0, "release": "9.0.0"}  # fmt: skip

    async def welcome_the_hello() -> None:
        peer_id, _ = await router.recv_multipart()
        await router.send_multipart([peer_id, msgspec.msgpack.encode([version, welcome])])

    try:
        welcoming = asyncio.create_task(welcome_the_hello())
        expected = kvrt.VersionMismatchError if version == NEXT else kvrt.RemoteProtocolError
        started = time.monotonic()
        with pytest.raises(expected) as refused:
            await kvrt.Consumer(connect=f"tcp://127.0.0.1:{port}", connect_timeout_s=30).start()
        assert time.monotonic() - started < 10
        await welcoming
        said = str(refused.value)
        assert f"tcp://127.0.0.1:{port}" in said and f"kvrt {kvrt.__version__}" in said
        assert ("kvrt 9.0.0" in said and f"version {NEXT}" in said) if version == NEXT else "heartbeat_s" in said
    finally:
        router.close()
        context.term()
