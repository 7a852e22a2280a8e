"""The vLLM connector's layouts and worker side, without vLLM: every GPU KV cache layout of the
pinned vLLM (built from `tests/data/vllm_kv_cache_layouts.json`, which vLLM's own code made) moved
prefill -> decode through the connector's worker side, layer by layer, bit for bit: between
layouts and block sizes, past a prefix the decode holds, and across tensor-parallel sizes.

On this host the caches are CPU tensors (the torch references move them); `tests/test_gpu_vllm_layouts.py`
runs the same moves on a GPU, through the Triton kernels, over cuda_ipc and nixl."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvrt.integrations.vllm import ConnectorConfigError
from kvrt.integrations.vllm._scheduler import Load, Save
from kvrt.integrations.vllm._tp import heads_of, pieces_for, publishes
from kvrt.integrations.vllm._worker import WorkerSide
from kvrt.integrations.vllm.layouts import CacheSpec, kv_cache_pools
from tests._checks import same_bits
from tests._vllm_layouts import (
    CACHES,
    build_cache,
    cache_id,
    cache_named,
    endpoints_of,
    load,
    publish,
    spec_of,
    token_rows,
    worker,
)

TOKENS = 70
"""Two and a bit blocks of 32, four and a bit of 16."""


@pytest.fixture
def sides() -> Iterator[Callable[..., tuple[WorkerSide, list[torch.Tensor]]]]:
    """`worker` on the CPU; every side closed after the test."""
    made: list[WorkerSide] = []

    def make(entry: dict[str, Any], **kwargs: Any) -> tuple[WorkerSide, list[torch.Tensor]]:
        side, caches = worker(entry, "cpu", **kwargs)
        made.append(side)
        return side, caches

    yield make
    for side in made:
        side.close()


def blocks_for(entry: dict[str, Any], tokens: int, seed: int) -> list[int]:
    """A request's block ids in the cache of `entry`, in shuffled order."""
    count = -(-tokens // entry["block_size"])
    return random.Random(seed).sample(range(entry["blocks"]), count)


def slots(entry: dict[str, Any], blocks: list[int], tokens: range) -> list[int]:
    size = entry["block_size"]
    return [blocks[token // size] * size + token % size for token in tokens]


def moved(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]], source: dict[str, Any], target: dict[str, Any], *,
    skip: int = 0, published: bool = False,
) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor], list[int], list[torch.Tensor]]:  # fmt: skip
    """A prompt published from a prefill cache of `source` and loaded into a decode cache of
    `target`: the prefill's caches and blocks, the decode's caches and blocks, and the decode's
    caches as they were before the load."""
    prefill, prefill_caches = sides(source, produces=True, seed=1)
    decode, decode_caches = sides(target, produces=False, seed=2)
    before = [cache.clone() for cache in decode_caches]
    tokens = list(range(1000, 1000 + TOKENS))
    from_blocks, into_blocks = blocks_for(source, TOKENS, 3), blocks_for(target, TOKENS, 4)
    publish([prefill], tokens, from_blocks, source["block_size"], source["layers"])
    endpoints = endpoints_of([prefill])
    failed = load(
        [decode], endpoints, tokens, into_blocks, target["block_size"], target["layers"], skip=skip, published=published
    )
    assert failed == [set()]
    return prefill_caches, from_blocks, decode_caches, into_blocks, before


def assert_landed(source: dict[str, Any], target: dict[str, Any], moved_caches: tuple[Any, ...], tokens: range) -> None:
    prefill_caches, from_blocks, decode_caches, into_blocks, _ = moved_caches
    sent = token_rows(source, prefill_caches, slots(source, from_blocks, tokens))
    landed = token_rows(target, decode_caches, slots(target, into_blocks, tokens))
    assert torch.equal(landed, sent)


