"""`into=` and the lease rule over GPU transports: a producer process on cuda:0 and the consumer
here (cuda:1, or cuda:0 too where one GPU is visible: `tests/_gpus.py`)."""

from __future__ import annotations

import pytest
import torch

import kvrt
from tests._checks import lease_ends_with_the_next_delivery, same_bits
from tests._gpu_processes import kv_item, run_gpu_producer
from tests._gpus import CONSUMER_DEVICE, PRODUCER_DEVICE, needs_nixl, one_gpu, producer_transport
from tests._processes import child_process

pytestmark = [one_gpu, pytest.mark.timeout(100, method="thread")]

TOKENS = 300


def _staging(like: torch.Tensor, extra: int = 0) -> torch.Tensor:
    return torch.full((like.numel() + extra,), -1, dtype=like.dtype, device=CONSUMER_DEVICE)


@pytest.mark.parametrize("transport", ["cuda_ipc", "tcp", pytest.param("nixl", marks=needs_nixl)])
async def test_an_item_over_a_gpu_consumer_lands_in_its_buffers_ordered_on_its_stream(
    transport: str,
) -> None:
    """Over nixl the item is READ into the buffers themselves, after the stream's work before
    the call (the buffers are cleared on it behind 100 ms of GPU work, which the READ waits for)."""
    items = [(index, TOKENS, "bfloat16") for index in range(3)]
    producer = (PRODUCER_DEVICE, producer_transport(transport), 1.0, items)
    async with (
        child_process(run_gpu_producer, producer, "GPU producer") as (endpoint, _, _),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport=transport) as consumer,
    ):
        assert consumer.transports == {endpoint: transport}
        tokens, key, value, hidden = kv_item(0, TOKENS, torch.bfloat16, CONSUMER_DEVICE)
        into = kvrt.KVBuffers(key=_staging(key, 64), value=_staging(value), hidden=_staging(hidden))
        stream = torch.cuda.Stream(CONSUMER_DEVICE)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)
            for buffer in (into.key, into.value):
                buffer.fill_(0)
        item = await consumer.drop_select(tokens, into=into, stream=stream)
        assert item is not None and item.key.data_ptr() == into.key.data_ptr()
        with torch.cuda.stream(stream):  # what the caller's stream reads after the call
            landed = (item.key.clone(), item.value.clone(), item.hidden.clone())  # type: ignore[union-attr]
        stream.synchronize()
        assert same_bits(landed[0], key) and same_bits(landed[1], value) and same_bits(landed[2], hidden)
        queries, kvs = [], []
        for index in (1, 2):
            index_tokens, index_key, index_value, _ = kv_item(index, TOKENS, torch.bfloat16, CONSUMER_DEVICE)
            queries.append(index_tokens)
            kvs.append((index_key, index_value))
        buffers = [kvrt.KVBuffers(key=_staging(k), value=_staging(v)) for k, v in kvs]
        batch = await consumer.drop_select_many(queries, into=buffers)
        torch.cuda.current_stream(torch.device(CONSUMER_DEVICE)).synchronize()
        for got, buffer, (want_key, want_value) in zip(batch, buffers, kvs, strict=True):
            assert got is not None and got.value.data_ptr() == buffer.value.data_ptr()
            assert same_bits(got.key, want_key) and same_bits(got.value, want_value)


async def test_a_gpu_item_that_does_not_fit_its_buffers_goes_back_to_the_producer() -> None:
    async with (
        child_process(run_gpu_producer, (PRODUCER_DEVICE, None, 1.0, [(0, TOKENS, "bfloat16")]), "GPU producer") as (
            endpoint,
            _,
            _,
        ),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE) as consumer,
    ):
        tokens, key, value, _ = kv_item(0, TOKENS, torch.bfloat16, CONSUMER_DEVICE)
        small = kvrt.KVBuffers(key=_staging(key)[:-1], value=_staging(value))
        with pytest.raises(kvrt.InvalidInputError, match="key"):
            await consumer.drop_select(tokens, into=small)
        item = await consumer.drop_select(tokens)
        assert item is not None and same_bits(item.key, key)


async def test_a_cuda_ipc_delivery_read_after_the_lease_ended_opens_nothing_of_the_producers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvrt.transports import cuda_ipc

    opened: list[bool] = []
    new_shared = cuda_ipc._new_shared

    def watched(device_index: int, share: object, *, counted: bool) -> object:
        opened.append(counted)
        return new_shared(device_index, share, counted=counted)  # type: ignore[arg-type]

    async with (
        child_process(run_gpu_producer, (PRODUCER_DEVICE, None, 1.0, [(0, TOKENS, "bfloat16")]), "GPU producer") as (
            endpoint,
            _,
            _,
        ),
        kvrt.Consumer(connect=endpoint, device=CONSUMER_DEVICE, transport="cuda_ipc") as consumer,
    ):
        tokens, key, _, _ = kv_item(0, TOKENS, torch.bfloat16, CONSUMER_DEVICE)
        lease_ends_with_the_next_delivery(consumer.link_for_tests(), monkeypatch)
        monkeypatch.setattr(cuda_ipc, "_new_shared", watched)
        with pytest.raises(kvrt.LeaseExpiredError):
            await consumer.drop_select(tokens)
        assert opened == []
        monkeypatch.undo()
        item = await consumer.drop_select(tokens)
        assert item is not None and same_bits(item.key, key)
