"""`KVRT_*` environment variables: an operator's settings, read into constructor arguments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import kvrt
import kvrt.blocking
from kvrt.compat.vllm import KVLookupBuffer


@pytest.fixture(autouse=True)
def no_kvrt_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVRT_"):
            monkeypatch.delenv(name)


def test_unset_variables_leave_every_default() -> None:
    assert kvrt.producer_settings() == {} and kvrt.consumer_settings() == {}


def test_each_variable_becomes_its_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "KVRT_BIND": "tcp://0.0.0.0:5555", "KVRT_CONNECT": "tcp://prefill-0:5555, tcp://prefill-1:5555",
        "KVRT_DEVICE": "cuda:1", "KVRT_BUFFER_BYTES": "4GiB", "KVRT_HEARTBEAT_S": "0.5",
        "KVRT_CONNECT_TIMEOUT_S": "3", "KVRT_TRANSFER_TIMEOUT_S": "none", "KVRT_ITEM_TTL_S": "300",
        "KVRT_TRANSPORT": "tcp", "KVRT_NAME": "node-7",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert kvrt.producer_settings() == {
        "bind": "tcp://0.0.0.0:5555", "device": "cuda:1", "buffer_bytes": 4 << 30, "heartbeat_s": 0.5,
        "item_ttl_s": 300.0, "transport": "tcp", "name": "node-7",
    }  # fmt: skip
    assert kvrt.consumer_settings() == {
        "connect": ["tcp://prefill-0:5555", "tcp://prefill-1:5555"], "device": "cuda:1", "heartbeat_s": 0.5,
        "connect_timeout_s": 3.0, "transfer_timeout_s": None, "transport": "tcp", "name": "node-7",
    }  # fmt: skip


@pytest.mark.parametrize(("written", "size"), [("1048576", 1 << 20), ("512MiB", 512 << 20), ("2 G", 2 << 30)])
def test_a_buffer_size_may_be_written_with_a_binary_unit(
    monkeypatch: pytest.MonkeyPatch, written: str, size: int
) -> None:
    monkeypatch.setenv("KVRT_BUFFER_BYTES", written)
    assert kvrt.producer_settings()["buffer_bytes"] == size


def test_the_engines_own_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRT_DEVICE", "cuda:3")
    assert kvrt.producer_settings(device="cpu")["device"] == "cpu"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("KVRT_BUFFER_BYTES", "lots", "KVRT_BUFFER_BYTES='lots' is not a byte count"),
        ("KVRT_HEARTBEAT_S", "-1", "KVRT_HEARTBEAT_S='-1' must be a positive number of seconds"),
        ("KVRT_CONNECT_TIMEOUT_S", "soon", "KVRT_CONNECT_TIMEOUT_S='soon' is not a number of seconds"),
    ],
)
def test_a_variable_that_cannot_be_used_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(kvrt.InvalidInputError, match=message):
        kvrt.producer_settings() if name != "KVRT_CONNECT_TIMEOUT_S" else kvrt.consumer_settings()


def test_the_curve_certificate_files_make_each_sides_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    kvrt.make_keys(tmp_path, "producer")
    kvrt.make_keys(tmp_path / "clients", "decode-0")
    monkeypatch.setenv("KVRT_CURVE_SECRET_FILE", str(tmp_path / "producer.key_secret"))
    monkeypatch.setenv("KVRT_CURVE_ALLOWED_DIR", str(tmp_path / "clients"))
    server = kvrt.producer_settings()["curve"]
    assert isinstance(server, kvrt.CurveKeys) and server.allowed_clients is not None
    with pytest.raises(kvrt.InvalidInputError, match="without KVRT_CURVE_SERVER_FILE"):
        kvrt.consumer_settings()
    monkeypatch.setenv("KVRT_CURVE_SECRET_FILE", str(tmp_path / "clients" / "decode-0.key_secret"))
    monkeypatch.setenv("KVRT_CURVE_SERVER_FILE", str(tmp_path / "producer.key"))
    client = kvrt.consumer_settings()["curve"]
    assert client.server_key == server.public_key


def test_both_sides_run_from_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRT_BIND", "tcp://127.0.0.1:0")
    monkeypatch.setenv("KVRT_BUFFER_BYTES", "1MiB")
    with kvrt.blocking.Producer(**kvrt.producer_settings()) as producer:
        assert producer.buffer_bytes == 1 << 20
        monkeypatch.setenv("KVRT_CONNECT", producer.endpoint)
        monkeypatch.setenv("KVRT_NAME", "decode-env")
        with kvrt.blocking.Consumer(**kvrt.consumer_settings()) as consumer:
            assert consumer.endpoints == [producer.endpoint]
            assert consumer._service.name == "decode-env"  # type: ignore[attr-defined]


def test_the_vllm_drop_in_connects_to_kvrt_connect_when_given_no_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    with KVLookupBuffer("producer", 1e9) as producer:
        monkeypatch.setenv("KVRT_CONNECT", producer.endpoint)
        tokens = torch.arange(4)
        producer.insert(tokens, None, torch.ones(4), torch.ones(4), None)
        with KVLookupBuffer("consumer", 1e9) as consumer:
            assert consumer.endpoint == producer.endpoint
            assert consumer.drop_select(tokens, None)[0] is not None