@pytest.mark.parametrize("entry", CACHES, ids=cache_id)
def test_each_of_vllms_kv_caches_moves_into_one_of_its_own_layout_bit_for_bit(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]], entry: dict[str, Any]
) -> None:
    result = moved(sides, entry, entry)
    assert_landed(entry, entry, result, range(TOKENS))
    _, _, decode_caches, into_blocks, before = result
    # Every other page of the decode's cache is as it was.
    for cache, old in zip(decode_caches, before, strict=True):
        untouched = [block for block in range(entry["blocks"]) if block not in into_blocks]
        assert same_bits(cache[untouched], old[untouched])


CONVERSIONS = [
    (cache_named("FLASH_ATTN", "LBNHC"), cache_named("FLASH_ATTN", "LBHNC", block_size=32)),
    (cache_named("FLASH_ATTN", "LBHNC", block_size=32), cache_named("FLASH_ATTN", "BLNHC")),
    (cache_named("FLASH_ATTN", "BLHNC"), cache_named("FLASH_ATTN", "LHBNC")),
    (cache_named("FLASH_ATTN", "BHLNC"), cache_named("FLASH_ATTN", "LBNHC", block_size=32)),
    (cache_named("TRITON_MLA", "LBNHC"), cache_named("FLASHMLA", "LBNHC", block_size=64)),
]


PATHS = pytest.mark.parametrize("published", [False, True], ids=["streamed", "fetched"])
"""A load the prefill's word planned is fetched with its step's others; one a probe found, read
as a stream."""


@PATHS
@pytest.mark.parametrize(("source", "target"), CONVERSIONS, ids=lambda entry: cache_id(entry))
def test_a_prompt_moves_between_layouts_and_block_sizes_token_for_token(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]], source: dict[str, Any], target: dict[str, Any],
    published: bool,
) -> None:  # fmt: skip
    assert_landed(source, target, moved(sides, source, target, published=published), range(TOKENS))


@PATHS
def test_a_decode_that_holds_a_prefix_has_only_the_rest_written(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]], published: bool
) -> None:
    entry = cache_named("FLASH_ATTN", "LBNHC")
    result = moved(sides, entry, entry, skip=32, published=published)
    assert_landed(entry, entry, result, range(32, TOKENS))
    _, _, decode_caches, into_blocks, before = result
    prefix_slots = slots(entry, into_blocks, range(32))
    assert torch.equal(token_rows(entry, decode_caches, prefix_slots), token_rows(entry, before, prefix_slots))


# -- tensor parallelism on both sides ----------------------------------------------------------

TOTAL_HEADS = 8
"""The model of the table's TP entries: 8 KV heads, 4 a rank at TP 2, 2 at TP 4."""


def per_rank(tp: int, *, layout: str = "LBNHC", block_size: int = 16) -> dict[str, Any]:
    return cache_named("FLASH_ATTN", layout, block_size=block_size, kv_heads=TOTAL_HEADS // tp)


@PATHS
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_each_decode_rank_takes_its_heads_from_the_prefill_ranks_that_hold_them(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]], prefill_tp: int, decode_tp: int, published: bool
) -> None:
    source = per_rank(prefill_tp)
    target = per_rank(decode_tp, layout="LBHNC", block_size=32) if decode_tp == 1 else per_rank(decode_tp)
    prefills = [
        sides(source, produces=True, rank=rank, tp=prefill_tp, total_heads=TOTAL_HEADS, seed=10 + rank)
        for rank in range(prefill_tp)
    ]
    decodes = [
        sides(target, produces=False, rank=rank, tp=decode_tp, total_heads=TOTAL_HEADS, seed=20 + rank)
        for rank in range(decode_tp)
    ]
    tokens = list(range(2000, 2000 + TOKENS))
    from_blocks, into_blocks = blocks_for(source, TOKENS, 5), blocks_for(target, TOKENS, 6)
    publish([side for side, _ in prefills], tokens, from_blocks, source["block_size"], source["layers"])
    failed = load(
        [side for side, _ in decodes], endpoints_of([side for side, _ in prefills]), tokens, into_blocks,
        target["block_size"], target["layers"], published=published,
    )  # fmt: skip
    assert failed == [set()] * decode_tp
    # The model's heads side by side, as the prefill ranks hold them and as the decode ranks do.
    sent = torch.cat(
        [token_rows(source, caches, slots(source, from_blocks, range(TOKENS))) for _, caches in prefills], dim=2
    )
    landed = torch.cat(
        [token_rows(target, caches, slots(target, into_blocks, range(TOKENS))) for _, caches in decodes], dim=2
    )
    assert torch.equal(landed, sent)
    for side, _ in prefills:
        assert side._producer is None or side._producer.stats().items == 0  # every piece was taken


