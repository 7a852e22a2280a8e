"""A large TCP payload travels in frames that the consumer's allocator serves from memory it
keeps, to consumers that say they take it so (`Capability.TCP_FRAMES`), and lands whole in
memory the consumer's receiver keeps and reuses (`kvrt.transports.tcp`)."""

from __future__ import annotations

import pytest
import torch

import kvrt
from kvrt import _messages as m
from kvrt.transports import tcp
from tests.conftest import make_kv
from tests.test_protocol import PEER, Pair

pytestmark = pytest.mark.timeout(60)

FRAME_BYTES = 64 << 10
"""Frames this small in the tests (and payloads framed from that size), so that a small item
travels in many."""


@pytest.fixture
def small_frames(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`tcp.FRAME_BYTES` and `tcp.FRAMED_FROM_BYTES` made small; the number of frames each
    payload the sender cut went in."""
    cuts: list[int] = []
    framed = tcp.framed

    def counted(frame: memoryview) -> list[memoryview]:
        pieces = framed(frame)
        cuts.append(len(pieces))
        return pieces

    monkeypatch.setattr(tcp, "FRAME_BYTES", FRAME_BYTES)
    monkeypatch.setattr(tcp, "FRAMED_FROM_BYTES", FRAME_BYTES)
    monkeypatch.setattr(tcp, "framed", counted)
    return cuts


def test_a_consumers_hello_says_it_takes_a_tcp_payload_in_frames() -> None:
    pair = Pair()
    pair.connect()
    assert pair.producer.takes(PEER, m.Capability.TCP_FRAMES)


def test_a_consumer_whose_hello_does_not_say_so_is_not_sent_frames() -> None:
    pair = Pair()
    hello = pair.consumer.connect(pair.now)
    pair.send(m.Hello(version=hello.version, name=hello.name, capabilities=["tcp"]))  # an older consumer's
    assert not pair.producer.takes(PEER, m.Capability.TCP_FRAMES)


async def test_an_item_larger_than_a_frame_arrives_whole_over_several_frames(small_frames: list[int]) -> None:
    tokens = torch.arange(64)
    key, value, hidden = make_kv(tokens, layers=4, heads=4, head_dim=64)  # 256 KiB of key and value
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        await producer.insert(tokens, None, key, value, hidden)
        item = await consumer.drop_select(tokens)
    assert small_frames and small_frames[0] > 1
    assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)
    assert item.hidden is not None and hidden is not None and torch.equal(item.hidden, hidden)


async def test_a_batch_whose_hits_are_larger_than_a_frame_arrives_whole(small_frames: list[int]) -> None:
    prompts = [torch.arange(64) + 1000 * index for index in range(3)]
    kvs = [make_kv(tokens, layers=4, heads=4, head_dim=64, seed=index) for index, tokens in enumerate(prompts)]
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        for tokens, (key, value, hidden) in zip(prompts, kvs, strict=True):
            await producer.insert(tokens, None, key, value, hidden)
        items = await consumer.drop_select_many(prompts)
    assert len(small_frames) == 3 and min(small_frames) > 1
    for item, (key, value, _) in zip(items, kvs, strict=True):
        assert item is not None and torch.equal(item.key, key) and torch.equal(item.value, value)


async def test_memory_a_framed_payload_landed_in_is_reused_once_its_item_is_gone(small_frames: list[int]) -> None:
    tokens = torch.arange(64)
    key, value, hidden = make_kv(tokens, layers=4, heads=4, head_dim=64)
    async with kvrt.Producer() as producer, kvrt.Consumer(connect=producer.endpoint) as consumer:
        landed = []
        for _ in range(3):
            await producer.insert(tokens, None, key, value, hidden)
            item = await consumer.drop_select(tokens)
            assert item is not None and torch.equal(item.key, key)
            landed.append(item.key.untyped_storage().data_ptr())
            del item
    assert len(set(landed)) == 1
