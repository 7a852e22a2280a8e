"""The fused pool-to-pool kernel against its torch reference, bit for bit: every layer of a
request from one node's pools (dp replicas, any layout) into another's chosen replica and
slots, touching nothing else. On CPU under TRITON_INTERPRET=1, as every kernel."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt._errors import InvalidInputError
from kvrt.kernels.paged_kv import Layout, PoolTable, Tuning
from kvrt.kernels.pool_to_pool import move_between, move_between_reference
from tests._checks import same_bits
from tests.conftest import TRITON_KERNEL_MARKS
from tests.test_kernels import DEVICE, DTYPES, VLLM_ORDERS, layer_pools, random_pool, same_pools

pytestmark = TRITON_KERNEL_MARKS


@st.composite
def pairs(draw: st.DrawFn) -> dict[str, object]:
    """A source and a destination that hold the same rows, laid out and indexed differently."""
    mla = draw(st.booleans())
    layouts = [Layout.MLA] if mla else [Layout.TOKEN_MAJOR, Layout.BLOCK, Layout.BHNC]
    width = 1 if mla else draw(st.integers(1, 3))

    def side() -> dict[str, object]:
        heads = width if mla else draw(st.integers(width, 4))
        first = 0 if mla else draw(st.integers(0, heads - width))
        block_size = draw(st.sampled_from([2, 4]))
        layout = draw(st.sampled_from(layouts))
        blocked = layout is Layout.BHNC or (layout is Layout.MLA and draw(st.booleans()))
        return {
            "layout": layout, "heads": heads, "head_range": (first, first + width),
            "block_size": block_size, "slots": block_size * draw(st.integers(3, 6)),
            "replicas": draw(st.integers(1, 4)), "copies": draw(st.integers(1, 2)) if mla else 1,
            "order": draw(st.sampled_from(sorted(VLLM_ORDERS))) if blocked else None,
        }  # fmt: skip

    src, dst = side(), side()
    tokens = draw(st.integers(0, min(src["slots"], dst["slots"], 10)))  # type: ignore[call-overload]
    return {
        "src": src, "dst": dst, "tokens": tokens, "layers": draw(st.integers(1, 3)),
        "head_dim": draw(st.sampled_from([2, 4, 8, 12])), "dtype": draw(st.sampled_from(DTYPES)),
        "seed": draw(st.integers(0, 2**16)), "tuning": Tuning(block_words=draw(st.sampled_from([1, 2, 4, 2048]))),
    }  # fmt: skip


def table(case: dict[str, object], which: str, generator: torch.Generator) -> PoolTable:
    side: dict[str, object] = case[which]  # type: ignore[assignment]
    layers = {**side, "head_dim": case["head_dim"], "dtype": case["dtype"], "layers": case["layers"]}
    pools = [
        [layer_pools(layers, generator) for _ in range(side["copies"])]  # type: ignore[call-overload]
        for _ in range(side["replicas"])  # type: ignore[call-overload]
    ]
    return PoolTable(pools, side["layout"])  # type: ignore[arg-type]


def indexes(table: PoolTable, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random replicas, and slots distinct within each replica (so write order cannot matter)."""
    replica = torch.randint(0, table.replicas, (tokens,), generator=generator)
    slots = torch.empty(tokens, dtype=torch.int64)
    for r in range(table.replicas):
        chosen = (replica == r).nonzero().flatten()
        slots[chosen] = torch.randperm(table.geometry.slots, generator=generator)[: len(chosen)]
    return replica.to(DEVICE), slots.to(DEVICE)