@PATHS
def test_a_latent_is_published_by_prefill_rank_zero_and_read_whole_by_every_decode_rank(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]], published: bool
) -> None:
    entry = cache_named("TRITON_MLA", "LBNHC")
    prefills = [sides(entry, produces=True, rank=rank, tp=2, seed=30) for rank in range(2)]  # the same latents
    assert prefills[0][0].endpoint is not None and prefills[1][0].endpoint is None
    decodes = [sides(entry, produces=False, rank=rank, tp=2, seed=40 + rank) for rank in range(2)]
    tokens = list(range(3000, 3000 + TOKENS))
    from_blocks, into_blocks = blocks_for(entry, TOKENS, 7), blocks_for(entry, TOKENS, 8)
    publish([side for side, _ in prefills], tokens, from_blocks, 16, entry["layers"])
    endpoints = endpoints_of([s for s, _ in prefills])
    failed = load([side for side, _ in decodes], endpoints, tokens, into_blocks, 16, 4, published=published)
    assert failed == [set(), set()]
    sent = token_rows(entry, prefills[0][1], slots(entry, from_blocks, range(TOKENS)))
    for _, caches in decodes:
        assert torch.equal(token_rows(entry, caches, slots(entry, into_blocks, range(TOKENS))), sent)
    assert prefills[0][0]._producer is not None and prefills[0][0]._producer.stats().items == 0


@pytest.mark.parametrize(
    ("total", "prefill_tp", "decode_tp"), [(8, 2, 1), (8, 1, 2), (8, 2, 4), (2, 4, 1), (2, 1, 4), (2, 4, 8)]
)
def test_the_pieces_of_a_decode_group_cover_every_head_once_from_publishing_ranks(
    total: int, prefill_tp: int, decode_tp: int
) -> None:
    readers = [0] * prefill_tp
    for rank in range(decode_tp):
        pieces = pieces_for(rank, decode_tp, prefill_tp, total, mla=False)
        covered = []
        for piece in pieces:
            assert publishes(piece.prefill_rank, prefill_tp, total, mla=False)
            heads = piece.heads or heads_of(piece.prefill_rank, prefill_tp, total)
            covered += range(heads.start, heads.stop)
            readers[piece.prefill_rank] += 1
        own = heads_of(rank, decode_tp, total)
        assert covered == list(range(own.start, own.stop))
    for rank in range(decode_tp):
        for piece in pieces_for(rank, decode_tp, prefill_tp, total, mla=False):
            assert piece.readers == readers[piece.prefill_rank]


# -- what is refused ---------------------------------------------------------------------------


def test_layouts_kvrt_cannot_move_are_refused_naming_what_they_are() -> None:
    entry = cache_named("FLASH_ATTN", "LBNHC")
    caches = build_cache(entry, "cpu", seed=0)
    spec = spec_of(entry)
    with pytest.raises(ConnectorConfigError, match="FP8_PER_TOKEN_HEAD KV cache keeps scales in its pages"):
        kv_cache_pools(caches, CacheSpec(**{**_fields(spec), "kv_quant_mode": "FP8_PER_TOKEN_HEAD"}))
    with pytest.raises(ConnectorConfigError, match="keys of head size 128 and values of 64"):
        kv_cache_pools(caches, CacheSpec(**{**_fields(spec), "head_size_v": 64}))
    with pytest.raises(ConnectorConfigError, match="packs these KV pages otherwise"):
        kv_cache_pools(caches, CacheSpec(**{**_fields(spec), "packed": True}))
    with pytest.raises(ConnectorConfigError, match=r"\[\*, 8, 16 \(or a divisor\), 256\]"):
        kv_cache_pools(caches, CacheSpec(**{**_fields(spec), "kv_heads": 8}))


