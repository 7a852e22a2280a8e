"""The paged-KV gather and scatter kernels against their torch references, bit for bit.

On CPU these run under TRITON_INTERPRET=1 (`make test` sets it); outputs are poisoned first
so that an element the kernel forgets to write shows up.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt._errors import InvalidInputError
from kvrt.kernels.paged_kv import (
    Layout,
    PoolTable,
    Tuning,
    check_indices,
    gather,
    gather_into,
    gather_layer_into_any,
    gather_reference,
    prepare_gather_into,
    prepare_gather_layer,
    scatter,
    scatter_from,
    scatter_layer_from,
    scatter_layer_from_any,
    scatter_reference,
)
from tests._checks import same_bits
from tests.conftest import KERNEL_DEVICE, TRITON_KERNEL_MARKS

pytestmark = TRITON_KERNEL_MARKS
DEVICE = KERNEL_DEVICE
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]  # uint8: fp8 stored as bytes
POISON = 0xA5
TRITON_LAYOUTS = [layout for layout in Layout if layout is not Layout.BLOCK_HEAD_MAJOR]
"""The layouts the Triton kernels move (head-major blocks, vLLM's CPU layout, have no token
stride: the torch references move them, tests/test_pull.py)."""


def random_pool(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(shape).to(DEVICE)


def pool_shape(layout: Layout, slots: int, heads: int, head_dim: int, block_size: int) -> tuple[int, ...]:
    if layout is Layout.TOKEN_MAJOR:
        return (slots, 2 * heads, head_dim)
    if layout is Layout.BLOCK:
        return (2, slots // block_size, block_size, heads, head_dim)
    return (slots, head_dim)


VLLM_ORDERS = {
    "LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4), "BHLNC": (1, 2, 0, 3, 4),
}  # fmt: skip
"""vLLM's KV cache layouts (`vllm/v1/kv_cache_layout.py`): the physical order of the logical
axes [L, B, H, N, C] (layers, blocks, heads, tokens of a block, a token's K | V content)."""


def vllm_layer_views(
    raw: torch.Tensor, order: tuple[int, ...], layers: int, blocks: int, heads: int, block_size: int, content: int
) -> list[torch.Tensor]:
    """Per layer, the [blocks, heads, block_size, content] view vLLM makes of one allocation
    laid out in `order` (`create_kv_cache_views`): strided, and with the cross-layer orders
    (B before L) the layers of a block side by side."""
    logical = (layers, blocks, heads, block_size, content)
    physical = raw.view([logical[axis] for axis in order])
    whole = physical.permute([order.index(axis) for axis in range(5)])  # back to [L, B, H, N, C]
    return [whole[layer] for layer in range(layers)]


@st.composite
def cases(draw: st.DrawFn) -> dict[str, object]:
    layout = draw(st.sampled_from(TRITON_LAYOUTS))
    # vLLM >= 0.32's pools (and MLA in blocks) in one of its physical orders; None: a flat MLA pool
    blocked = layout is Layout.BHNC or (layout is Layout.MLA and draw(st.booleans()))
    order = draw(st.sampled_from(sorted(VLLM_ORDERS))) if blocked else None
    heads = 1 if layout is Layout.MLA else draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([2, 4, 8, 12]))
    block_size = draw(st.sampled_from([2, 4]))
    slots = block_size * draw(st.integers(2, 6))
    replicas = draw(st.integers(1, 4))
    copies = draw(st.integers(1, 2)) if layout is Layout.MLA else 1
    layers = draw(st.integers(1, 3))
    tokens = draw(st.integers(0, min(slots, 10)))
    first = draw(st.integers(0, heads - 1))
    end = draw(st.integers(first + 1, heads))
    return {
        "layout": layout, "heads": heads, "head_dim": head_dim, "block_size": block_size, "slots": slots,
        "replicas": replicas, "copies": copies, "layers": layers, "tokens": tokens,
        "head_range": (first, end), "dtype": draw(st.sampled_from(DTYPES)), "seed": draw(st.integers(0, 2**16)),
        "order": order,
        # short steps: a row moved in several steps, the last one partial
        "tuning": Tuning(block_words=draw(st.sampled_from([1, 2, 4, 2048]))),
    }  # fmt: skip


