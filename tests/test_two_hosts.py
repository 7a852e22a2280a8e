"""Prefill and decode on two hosts: two network namespaces joined by a veth pair whose rate
`tc` holds to a few Gbit/s (`kvrt._bench._netns`), kvrt's producer in one and its consumer in
the other, beside a raw TCP stream of the same bytes over the same link (`kvrt bench hosts`).
Where namespaces cannot be made (not root, no iproute2) the tests skip and say why."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from kvrt._bench import _netns, hosts

pytestmark = pytest.mark.timeout(150)

RATE_BITS_PER_S = int(hosts.DEFAULT_RATE_GBIT * 1e9)
ROUNDS = 2


def fastest(runs: list[hosts.Measured], case: hosts.Case) -> hosts.Measured:
    return max(runs, key=lambda measured: measured.bytes_per_s(case))


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def can_make_namespaces() -> None:
    reason = _netns.unavailable()
    if reason is not None:
        pytest.skip(f"two hosts are two network namespaces here, which cannot be made: {reason}")


@pytest.fixture(scope="module")
def link(can_make_namespaces: None) -> Iterator[_netns.Link]:
    with _netns.shaped_link(RATE_BITS_PER_S) as made:
        yield made
    assert not {made.a, made.b} & namespaces()


def test_a_large_item_moves_between_two_hosts_at_the_rate_of_a_raw_tcp_stream_over_the_same_link(
    link: _netns.Link,
) -> None:
    # An item of 64 MiB: above what malloc serves from the memory it keeps (see
    # kvrt.transports.tcp). The faster of two turns of each (the raw stream, then kvrt, twice):
    # a process that other work on the host held back for a moment says nothing of the link.
    case = hosts.Case("64 MiB, one at a time", 64 << 20, requests=4, in_flight=1)
    raw, ours = [], []
    for _ in range(ROUNDS):
        raw.append(hosts.run_raw(link, case))
        ours.append(hosts.run_kvrt(link, case))
    row, met = hosts.report_row(case, fastest(raw, case), fastest(ours, case), hosts.DEFAULT_RATE_GBIT)
    print(dict(zip(hosts.HEADER, row, strict=True)))  # the consumer's CPU a request, with the rates
    assert met, dict(zip(hosts.HEADER, row, strict=True))


def test_a_link_leaves_no_namespace_behind_when_its_block_fails(can_make_namespaces: None) -> None:
    made: list[set[str]] = []

    def fail_inside() -> None:
        with _netns.shaped_link(RATE_BITS_PER_S) as link:
            made.append({link.a, link.b})
            assert made[0] <= namespaces()
            raise RuntimeError("inside the block")

    with pytest.raises(RuntimeError, match="inside the block"):
        fail_inside()
    assert not made[0] & namespaces()


def test_namespaces_left_by_a_run_that_was_killed_are_removed_by_the_next(can_make_namespaces: None) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait(20)
    orphan = f"{_netns.PREFIX}{gone.pid}xdead00a"
    subprocess.run(["ip", "netns", "add", orphan], check=True, timeout=20)
    try:
        assert orphan in _netns.remove_orphans()
        assert orphan not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", orphan], capture_output=True, timeout=20, check=False)


def test_where_namespaces_cannot_be_made_the_reason_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_netns.os, "geteuid", lambda: 1000)
    assert _netns.unavailable() == "making network namespaces needs root"
    monkeypatch.setattr(_netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(_netns.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    assert _netns.unavailable() == "`tc` (iproute2) is not installed"