def _fields(spec: CacheSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in CacheSpec.__slots__}  # type: ignore[attr-defined]


@PATHS
def test_a_producer_gone_fails_one_steps_loads_within_the_timeout_and_the_next_at_once(published: bool) -> None:
    import socket
    import time
    from dataclasses import replace

    from kvrt.integrations.vllm._scheduler import Load

    entry = cache_named("FLASH_ATTN", "LBNHC")
    side, _ = worker(entry, "cpu", produces=False, seed=0)
    try:
        side.settings = side._settings = replace(side.settings, connect_timeout_s=0.5)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            gone = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        load = Load("r", (gone,), list(range(40)), 0, list(range(40)), [0, 1, 2], published=published)
        started = time.monotonic()
        side.start_loads([load])
        first = side.end_step()
        took = time.monotonic() - started
        assert first.failed == {"r"} and first.lost == {gone} and took < 5
        started = time.monotonic()
        side.start_loads([replace(load, request_id="s")])
        second = side.end_step()
        assert second.failed == {"s"} and time.monotonic() - started < 0.2  # not asked again: at once
    finally:
        side.close()


def test_a_load_whose_layers_fail_the_checksums_its_streams_end_carries_fails_and_vllm_recomputes_its_blocks(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer on a GPU sends each layer of a prompt still being prefilled before its
    forward pass wrote it: the stream's end carries the layers' checksums, checked where they
    landed. A mismatch fails the load in the step that loaded it (its blocks are the step's
    load errors), though every layer was handed to vLLM already."""
    import msgspec

    from kvrt import _messages as m

    monkeypatch.setenv("KVRT_CHECKSUM", "1")  # the worker's producer reads it
    entry = cache_named("FLASH_ATTN", "LBNHC")
    decode_message = m.decode
    ends: list[m.StreamEnd] = []

    def not_what_landed(frame: bytes | memoryview) -> m.AnyMessage:
        message = decode_message(frame)
        if isinstance(message, m.StreamLayer):
            return msgspec.structs.replace(message, checksum=None)
        if isinstance(message, m.StreamEnd):
            ends.append(msgspec.structs.replace(message, layer_checksums=[0] * entry["layers"]))
            return ends[-1]
        return message

    monkeypatch.setattr(m, "decode", not_what_landed)
    prefill, _ = sides(entry, produces=True, seed=1, layers_as_computed=True)  # as on a GPU
    decode, _ = sides(entry, produces=False, seed=2)
    tokens = list(range(1000, 1000 + TOKENS))
    from_blocks, into_blocks = blocks_for(entry, TOKENS, 3), blocks_for(entry, TOKENS, 4)
    save = Save("request", tokens, slots(entry, from_blocks, range(TOKENS)))
    prefill.save_layer([save], 0)  # the prefill's forward pass is under way: its stream is open
    endpoints = tuple(endpoints_of([prefill]))
    decode.start_loads([Load("request", endpoints, tokens, 0, slots(entry, into_blocks, range(TOKENS)), into_blocks)])
    decode.wait_layer(0)
    for layer in range(1, entry["layers"]):  # the two forward passes side by side
        prefill.save_layer([save], layer)
        decode.wait_layer(layer)  # handed over as it landed: the verdict comes at the end
    prefill.end_step()
    outcome = decode.end_step()
    assert ends, "the load read the prompt as a stream"
    assert outcome.failed == {"request"} and outcome.failed_blocks == set(into_blocks)
    assert decode.take_counters().get("failed_loads") == 1


def test_a_step_that_fetches_some_loads_and_streams_others_lands_them_all(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]],
) -> None:
    from kvrt.integrations.vllm._scheduler import Load

    entry = cache_named("FLASH_ATTN", "LBNHC")
    prefill, prefill_caches = sides(entry, produces=True, seed=1)
    decode, decode_caches = sides(entry, produces=False, seed=2)
    prompts = [list(range(4000 + 100 * index, 4000 + 100 * index + TOKENS)) for index in range(4)]
    sources = [blocks_for(entry, TOKENS, 10 + index) for index in range(4)]
    for tokens, from_blocks in zip(prompts, sources, strict=True):
        publish([prefill], tokens, from_blocks, entry["block_size"], entry["layers"])
    order = random.Random(20).sample(range(entry["blocks"]), entry["blocks"])
    per_load = -(-TOKENS // entry["block_size"])
    targets = [order[index * per_load : (index + 1) * per_load] for index in range(4)]
    endpoints = tuple(endpoints_of([prefill]))
    loads = [
        Load(f"r{index}", endpoints, tokens, 0, slots(entry, into, range(TOKENS)), into, published=index % 2 == 0)
        for index, (tokens, into) in enumerate(zip(prompts, targets, strict=True))
    ]
    decode.start_loads(loads)
    for layer in range(entry["layers"]):
        decode.wait_layer(layer)
    assert decode.end_step().failed == set()
    for from_blocks, into in zip(sources, targets, strict=True):
        sent = token_rows(entry, prefill_caches, slots(entry, from_blocks, range(TOKENS)))
        assert torch.equal(token_rows(entry, decode_caches, slots(entry, into, range(TOKENS))), sent)


@pytest.mark.parametrize("as_computed", [None, True], ids=["on the host", "as computed"])
def test_a_prompt_whose_step_saved_only_some_layers_is_not_published_and_its_load_fails(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]], as_computed: bool | None
) -> None:
    # A forward pass that stopped short of the last layer leaves pages that are not all the
    # prompt's KV: nothing of it is offered, and the decode's load fails (vLLM recomputes it).
    entry = cache_named("FLASH_ATTN", "LBNHC")
    prefill, _ = sides(entry, produces=True, seed=1, layers_as_computed=as_computed)
    decode, _ = sides(entry, produces=False, seed=2)
    tokens = list(range(9000, 9000 + TOKENS))
    save = Save("request", tokens, slots(entry, blocks_for(entry, TOKENS, 5), range(TOKENS)))
    for layer in range(entry["layers"] - 1):
        prefill.save_layer([save], layer)
    prefill.end_step()
    for published in (True, False):
        into = blocks_for(entry, TOKENS, 6)
        failed = load([decode], endpoints_of([prefill]), tokens, into, entry["block_size"], entry["layers"],
                      published=published)  # fmt: skip
        assert failed == [{"request"}]


@pytest.mark.parametrize("as_computed", [None, True], ids=["on the host", "as computed"])
def test_a_host_prefill_hands_its_steps_layers_to_kvrt_once_at_the_steps_end(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]], as_computed: bool | None
) -> None:
    # The model runner's thread hands work to kvrt's loop thread once a step on the host (each
    # hand-off may cost it a wait for the GIL), once a layer and at the end where a layer's
    # gather overlaps the next layer's pass (a GPU's default); either way the prompt is published.
    entry = cache_named("FLASH_ATTN", "LBNHC")
    prefill, prefill_caches = sides(entry, produces=True, seed=1, layers_as_computed=as_computed)
    decode, decode_caches = sides(entry, produces=False, seed=2)
    posted: list[str] = []
    post = prefill._loop.post

    def counted(function: Any, what: str) -> Any:
        posted.append(what)
        return post(function, what)

    prefill._loop.post = counted  # type: ignore[method-assign]
    tokens = list(range(7000, 7000 + TOKENS))
    from_blocks, into = blocks_for(entry, TOKENS, 5), blocks_for(entry, TOKENS, 6)
    publish([prefill], tokens, from_blocks, entry["block_size"], entry["layers"])
    per_layer = [] if as_computed is None else ["save_kv_layer"] * entry["layers"]
    assert posted == [*per_layer, "wait_for_save"]
    failed = load([decode], endpoints_of([prefill]), tokens, into, entry["block_size"], entry["layers"])
    assert failed == [set()]
    sent = token_rows(entry, prefill_caches, slots(entry, from_blocks, range(TOKENS)))
    assert torch.equal(token_rows(entry, decode_caches, slots(entry, into, range(TOKENS))), sent)


def test_a_host_prefill_gathers_each_finished_prompt_once_straight_into_the_item_it_offers(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # At the step's end on the host every layer of a finished prompt is in the pages: it is
    # published whole, one job of kvrt's gather thread a prompt (every layer gathered straight
    # into the item), not a gather of its layers and then a second copy into the whole item.
    import concurrent.futures

    entry = cache_named("FLASH_ATTN", "LBNHC")
    prefill, prefill_caches = sides(entry, produces=True, seed=1)
    decode, decode_caches = sides(entry, produces=False, seed=2)
    prefill.save_layer([], 0)  # a step before: kvrt's threads are up
    prefill.end_step()
    jobs: list[str] = []
    submit = concurrent.futures.ThreadPoolExecutor.submit

    def counted(self: concurrent.futures.ThreadPoolExecutor, *args: Any, **kwargs: Any) -> Any:
        jobs.append(self._thread_name_prefix)
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", counted)
    prompts = [list(range(start, start + TOKENS)) for start in (11000, 12000)]
    blocks = [blocks_for(entry, TOKENS, seed) for seed in (7, 8)]
    if set(blocks[0]) & set(blocks[1]):
        blocks[1] = [block for block in range(entry["blocks"]) if block not in blocks[0]][: len(blocks[1])]
    saves = [
        Save(f"request-{index}", tokens, slots(entry, from_blocks, range(TOKENS)))
        for index, (tokens, from_blocks) in enumerate(zip(prompts, blocks, strict=True))
    ]
    for layer in range(entry["layers"]):
        prefill.save_layer(saves, layer)
    prefill.end_step()
    monkeypatch.undo()
    assert [job for job in jobs if job.startswith("kvrt-gather")] == ["kvrt-gather"] * len(saves)
    for tokens, from_blocks in zip(prompts, blocks, strict=True):
        into = blocks_for(entry, TOKENS, 9)
        failed = load([decode], endpoints_of([prefill]), tokens, into, entry["block_size"], entry["layers"],
                      published=True)  # fmt: skip
        assert failed == [set()]
        sent = token_rows(entry, prefill_caches, slots(entry, from_blocks, range(TOKENS)))
        assert torch.equal(token_rows(entry, decode_caches, slots(entry, into, range(TOKENS))), sent)


def test_a_host_prefill_whose_buffer_is_full_refuses_the_prompt_and_its_load_fails_while_the_others_land(
    sides: Callable[..., tuple[WorkerSide, list[torch.Tensor]]],
) -> None:
    # A prefill does not wait for room at a step's end (vLLM's model runner would wait with
    # it): a prompt the buffer has no room for is not published, counted, and the decode's
    # load of it fails (vLLM recomputes it); the prompt already buffered still loads.
    entry = cache_named("FLASH_ATTN", "LBNHC")
    prefill, prefill_caches = sides(entry, produces=True, seed=1, buffer_bytes=1)
    decode, decode_caches = sides(entry, produces=False, seed=2)
    kept, refused = list(range(13000, 13000 + TOKENS)), list(range(14000, 14000 + TOKENS))
    kept_blocks = blocks_for(entry, TOKENS, 10)
    refused_blocks = [block for block in range(entry["blocks"]) if block not in kept_blocks][: len(kept_blocks)]
    publish([prefill], kept, kept_blocks, entry["block_size"], entry["layers"])  # the buffer is over its bytes now
    publish([prefill], refused, refused_blocks, entry["block_size"], entry["layers"])
    counters = prefill.take_counters()
    assert (counters["saves"], counters["refused_saves"]) == (1, 1)
    for tokens, from_blocks, lands in ((refused, refused_blocks, False), (kept, kept_blocks, True)):
        into = blocks_for(entry, TOKENS, 11)
        failed = load([decode], endpoints_of([prefill]), tokens, into, entry["block_size"], entry["layers"],
                      published=True)  # fmt: skip
        assert failed == [set() if lands else {"request"}]
        if lands:
            sent = token_rows(entry, prefill_caches, slots(entry, from_blocks, range(TOKENS)))
            assert torch.equal(token_rows(entry, decode_caches, slots(entry, into, range(TOKENS))), sent)