def layer_pools(case: dict[str, object], generator: torch.Generator) -> list[torch.Tensor]:
    """One replica's copy of the case's pools: one per layer."""
    layout: Layout = case["layout"]  # type: ignore[assignment]
    layers, slots, heads, dim, block_size = (
        int(case[name]) for name in ("layers", "slots", "heads", "head_dim", "block_size")  # type: ignore[call-overload]
    )
    order = case.get("order")
    if order is None:
        shape = pool_shape(layout, slots, heads, dim, block_size)
        return [random_pool(shape, case["dtype"], generator) for _ in range(layers)]  # type: ignore[arg-type]
    content = dim if layout is Layout.MLA else 2 * dim
    raw = random_pool((layers * slots * heads * content,), case["dtype"], generator)  # type: ignore[arg-type]
    return vllm_layer_views(raw, VLLM_ORDERS[order], layers, slots // block_size, heads, block_size, content)  # type: ignore[index]


def build(case: dict[str, object]) -> tuple[PoolTable, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(case["seed"])  # type: ignore[arg-type]
    layout: Layout = case["layout"]  # type: ignore[assignment]
    pools = [
        [layer_pools(case, generator) for _ in range(case["copies"])]  # type: ignore[call-overload]
        for _ in range(case["replicas"])  # type: ignore[call-overload]
    ]
    table = PoolTable(pools, layout)
    tokens: int = case["tokens"]  # type: ignore[assignment]
    replica = torch.randint(0, table.replicas, (tokens,), generator=generator)
    slots = torch.empty(tokens, dtype=torch.int64)
    for r in range(table.replicas):  # distinct slots within a replica, so scatter order cannot matter
        chosen = (replica == r).nonzero().flatten()
        slots[chosen] = torch.randperm(table.geometry.slots, generator=generator)[: len(chosen)]
    return table, replica.to(DEVICE), slots.to(DEVICE)


def poisoned_key_and_value(table: PoolTable, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Separate K and V tensors [layers, tokens, heads, head_dim] for `table`, every byte
    poisoned: an element a gather forgets to write shows up."""
    g = table.geometry
    shape = (table.layers, tokens, g.heads, g.head_dim)
    poison = torch.full((torch.Size(shape).numel() * table.dtype.itemsize,), POISON, dtype=torch.uint8, device=DEVICE)
    key = poison.view(table.dtype).view(shape)
    return key, key.clone()


def random_key_and_value(table: PoolTable, tokens: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Separate K and V tensors [layers, tokens, heads, head_dim] for `table`, of random bytes."""
    g = table.geometry
    generator = torch.Generator().manual_seed(seed)
    shape = (table.layers, tokens, g.heads, g.head_dim)
    return random_pool(shape, table.dtype, generator), random_pool(shape, table.dtype, generator)


def gathered_as_the_reference(
    table: PoolTable, replica: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> bool:
    """The first len(slots) tokens of `key` (and `value`, unless MLA) hold what the torch
    reference gathers."""
    tokens = slots.numel()
    expected = gather_reference(table, replica, slots)
    if not same_bits(key[:, :tokens], expected[:, :, 0]):
        return False
    return table.geometry.kv == 1 or same_bits(value[:, :tokens], expected[:, :, 1])


def same_pools(table: PoolTable, other: PoolTable) -> bool:
    """Every pool of every replica, copy and layer holds the same bits in both tables."""
    return all(
        same_bits(got, want)
        for got_copies, want_copies in zip(table.pools, other.pools, strict=True)
        for got_layers, want_layers in zip(got_copies, want_copies, strict=True)
        for got, want in zip(got_layers, want_layers, strict=True)
    )


@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_gather_equals_its_reference_and_writes_every_element(case: dict[str, object]) -> None:
    table, replica, slots = build(case)
    heads = case["head_range"]
    shape = table.staging_shape(slots.numel(), heads)  # type: ignore[arg-type]
    out = torch.full((torch.Size(shape).numel() * table.dtype.itemsize,), POISON, dtype=torch.uint8, device=DEVICE)
    result = gather(table, replica, slots, heads=heads, out=out.view(table.dtype).view(shape), tuning=case["tuning"])  # type: ignore[arg-type]
    assert same_bits(result, gather_reference(table, replica, slots, heads=heads))  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_scatter_equals_its_reference_and_touches_nothing_else(case: dict[str, object]) -> None:
    table, replica, slots = build(case)
    expected_table, _, _ = build(case)  # the same pools, built again from the same random seed
    heads = case["head_range"]
    shape = table.staging_shape(slots.numel(), heads)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(1 + case["seed"])  # type: ignore[operator]
    staging = random_pool(shape, table.dtype, generator)
    scatter(table, staging, replica, slots, heads=heads, tuning=case["tuning"])  # type: ignore[arg-type]
    scatter_reference(expected_table, staging, replica, slots, heads=heads)  # type: ignore[arg-type]
    assert same_pools(table, expected_table)


@pytest.mark.parametrize("replicas", [1, 4], ids=["dp1", "dp4"])
def test_a_request_spread_over_replicas_lands_in_one_replica_bit_for_bit(replicas: int) -> None:
    generator = torch.Generator().manual_seed(replicas)
    shape = (32, 2 * 2, 8)
    source_pools = [[[random_pool(shape, torch.bfloat16, generator) for _ in range(2)]] for _ in range(replicas)]
    target_pools = [[[torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]] for _ in range(3)]
    source = PoolTable(source_pools, Layout.TOKEN_MAJOR)
    target = PoolTable(target_pools, Layout.TOKEN_MAJOR)
    replica = (torch.arange(12) % replicas).to(DEVICE)
    slots = torch.randperm(32, generator=generator)[:12].to(DEVICE)
    staging = gather(source, replica, slots)
    into = torch.full((12,), 2, dtype=torch.int64, device=DEVICE)
    into_slots = torch.arange(20, 32, dtype=torch.int64, device=DEVICE)
    scatter(target, staging, into, into_slots)
    for layer in range(2):
        for token in range(12):
            got = target.pools[2][0][layer][20 + token]
            want = source.pools[int(replica[token])][0][layer][int(slots[token])]
            assert same_bits(got, want)
    assert not target.pools[0][0][0].any() and not target.pools[1][0][0].any()


@pytest.fixture
def small_table() -> PoolTable:
    return PoolTable(
        [[[torch.zeros(8, 4, 2, device=DEVICE)]], [[torch.zeros(8, 4, 2, device=DEVICE)]]], Layout.TOKEN_MAJOR
    )


@pytest.mark.parametrize(
    ("replica", "slots", "message"),
    [
        ([0, 1], [3, 8], "slot index 8 is out of range"),
        ([0, 2], [3, 4], "replica index 2 is out of range"),
        ([0, -1], [3, 4], "replica index -1 is out of range"),
        ([0], [3, 4], "1 replica indexes for 2 slots"),
    ],
)
@pytest.mark.parametrize("where", [DEVICE, "cpu"], ids=["on-the-pools-device", "on-the-host"])
def test_indexes_out_of_range_are_refused_before_launch(
    small_table: PoolTable, replica: list[int], slots: list[int], message: str, where: str
) -> None:
    replica_tensor = torch.tensor(replica, dtype=torch.int64, device=where)
    slot_tensor = torch.tensor(slots, dtype=torch.int64, device=where)
    with pytest.raises(InvalidInputError, match=message):
        gather(small_table, replica_tensor, slot_tensor)


@pytest.mark.skipif(DEVICE == "cpu", reason="on the CPU the host is the pools' device")
def test_a_kernel_refuses_indexes_left_on_the_host(small_table: PoolTable) -> None:
    index = torch.zeros(1, dtype=torch.int64)
    check_indices(small_table, index, index)  # in range: checked on the host
    with pytest.raises(InvalidInputError, match="reads its replica and slot indexes on cuda"):
        gather(small_table, index, index)


def test_a_kernel_refuses_head_major_block_pools_which_the_torch_references_move() -> None:
    table = PoolTable([[[torch.zeros((4, 2, 2, 4, 8))]]], Layout.BLOCK_HEAD_MAJOR)  # CPU pools only
    index = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(InvalidInputError, match="head-major block pools"):
        gather(table, index, index)


def test_a_head_range_outside_the_pools_is_refused(small_table: PoolTable) -> None:
    index = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(InvalidInputError, match=r"head range \[1, 3\)"):
        gather(small_table, index, index, heads=(1, 3))


def test_pools_that_differ_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="every pool must match"):
        PoolTable([[[torch.zeros(8, 4, 2)]], [[torch.zeros(8, 4, 3)]]], Layout.TOKEN_MAJOR)
    with pytest.raises(InvalidInputError, match="token-major pool is"):
        PoolTable([[[torch.zeros(8, 3, 2)]]], Layout.TOKEN_MAJOR)


@settings(max_examples=25, deadline=None)
@given(case=cases(), extra=st.integers(0, 3), cut=st.integers(0, 3))
def test_gather_into_separate_key_and_value_equals_the_reference(case: dict[str, object], extra: int, cut: int) -> None:
    table, replica, slots = build(case)
    tokens = slots.numel()
    # Longer than needed (only the first `tokens` move), and with `cut`, views of longer
    # tensors cut along their tokens (an item a TP group agreed to shorten): what lies past
    # the cut is never written.
    full_key, full_value = poisoned_key_and_value(table, tokens + extra + cut)
    key, value = full_key[:, : tokens + extra], full_value[:, : tokens + extra]
    gather_into(table, replica, slots, key, value)
    assert gathered_as_the_reference(table, replica, slots, key, value)
    past_the_cut = [full_key[:, tokens + extra :], full_value[:, tokens + extra :]]
    assert all(bool((part.contiguous().view(torch.uint8) == POISON).all()) for part in past_the_cut)


@settings(max_examples=25, deadline=None)
@given(case=cases(), extra=st.integers(0, 3), cut=st.integers(0, 3))
def test_scatter_from_separate_key_and_value_equals_the_reference(
    case: dict[str, object], extra: int, cut: int
) -> None:
    table, replica, slots = build(case)
    expected_table, _, _ = build(case)
    tokens = slots.numel()
    g = table.geometry
    full_key, full_value = random_key_and_value(table, tokens + extra + cut, seed=7 + case["seed"])  # type: ignore[operator]
    key, value = full_key[:, : tokens + extra], full_value[:, : tokens + extra]  # with `cut`: a shortened item's
    scatter_from(table, key, value, replica, slots)
    parts = [key[:, :tokens]] if g.kv == 1 else [key[:, :tokens], value[:, :tokens]]
    scatter_reference(expected_table, torch.stack(parts, dim=2), replica, slots)
    assert same_pools(table, expected_table)


def layer_chunks(layers: int, cut: int) -> list[tuple[int, int]]:
    """[0, layers) cut at `cut` (clamped): one or two chunks, as a pipelined transfer moves them."""
    cut = min(cut, layers)
    return [(first, end) for first, end in ((0, cut), (cut, layers)) if end > first]


@settings(max_examples=20, deadline=None)
@given(case=cases(), cut=st.integers(0, 3))
def test_gathering_layer_chunks_one_by_one_equals_gathering_them_all(case: dict[str, object], cut: int) -> None:
    table, replica, slots = build(case)
    tokens = slots.numel()
    key, value = poisoned_key_and_value(table, tokens)
    check_indices(table, replica, slots)
    for chunk in layer_chunks(table.layers, cut):
        gather_into(table, replica, slots, key, value, layers=chunk, check=False)
    assert gathered_as_the_reference(table, replica, slots, key, value)


@settings(max_examples=20, deadline=None)
@given(case=cases(), cut=st.integers(0, 3))
def test_scattering_layer_chunks_one_by_one_equals_scattering_them_all(case: dict[str, object], cut: int) -> None:
    table, replica, slots = build(case)
    expected_table, _, _ = build(case)
    key, value = random_key_and_value(table, slots.numel(), seed=11 + case["seed"])  # type: ignore[operator]
    for chunk in layer_chunks(table.layers, cut):
        scatter_from(table, key, value, replica, slots, layers=chunk)
    scatter_from(expected_table, key, value, replica, slots)
    assert same_pools(table, expected_table)


def test_a_layer_range_outside_the_pools_is_refused(small_table: PoolTable) -> None:
    index = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    key = torch.zeros(1, 1, 2, 2, device=DEVICE)
    with pytest.raises(InvalidInputError, match=r"layer range \[0, 2\)"):
        gather_into(small_table, index, index, key, key, layers=(0, 2))


@settings(max_examples=20, deadline=None)
@given(case=cases(), cut=st.integers(0, 3))
def test_gathering_keys_and_values_apart_chunk_by_chunk_equals_gathering_them_together(
    case: dict[str, object], cut: int
) -> None:
    table, replica, slots = build(case)
    g = table.geometry
    key, value = poisoned_key_and_value(table, slots.numel())
    parts = ["key", "value"] if g.kv == 2 else ["key"]
    whole = {part: prepare_gather_into(table, replica, slots, key, value, part=part) for part in parts}  # type: ignore[arg-type]
    for first, end in layer_chunks(table.layers, cut):
        for part in reversed(parts):  # values first: neither launch may touch the other's rows
            whole[part].for_layers(first, end).launch()
    assert gathered_as_the_reference(table, replica, slots, key, value)


@settings(max_examples=20, deadline=None)
@given(case=cases(), cut=st.integers(0, 3))
def test_scattering_keys_and_values_apart_chunk_by_chunk_equals_scattering_them_together(
    case: dict[str, object], cut: int
) -> None:
    table, replica, slots = build(case)
    expected_table, _, _ = build(case)
    g = table.geometry
    key, value = random_key_and_value(table, slots.numel(), seed=13 + case["seed"])  # type: ignore[operator]
    for chunk in layer_chunks(table.layers, cut):
        scatter_from(table, key, value, replica, slots, layers=chunk, part="key")
        if g.kv == 2:
            scatter_from(table, key, value, replica, slots, layers=chunk, part="value")
    scatter_from(expected_table, key, value, replica, slots)
    assert same_pools(table, expected_table)


def test_a_prepared_gather_refuses_layers_outside_its_own(small_table: PoolTable) -> None:
    index = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    key = torch.zeros(1, 1, 2, 2, device=DEVICE)
    prepared = prepare_gather_into(small_table, index, index, key, key, layers=(0, 1))
    with pytest.raises(InvalidInputError, match=r"layer range \[0, 2\)"):
        prepared.for_layers(0, 2)


def test_values_of_an_mla_pool_are_refused_and_an_unknown_part_too() -> None:
    table = PoolTable([[[torch.zeros(4, 2, device=DEVICE)]]], Layout.MLA)
    index = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    key = torch.zeros(1, 1, 1, 2, device=DEVICE)
    with pytest.raises(InvalidInputError, match="MLA pool holds no values"):
        gather_into(table, index, index, key, key, part="value")
    with pytest.raises(InvalidInputError, match="part must be"):
        scatter_from(table, key, key, index, index, part="both")  # type: ignore[arg-type]


def test_a_prepared_gather_knows_whether_its_kernel_was_launched_and_its_chunks_share_it() -> None:
    # One warp a program: a specialization no other test launches, so it starts uncompiled.
    pools = [[[torch.ones(4, 2, 3, dtype=torch.float64, device=DEVICE) for _ in range(2)]]]
    table = PoolTable(pools, Layout.TOKEN_MAJOR)
    index = torch.arange(2, dtype=torch.int64, device=DEVICE)
    key = torch.zeros(2, 2, 1, 3, dtype=torch.float64, device=DEVICE)
    value = key.clone()
    prepared = prepare_gather_into(table, index * 0, index, key, value, tuning=Tuning(warps=1))
    first = prepared.for_layers(0, 1)
    assert not prepared.compiled and not first.compiled
    first.launch()
    assert prepared.compiled and prepared.for_layers(1, 2).compiled
    assert torch.equal(key[0], torch.ones(2, 1, 3, dtype=torch.float64, device=DEVICE))
    assert torch.equal(key[1], torch.zeros(2, 1, 3, dtype=torch.float64, device=DEVICE))  # only its layer


# -- one layer at a time (streams) ------------------------------------------------------------


def one_layer(table: PoolTable, tokens: int, *, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V [tokens, heads, head_dim] for `table`: random bytes (a seed), else
    every byte poisoned."""
    g = table.geometry
    shape = (tokens, g.heads, g.head_dim)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        return random_pool(shape, table.dtype, generator), random_pool(shape, table.dtype, generator)
    poison = torch.full((torch.Size(shape).numel() * table.dtype.itemsize,), POISON, dtype=torch.uint8, device=DEVICE)
    key = poison.view(table.dtype).view(shape)
    return key, key.clone()


def layer_as_the_reference(
    table: PoolTable, replica: torch.Tensor, slots: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor
) -> bool:
    """The first len(slots) rows of `key` (and `value`, unless MLA) hold layer `layer` of what
    the whole-request reference gathers."""
    tokens = slots.numel()
    expected = gather_reference(table, replica, slots)[layer]
    if not same_bits(key[:tokens], expected[:, 0]):
        return False
    return table.geometry.kv == 1 or same_bits(value[:tokens], expected[:, 1])


def scattered_as_the_reference(
    table: PoolTable, expected: PoolTable, replica: torch.Tensor, slots: torch.Tensor, layer: int,
    key: torch.Tensor, value: torch.Tensor,
) -> bool:  # fmt: skip
    """`table` (one layer scattered into it) equals `expected` after the whole-request reference
    wrote the same rows into a table of that layer's pools alone (every copy of it)."""
    tokens = slots.numel()
    that_layer = PoolTable([[[layers[layer]] for layers in copies] for copies in expected.pools], expected.layout)
    parts = [key[:tokens], value[:tokens]][: expected.geometry.kv]
    scatter_reference(that_layer, torch.stack(parts, dim=1).unsqueeze(0), replica, slots)
    return same_pools(table, expected)


@settings(max_examples=25, deadline=None)
@given(case=cases(), extra=st.integers(0, 3), pick=st.integers(0, 2))
def test_gathering_one_layer_equals_that_layer_of_the_reference(case: dict[str, object], extra: int, pick: int) -> None:
    table, replica, slots = build(case)
    layer = pick % table.layers
    key, value = one_layer(table, slots.numel() + extra)  # longer than needed: only the first `tokens` move
    prepare_gather_layer(table, replica, slots, layer, key, value).launch()
    assert layer_as_the_reference(table, replica, slots, layer, key, value)


@settings(max_examples=25, deadline=None)
@given(case=cases(), extra=st.integers(0, 3), pick=st.integers(0, 2))
def test_scattering_one_layer_writes_that_layer_and_nothing_else(
    case: dict[str, object], extra: int, pick: int
) -> None:
    table, replica, slots = build(case)
    expected, _, _ = build(case)
    layer = pick % table.layers
    key, value = one_layer(table, slots.numel() + extra, seed=3 + case["seed"])  # type: ignore[operator]
    scatter_layer_from(table, key, value, replica, slots, layer)
    assert scattered_as_the_reference(table, expected, replica, slots, layer, key, value)


@settings(max_examples=15, deadline=None)
@given(case=cases(), pick=st.integers(0, 2))
def test_the_per_layer_paths_a_cpu_host_takes_equal_the_whole_request_references(
    case: dict[str, object], pick: int
) -> None:
    table, replica, slots = build(case)
    expected, _, _ = build(case)
    table, expected = on_the_host(table), on_the_host(expected)
    replica, slots, layer = replica.cpu(), slots.cpu(), pick % table.layers
    gathered_key, gathered_value = (part.cpu() for part in one_layer(table, slots.numel()))
    gather_layer_into_any(table, replica, slots, layer, gathered_key, gathered_value)
    assert layer_as_the_reference(table, replica, slots, layer, gathered_key, gathered_value)
    key, value = one_layer(table, slots.numel(), seed=5 + case["seed"])  # type: ignore[operator]
    scatter_layer_from_any(table, key.cpu(), value.cpu(), replica, slots, layer)
    assert scattered_as_the_reference(table, expected, replica, slots, layer, key.cpu(), value.cpu())


def on_the_host(table: PoolTable) -> PoolTable:
    return PoolTable([[[pool.cpu() for pool in layers] for layers in copies] for copies in table.pools], table.layout)


def test_a_layer_outside_the_pools_or_a_layer_of_the_wrong_shape_is_refused(small_table: PoolTable) -> None:
    index = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    key = torch.zeros(1, 2, 2, device=DEVICE)
    with pytest.raises(InvalidInputError, match="layer 1 is outside the pools' 1 layers"):
        prepare_gather_layer(small_table, index, index, 1, key, key)
    with pytest.raises(InvalidInputError, match=r"key must be a contiguous torch.float32 tensor \[>= 1, 2, 2\]"):
        scatter_layer_from(small_table, key.view(1, 4, 1), key, index, index, 0)


# -- vLLM's own layouts (>= 0.32): [blocks, heads, block_size, K | V] in any physical order ----


@pytest.mark.parametrize("order", sorted(VLLM_ORDERS))
@pytest.mark.parametrize("layout", [Layout.BHNC, Layout.MLA], ids=lambda layout: layout.value)
def test_each_of_vllms_physical_orders_moves_as_its_reference(order: str, layout: Layout) -> None:
    mla = layout is Layout.MLA
    case: dict[str, object] = {
        "layout": layout, "heads": 1 if mla else 4, "head_dim": 8, "block_size": 4, "slots": 24, "replicas": 2,
        "copies": 1, "layers": 3, "tokens": 10, "head_range": (0, 1) if mla else (1, 3), "dtype": torch.bfloat16,
        "seed": 7, "tuning": Tuning(), "order": order,
    }  # fmt: skip
    table, replica, slots = build(case)
    assert layout is Layout.MLA or order == "LBHNC" or not table.pools[0][0][0].is_contiguous()
    key, value = poisoned_key_and_value(table, slots.numel())
    gather_into(table, replica, slots, key, value)
    assert gathered_as_the_reference(table, replica, slots, key, value)
    heads = case["head_range"]
    staging = gather(table, replica, slots, heads=heads)  # type: ignore[arg-type]
    assert same_bits(staging, gather_reference(table, replica, slots, heads=heads))  # type: ignore[arg-type]
    expected, _, _ = build(case)
    scatter(table, staging, replica, slots, heads=heads)  # type: ignore[arg-type]
    scatter_reference(expected, staging, replica, slots, heads=heads)  # type: ignore[arg-type]
    assert same_pools(table, expected)


def test_a_request_moves_between_vllm_layouts_and_block_sizes_token_for_token() -> None:
    # Prefill in NHD blocks of 4 tokens, decode in HND blocks of 8: the same K and V per token.
    source_case: dict[str, object] = {
        "layout": Layout.BHNC, "heads": 2, "head_dim": 8, "block_size": 4, "slots": 32, "replicas": 1, "copies": 1,
        "layers": 2, "tokens": 0, "dtype": torch.float16, "seed": 1, "order": "LBNHC",
    }  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    source = PoolTable([[layer_pools(source_case, generator)]], Layout.BHNC)
    target_case = {**source_case, "block_size": 8, "order": "LBHNC", "seed": 2}
    target = PoolTable([[layer_pools(target_case, generator)]], Layout.BHNC)
    tokens = 13
    from_slots = torch.randperm(32, generator=generator)[:tokens].to(DEVICE)
    into_slots = torch.randperm(32, generator=generator)[:tokens].to(DEVICE)
    zeros = torch.zeros(tokens, dtype=torch.int64, device=DEVICE)
    staging = gather(source, zeros, from_slots)
    scatter(target, staging, zeros, into_slots)
    for layer in range(2):
        for token in range(tokens):
            src, dst = int(from_slots[token]), int(into_slots[token])
            sent = source.pools[0][0][layer][src // 4, :, src % 4]  # [heads, K | V]
            landed = target.pools[0][0][layer][dst // 8, :, dst % 8]
            assert same_bits(landed, sent)
