"""Prefill and decode on two hosts: a prefill instance in one network namespace and a decode
instance with kvrt's router in another, joined by a veth pair whose rate `tc` holds to a few
Gbit/s (`kvrt._bench._netns`), each instance's threads bound to a core of its own. Prompts
through the router decode as the decode instance decodes them alone, their KV moved across
the link by kvrt over TCP and over NIXL (UCX over TCP), and the producer holds nothing after.
Where namespaces cannot be made (not root, no iproute2) the tests skip and say why."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, ExitStack, contextmanager
from importlib.util import find_spec
from pathlib import Path
from typing import TypeVar

import pytest

from kvrt._bench import _netns
from tests.vllm.served import READY_S, Server, complete, connector_config, free_port, metrics, router, server
from tests.vllm.test_served import made_model, producers_hold, prompts

# Two instances start together (30-60 s on a 2-core host), then warm up.
pytestmark = pytest.mark.timeout(240)

T = TypeVar("T")

RATE_BITS_PER_S = 4_000_000_000
BIND_PORT = 7100
STOP_S = 90.0
REQUESTS, IN_FLIGHT = 16, 8
LOOKUP_TIMEOUT_S = 30.0
HEARTBEAT_S = 5.0


@pytest.fixture(scope="module")
def link() -> Iterator[_netns.Link]:
    reason = _netns.unavailable()
    if reason is not None:
        pytest.skip(f"two hosts are two network namespaces here, which cannot be made: {reason}")
    with _netns.shaped_link(RATE_BITS_PER_S) as made:
        yield made


@pytest.fixture(scope="module")
def opt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return made_model(tmp_path_factory.mktemp("two-hosts"), "opt")


def on_host(started: Server, address: str) -> str:
    """The URL of an instance started on the host whose link address is `address`, as the
    other host reaches it."""
    return f"http://{address}:{started.url.rsplit(':', 1)[1]}"


@contextmanager
def on_a_thread(namespace: str, manager: AbstractContextManager[T]) -> Iterator[Future[T]]:
    """`manager` entered on a thread of its own in `namespace` (its value, once entered, in the
    future) and left there when the block ends: an instance starting on one host while the
    calling thread starts another on the other."""
    entered: Future[T] = Future()
    leave = threading.Event()

    def run() -> None:
        try:
            with _netns.entered(namespace), manager as value:
                entered.set_result(value)
                leave.wait()
        except BaseException as exc:  # handed to the waiting thread
            if not entered.done():
                entered.set_exception(exc)

    thread = threading.Thread(target=run, name=f"on-{namespace}")
    thread.start()
    try:
        yield entered
    finally:
        leave.set()
        thread.join(STOP_S)


@contextmanager
def pair_on_two_hosts(model: Path, link: _netns.Link, transport: str) -> Iterator[tuple[str, str, str]]:
    """The prefill on host a (its producer bound at its link address), the decode and the
    router on host b, each instance's threads on a core of its own, started together: the
    prefill's producer endpoint, the router's URL and the decode's, as host b reaches them.
    The calling thread is on host b while the block runs. Each instance runs in its namespace
    by `ip netns exec` (its /sys, where UCX finds the link's device)."""
    folder = model.parent
    environment = {"UCX_TLS": "tcp"} if transport == "nixl" else {}
    bind = f"tcp://{link.address_a}:{BIND_PORT}"  # in a namespace of its own: no other process there
    prefill_config = connector_config("producer", bind=bind, transport=transport, heartbeat_s=HEARTBEAT_S)
    decode_config = connector_config(
        "consumer", transport=transport, lookup_timeout_s=LOOKUP_TIMEOUT_S, heartbeat_s=HEARTBEAT_S
    )
    prefill_server = server(
        model, folder, f"prefill-{transport}-{free_port()}", transfer=prefill_config, namespace=link.a,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0", "UCX_NET_DEVICES": link.device_a, **environment},
    )  # fmt: skip
    with ExitStack() as stack:
        starting = stack.enter_context(on_a_thread(link.a, prefill_server))
        stack.enter_context(_netns.entered(link.b))
        decode = stack.enter_context(server(
            model, folder, f"decode-{transport}-{free_port()}", transfer=decode_config, namespace=link.b,
            env={"VLLM_CPU_OMP_THREADS_BIND": "1", "UCX_NET_DEVICES": link.device_b, **environment},
        ))  # fmt: skip
        prefill = on_host(starting.result(READY_S), link.address_a)
        for url in (prefill, decode.url):  # warm (see test_served), the prefill across the link
            complete(url, prompts(2, seed=99), in_flight=2, max_tokens=2)
        routed = stack.enter_context(router([prefill], [decode.url], folder))
        yield bind, routed.url, decode.url


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_prompts_decode_as_the_decode_instance_alone_with_prefill_and_decode_on_two_hosts(
    opt: Path, link: _netns.Link, transport: str
) -> None:
    if transport == "nixl" and find_spec("nixl") is None:
        pytest.skip("NIXL is not installed (make test-vllm installs its wheels)")
    asked = prompts(REQUESTS, seed=21)
    with pair_on_two_hosts(opt, link, transport) as (bind, routed, decode):
        through_kvrt = complete(routed, asked, in_flight=IN_FLIGHT)
        alone = complete(decode, asked, in_flight=IN_FLIGHT)
        counted = metrics(decode)
        assert through_kvrt == alone
        assert counted["failed_loads"] == 0
        # Every prompt's KV came across the link, over `transport`: a decode forced to nixl
        # offers nothing else, and a load it could not make over it would count as failed. The
        # router hands the decode each prompt with the prefill's first token, so the whole prompt
        # is loaded and that token alone computed there.
        assert counted["loads"] == REQUESTS
        assert counted["loaded_tokens"] == sum(map(len, asked))
        assert producers_hold(bind, 1) == [0]
