"""The embedded API is a contract that engines build on: these tests pin its names and signatures."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import subprocess
import sys

import pytest
import torch

import kvrt
from tests._checks import caught_up


def test_the_embedded_api_names_are_exported_from_the_package() -> None:
    required = {
        "Producer",
        "Consumer",
        "KVItem",
        "KVRTError",
        "KVRTTimeoutError",
        "PeerLostError",
        "ProtocolError",
        "LocalProtocolError",
        "RemoteProtocolError",
        "CapacityError",
        "AuthError",
        "ClosedError",
        "InvalidInputError",
    }
    assert required <= set(kvrt.__all__)
    for name in kvrt.__all__:
        assert hasattr(kvrt, name), name


def test_producer_constructor_takes_bind_device_and_buffer_bytes() -> None:
    parameters = inspect.signature(kvrt.Producer).parameters
    assert list(parameters)[:3] == ["bind", "device", "buffer_bytes"]
    assert parameters["bind"].default == "tcp://127.0.0.1:0"
    assert parameters["device"].default == "cpu"
    assert parameters["buffer_bytes"].default == 1 << 30


def test_insert_takes_the_five_tensors_in_simple_buffers_order() -> None:
    parameters = list(inspect.signature(kvrt.Producer.insert).parameters)
    assert parameters[:6] == ["self", "input_tokens", "roi", "key", "value", "hidden"]
    assert inspect.iscoroutinefunction(kvrt.Producer.insert)


def test_consumer_constructor_takes_connect_and_device() -> None:
    parameters = inspect.signature(kvrt.Consumer).parameters
    assert list(parameters)[:2] == ["connect", "device"]
    assert parameters["device"].default == "cpu"


def test_drop_select_takes_tokens_roi_and_a_timeout_of_zero_by_default() -> None:
    parameters = inspect.signature(kvrt.Consumer.drop_select).parameters
    assert list(parameters)[:4] == ["self", "input_tokens", "roi", "timeout"]
    assert parameters["timeout"].default == 0.0
    assert inspect.iscoroutinefunction(kvrt.Consumer.drop_select)


def test_kv_item_has_the_five_tensors_and_the_matched_length() -> None:
    fields = [field.name for field in dataclasses.fields(kvrt.KVItem)]
    assert fields == ["input_tokens", "roi", "key", "value", "hidden", "matched"]


def test_the_pool_types_publish_and_pull_take_are_exported_and_need_no_triton() -> None:
    script = (
        "import sys, torch, kvrt\n"
        "table = kvrt.PoolTable([[[torch.zeros(8, 4, 2)]]], kvrt.Layout.TOKEN_MAJOR)\n"
        "assert table.geometry == kvrt.PoolGeometry(kvrt.Layout.TOKEN_MAJOR, 8, 2, 2, 8, 4), table.geometry\n"
        "assert 'triton' not in sys.modules, 'importing kvrt and building a PoolTable imported Triton'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_every_error_is_a_kvrt_error_and_the_standard_kind_it_resembles() -> None:
    for name in kvrt.__all__:
        value = getattr(kvrt, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, kvrt.KVRTError), name
    assert issubclass(kvrt.KVRTTimeoutError, TimeoutError)
    assert issubclass(kvrt.PeerLostError, ConnectionError)
    assert issubclass(kvrt.InvalidInputError, ValueError)
    assert issubclass(kvrt.LocalProtocolError, kvrt.ProtocolError)
    assert issubclass(kvrt.RemoteProtocolError, kvrt.ProtocolError)


def test_both_sides_are_async_context_managers_with_close_and_aclose() -> None:
    for cls in (kvrt.Producer, kvrt.Consumer, kvrt.Client):
        assert inspect.iscoroutinefunction(cls.__aenter__)
        assert inspect.iscoroutinefunction(cls.__aexit__)
        assert inspect.iscoroutinefunction(cls.aclose)
        assert inspect.iscoroutinefunction(cls.close)


async def test_close_ends_pending_calls_like_aclose() -> None:
    async with kvrt.Producer() as producer:
        consumer = await kvrt.Consumer(connect=producer.endpoint).start()
        pending = asyncio.create_task(consumer.drop_select(torch.arange(3), None, timeout=None))
        await caught_up(consumer)  # the first request is waiting now
        await consumer.close()
        with pytest.raises(kvrt.ClosedError):
            await pending


def test_the_blocking_sides_and_the_vllm_drop_in_are_where_design_names_them() -> None:
    import kvrt.blocking
    import kvrt.compat.vllm

    empty, positional, keyword = inspect.Parameter.empty, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter
    assert isinstance(kvrt.blocking.Producer, type) and isinstance(kvrt.blocking.Consumer, type)
    drop_in = kvrt.compat.vllm.KVLookupBuffer
    described = [(p.name, p.kind, p.default) for p in inspect.signature(drop_in).parameters.values()]
    assert described == [
        ("role", positional, empty),
        ("buffer_size_thresh", positional, empty),
        ("endpoint", keyword.KEYWORD_ONLY, None),
        ("options", keyword.VAR_KEYWORD, empty),
    ]
    insert = list(inspect.signature(drop_in.insert).parameters)
    assert insert == ["self", "input_tokens", "roi", "key", "value", "hidden"]
    assert list(inspect.signature(drop_in.drop_select).parameters) == ["self", "input_tokens", "roi"]
    assert list(inspect.signature(drop_in.close).parameters) == ["self"]
