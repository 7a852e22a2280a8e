"""The guide's served commands run as written: the block of docs/guide.md marked
`served-commands` (a tiny model made, a prefill at TP 2 and a decode at TP 1 bound to their
cores, kvrt's router, one request through it) is taken from the page and run command by
command in a shell whose `python` and `kvrt` are this venv's, as a user who activated it
would. The background commands (`&`) are the servers: each is waited for on its port before
the next foreground command, as the guide tells the user to. The request is answered, its KV
moved through kvrt, and the producers hold nothing afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

import kvrt.blocking
from tests.vllm.served import READY_S, Server, _wait_ready, complete, metrics

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- served-commands"

pytestmark = pytest.mark.timeout(600)


def served_commands(guide: str) -> list[str]:
    """The shell commands of the block after the mark, each whole (continued lines and
    quotes spanning lines joined), comments left out."""
    after = guide[guide.index(MARK) :]
    block = after.split("```sh\n", 1)[1].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line + "\n"
        if current.count("'") % 2 == 0 and not line.endswith("\\"):
            commands.append(current.strip())
            current = ""
    assert not current, f"an unfinished command in the guide's block: {current!r}"
    return commands


def test_the_block_is_split_into_whole_commands() -> None:
    commands = served_commands((ROOT / "docs" / "guide.md").read_text())
    assert commands[0].startswith("python -m tests.vllm.instance make-model")
    servers = [command for command in commands if command.endswith("&")]
    assert len(servers) == 3 and all(command.count("'") % 2 == 0 for command in commands)
    assert commands[-1].startswith("curl ")


def port_of(command: str) -> int:
    ports = re.findall(r"--port (\d+)", command)
    assert len(ports) == 1, f"a server command names one --port: {command}"
    return int(ports[0])


@contextmanager
def background(command: str, log: Path, environment: dict[str, str]) -> Iterator[Server]:
    """`command` (a server) run by a shell in a session of its own, until the block ends; not
    waited for (`_wait_ready`) here: the guide starts its servers together."""
    port = port_of(command)
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", command.removesuffix("&").strip()], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            env=environment, start_new_session=True,
        )  # fmt: skip
    served = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        yield served
    finally:
        if process.poll() is None:
            group = os.getpgid(process.pid)
            os.killpg(group, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(group, signal.SIGKILL)
                process.wait(30)


def free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_the_guides_served_commands_run_as_written_and_move_the_kv_through_kvrt(tmp_path: Path) -> None:
    guide = (ROOT / "docs" / "guide.md").read_text()
    commands = served_commands(guide)
    binds = [int(port) for port in re.findall(r'"bind": "tcp://127\.0\.0\.1:(\d+)"', guide[guide.index(MARK) :])]
    producers = [binds[0], binds[0] + 1]  # the prefill's two ranks
    ports = [port_of(command) for command in commands if command.endswith("&")] + producers
    assert all(free(port) for port in ports), f"the guide's ports {ports} must be free on this host"
    # A shell whose `python` and `kvrt` are this venv's: what `source .venv-vllm/bin/activate` gives.
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    answers: list[str] = []
    starting: list[Server] = []
    with ExitStack() as servers:
        for index, command in enumerate(commands):
            if command.endswith("&"):
                log = tmp_path / f"server-{index}.log"
                starting.append(servers.enter_context(background(command, log, environment)))
                continue
            for served in starting:  # the guide: once each said "Application startup complete"
                _wait_ready(served.url, served.process, served.log, READY_S)
            starting.clear()
            done = subprocess.run(
                ["bash", "-c", command], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300,
                check=False,
            )  # fmt: skip
            assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            answers.append(done.stdout)
        completion = json.loads(answers[-1])
        assert completion["usage"]["completion_tokens"] == 8, completion
        consumer = next(command for command in commands if '"kv_consumer"' in command)
        decode = f"http://127.0.0.1:{port_of(consumer)}"
        # A worker's counters go out with a later step's output: one more request, its own.
        complete(decode, [[7, 8, 9]], in_flight=1, max_tokens=2)
        assert metrics(decode)["loads"] == 1  # the guide's request's KV came through kvrt
        for port in producers:
            with kvrt.blocking.Client(f"tcp://127.0.0.1:{port}", connect_timeout_s=10) as client:
                assert client.stats().items == 0