def build(
    case: dict[str, object],
) -> tuple[PoolTable, torch.Tensor, torch.Tensor, PoolTable, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(case["seed"])  # type: ignore[arg-type]
    src, dst = table(case, "src", generator), table(case, "dst", generator)
    tokens: int = case["tokens"]  # type: ignore[assignment]
    return src, *indexes(src, tokens, generator), dst, *indexes(dst, tokens, generator)


def distinct_slots(table: PoolTable, tokens: int) -> torch.Tensor:
    """Slots of one replica for `tokens` tokens, none twice."""
    return torch.randperm(table.geometry.slots, generator=torch.Generator().manual_seed(tokens))[:tokens].to(DEVICE)


@settings(max_examples=60, deadline=None)
@given(case=pairs())
def test_a_move_between_pools_equals_its_reference_and_touches_nothing_else(case: dict[str, object]) -> None:
    src, src_replica, src_slots, dst, dst_replica, dst_slots = build(case)
    _, _, _, expected, _, _ = build(case)  # the same pools again, from the same random seed
    heads = {"src_heads": case["src"]["head_range"], "dst_heads": case["dst"]["head_range"]}  # type: ignore[index]
    move_between(src, src_replica, src_slots, dst, dst_replica, dst_slots, **heads, tuning=case["tuning"])  # type: ignore[arg-type]
    move_between_reference(src, src_replica, src_slots, expected, dst_replica, dst_slots, **heads)  # type: ignore[arg-type]
    assert same_pools(dst, expected)


def test_a_request_spread_over_four_replicas_lands_in_replica_two_and_the_source_is_untouched() -> None:
    case = {
        "src": {"layout": Layout.TOKEN_MAJOR, "heads": 2, "head_range": (0, 2), "block_size": 2, "slots": 16,
                "replicas": 4, "copies": 1},
        "dst": {"layout": Layout.BLOCK, "heads": 2, "head_range": (0, 2), "block_size": 4, "slots": 16,
                "replicas": 3, "copies": 1},
        "tokens": 12, "layers": 3, "head_dim": 8, "dtype": torch.bfloat16, "seed": 7, "tuning": Tuning(),
    }  # fmt: skip
    src, src_replica, src_slots, dst, _, _ = build(case)
    untouched, _, _, expected, _, _ = build(case)
    dst_slots = distinct_slots(dst, 12)
    move_between(src, src_replica, src_slots, dst, 2, dst_slots)
    move_between_reference(src, src_replica, src_slots, expected, 2, dst_slots)
    assert same_pools(dst, expected) and same_pools(src, untouched)
    assert not same_pools(dst, build(case)[3])  # replica 2 was written


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": torch.float16}, "cannot move into"),
        ({"head_dim": 4}, "hold different rows"),
        ({"layers": 2}, "layers"),
    ],
    ids=["dtype", "head-dim", "layers"],
)
def test_pools_that_hold_different_rows_are_refused(change: dict[str, object], message: str) -> None:
    generator = torch.Generator().manual_seed(0)
    src = PoolTable([[[random_pool((8, 4, 8), torch.bfloat16, generator) for _ in range(3)]]], Layout.TOKEN_MAJOR)
    dtype: torch.dtype = change.get("dtype", torch.bfloat16)  # type: ignore[assignment]
    head_dim: int = change.get("head_dim", 8)  # type: ignore[assignment]
    layers: int = change.get("layers", 3)  # type: ignore[assignment]
    dst = PoolTable([[[random_pool((8, 4, head_dim), dtype, generator) for _ in range(layers)]]], Layout.TOKEN_MAJOR)
    slots = torch.arange(4, device=DEVICE)
    with pytest.raises(InvalidInputError, match=message):
        move_between(src, 0, slots, dst, 0, slots)


@pytest.mark.parametrize("side", ["source", "destination"])
def test_slots_outside_either_side_are_refused_before_launch(side: str) -> None:
    generator = torch.Generator().manual_seed(1)
    src = PoolTable([[[random_pool((8, 4, 8), torch.bfloat16, generator) for _ in range(2)]]], Layout.TOKEN_MAJOR)
    dst = PoolTable([[[random_pool((6, 4, 8), torch.bfloat16, generator) for _ in range(2)]]], Layout.TOKEN_MAJOR)
    before = [pool.clone() for pool in dst.pools[0][0]]
    good = torch.arange(4, device=DEVICE)
    bad = torch.tensor([0, 1, 2, 8 if side == "source" else 6], device=DEVICE)
    with pytest.raises(InvalidInputError, match="slot index"):
        move_between(src, 0, bad if side == "source" else good, dst, 0, good if side == "source" else bad)
    assert all(same_bits(pool, old) for pool, old in zip(dst.pools[0][0], before, strict=True))


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("layout", [Layout.TOKEN_MAJOR, Layout.BLOCK, Layout.MLA], ids=lambda layout: layout.value)
def test_a_kernel_on_one_gpu_writes_the_other_gpus_pools_over_nvlink_bit_for_bit(layout: Layout) -> None:
    # The fused pull's shape: the kernel runs where the source pools are; the destination's
    # are another GPU's memory (here a peer's with access enabled; in a pull, mapped by IPC).
    torch.cuda.set_device("cuda:0")  # where `build` puts the source (DEVICE is the current one)
    mla = layout is Layout.MLA
    case = {
        "src": {"layout": layout, "heads": 1 if mla else 4, "head_range": (0, 1) if mla else (2, 4),
                "block_size": 4, "slots": 64, "replicas": 4, "copies": 1},
        "dst": {"layout": layout, "heads": 1 if mla else 2, "head_range": (0, 1) if mla else (0, 2),
                "block_size": 8, "slots": 64, "replicas": 3, "copies": 2 if mla else 1},
        "tokens": 48, "layers": 4, "head_dim": 128, "dtype": torch.bfloat16, "seed": 11, "tuning": Tuning(),
    }  # fmt: skip
    src, src_replica, src_slots, dst, _, _ = build(case)
    _, _, _, expected, _, _ = build(case)
    dst_slots = distinct_slots(dst, 48)
    moved = PoolTable([[[pool.to("cuda:1") for pool in layers] for layers in copies] for copies in dst.pools], layout)
    torch.empty(1, device="cuda:1").copy_(torch.empty(1, device="cuda:0"))  # torch enables cuda:0's access to cuda:1
    heads = {"src_heads": case["src"]["head_range"], "dst_heads": case["dst"]["head_range"]}  # type: ignore[index]
    move_between(src, src_replica, src_slots, moved, 2, dst_slots, **heads)  # type: ignore[arg-type]
    torch.cuda.synchronize("cuda:0")
    move_between_reference(src, src_replica, src_slots, expected, 2, dst_slots, **heads)  # type: ignore[arg-type]
    back = PoolTable([[[pool.to(DEVICE) for pool in layers] for layers in copies] for copies in moved.pools], layout)
    assert same_pools(back, expected)
