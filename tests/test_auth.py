"""CURVE on the control endpoint: known consumers get in, nobody else can issue anything."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

import kvrt
from tests.conftest import insert_tokens


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """producer.key(_secret), decode.key(_secret) allowed, stranger.key(_secret) not."""
    kvrt.make_keys(tmp_path, "producer")
    kvrt.make_keys(tmp_path / "allowed", "decode")
    kvrt.make_keys(tmp_path / "strangers", "stranger")
    return tmp_path


def server(keys: Path) -> kvrt.CurveKeys:
    return kvrt.CurveKeys.server(keys / "producer.key_secret", allowed_clients_dir=keys / "allowed")


async def test_an_allowed_consumer_exchanges_items_over_curve(keys: Path) -> None:
    client_keys = kvrt.CurveKeys.client(
        keys / "allowed" / "decode.key_secret", server_public_file=keys / "producer.key"
    )
    async with (
        kvrt.Producer(curve=server(keys)) as producer,
        kvrt.Consumer(connect=producer.endpoint, curve=client_keys) as consumer,
    ):
        await insert_tokens(producer, torch.arange(6))
        item = await consumer.drop_select(torch.arange(6))
        assert item is not None and item.matched == 6


async def test_a_consumer_whose_key_is_not_allowed_is_refused_with_auth_error(keys: Path) -> None:
    stranger = kvrt.CurveKeys.client(
        keys / "strangers" / "stranger.key_secret", server_public_file=keys / "producer.key"
    )
    async with kvrt.Producer(curve=server(keys)) as producer:
        with pytest.raises(kvrt.AuthError, match="CURVE handshake"):
            await kvrt.Client(producer.endpoint, curve=stranger, connect_timeout_s=1.0).start()
        assert producer.stats().peers == 0


async def test_a_consumer_that_does_not_know_the_producers_key_is_refused(keys: Path) -> None:
    wrong_server = kvrt.CurveKeys.client(
        keys / "allowed" / "decode.key_secret", server_public_file=keys / "strangers" / "stranger.key"
    )
    async with kvrt.Producer(curve=server(keys)) as producer:
        with pytest.raises(kvrt.AuthError):
            await kvrt.Consumer(connect=producer.endpoint, curve=wrong_server, connect_timeout_s=1.0).start()


async def test_a_plain_client_cannot_issue_any_operation_and_is_told_so_with_auth_error(keys: Path) -> None:
    async with kvrt.Producer(curve=server(keys)) as producer:
        started = time.monotonic()
        with pytest.raises(kvrt.AuthError, match="CURVE handshake"):
            await kvrt.Client(producer.endpoint, connect_timeout_s=5.0).start()
        with pytest.raises(kvrt.AuthError, match="CURVE handshake"):
            await kvrt.Consumer(connect=producer.endpoint, connect_timeout_s=5.0).start()
        assert time.monotonic() - started < 4.0  # told, not left to time out
        assert producer.stats().peers == 0


async def test_a_producer_given_no_key_list_admits_no_client(keys: Path) -> None:
    allowed = kvrt.CurveKeys.client(keys / "allowed" / "decode.key_secret", server_public_file=keys / "producer.key")
    closed = kvrt.CurveKeys.server(keys / "producer.key_secret")
    assert not closed.allow_any_client and closed.allowed_clients == frozenset()
    async with kvrt.Producer(curve=closed) as producer:
        with pytest.raises(kvrt.AuthError):
            await kvrt.Consumer(connect=producer.endpoint, curve=allowed, connect_timeout_s=5.0).start()
        with pytest.raises(kvrt.AuthError):  # the operator's tools neither: evict and all
            await kvrt.Client(producer.endpoint, curve=allowed, connect_timeout_s=5.0).start()


async def test_any_client_that_knows_the_producers_key_gets_in_only_when_the_producer_says_so(keys: Path) -> None:
    stranger = kvrt.CurveKeys.client(
        keys / "strangers" / "stranger.key_secret", server_public_file=keys / "producer.key"
    )
    open_to_all = kvrt.CurveKeys.server(keys / "producer.key_secret", allow_any_client=True)
    async with kvrt.Producer(curve=open_to_all) as producer:
        async with kvrt.Consumer(connect=producer.endpoint, curve=stranger) as consumer:
            assert await consumer.drop_select(torch.arange(3)) is None


def test_keys_from_the_environment_without_allowed_keys_admit_no_client(monkeypatch: pytest.MonkeyPatch) -> None:
    public, secret = zmq.curve_keypair()
    monkeypatch.setenv("KVRT_CURVE_PUBLIC_KEY", public.decode())
    monkeypatch.setenv("KVRT_CURVE_SECRET_KEY", secret.decode())
    monkeypatch.delenv("KVRT_CURVE_ALLOWED_KEYS", raising=False)
    keys = kvrt.CurveKeys.from_env()
    assert keys is not None and keys.allowed_clients == frozenset() and not keys.allow_any_client
    monkeypatch.setenv("KVRT_CURVE_ALLOW_ANY_CLIENT", "1")
    keys = kvrt.CurveKeys.from_env()
    assert keys is not None and keys.allow_any_client
    monkeypatch.setenv("KVRT_CURVE_ALLOW_ANY_CLIENT", "yes please")
    with pytest.raises(kvrt.InvalidInputError, match="ALLOW_ANY_CLIENT"):
        kvrt.CurveKeys.from_env()


def test_keys_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    public, secret = zmq.curve_keypair()
    server_public, _ = zmq.curve_keypair()
    monkeypatch.setenv("KVRT_CURVE_PUBLIC_KEY", public.decode())
    monkeypatch.setenv("KVRT_CURVE_SECRET_KEY", secret.decode())
    monkeypatch.setenv("KVRT_CURVE_SERVER_KEY", server_public.decode())
    keys = kvrt.CurveKeys.from_env()
    assert keys is not None and keys.server_key == server_public and keys.public_key == public
    monkeypatch.setenv("KVRT_CURVE_SECRET_KEY", "short")
    with pytest.raises(kvrt.InvalidInputError, match="40-character"):
        kvrt.CurveKeys.from_env()


def test_a_public_certificate_is_not_enough_for_a_side(keys: Path) -> None:
    with pytest.raises(kvrt.InvalidInputError, match="public key only"):
        kvrt.CurveKeys.server(keys / "producer.key")


@pytest.fixture
def killed_in_the_handshake() -> Iterator[str]:
    """An address whose listener accepts a connection and closes it at once, inside ZeroMQ's
    handshake, then stops listening: a producer's process as it is killed."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def accept_close_and_go() -> None:
        connection, _ = listener.accept()
        connection.close()
        listener.close()

    closing = threading.Thread(target=accept_close_and_go, daemon=True)
    closing.start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        closing.join(5)


async def test_a_producer_killed_in_the_handshake_is_not_taken_for_a_curve_refusal(
    killed_in_the_handshake: str,
) -> None:
    # Without CURVE on this side, a connection closed once in the handshake is a producer going
    # or coming: the consumer keeps connecting and says, when its connect timeout ends, that no
    # producer answered (not that CURVE refused it).
    started = time.monotonic()
    with pytest.raises(kvrt.KVRTTimeoutError, match="no producer answered") as refused:
        await kvrt.Consumer(connect=killed_in_the_handshake, connect_timeout_s=1.0).start()
    assert refused.value.phase == "connect"
    assert time.monotonic() - started < 5.0
