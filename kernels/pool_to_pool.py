"""Move a request's KV straight from one node's paged pools into another's: one launch,
every layer, no staging buffer.

    for each layer and token t, K and V rows (MLA: the latent):
        dst.pools[dst_replica[t]][every copy][layer] at slot dst_slots[t], heads [g0, g0 + n)
            = src.pools[src_replica[t]][0][layer] at slot src_slots[t], heads [h0, h0 + n)

This is the fused form of a same-host pull: the producer's GPU reads its own
dp replicas and writes the consumer's chosen replica and slots, whose pools CUDA IPC maps
into its address space, over NVLink. Where the staged path gathers into a buffer, copies
it, and scatters it (three passes, a buffer on each side), this kernel's loads are local and
its stores remote, so the bytes cross once. It runs on SMs of the GPU it is launched on (the
copy-engine path spends none); `kvrt bench ipc` measures it beside a peer copy of the same
bytes. The runtime's pull does not use it yet.

The two tables may differ in layout (token-major, block, bhnc, and each of vLLM's physical
orders), block size, replicas, copies and slots; they must agree in dtype, head_dim, the width
of the head ranges, and MLA or not. Bytes move as
the widest word both sides' strides and addresses allow, as in `paged_kv`.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kvrt._errors import InvalidInputError
from kvrt._pools import PoolTable, check_indices, per_token
from kvrt.kernels.paged_kv import (
    DEFAULT_TUNING,
    Tuning,
    _head_range,
    gather_reference,
    scatter_reference,
    widest_word,
)


@triton.jit  # type: ignore[untyped-decorator]
def _move_rows(  # type: ignore[no-untyped-def]  # Triton reads its own annotations (constexpr)
    src_addresses,  # int64 [replicas, copies, layers]: base address of each source pool
    src_replica,  # int32 or int64 [tokens]
    src_slots,  # int32 or int64 [tokens]
    dst_addresses,  # int64 [replicas, copies, layers]: base address of each destination pool
    dst_replica,  # int32 or int64 [tokens]
    dst_slots,  # int32 or int64 [tokens]
    word_like,  # a tensor of the word type: the pointers' element type
    layers,
    src_token_stride,  # words between consecutive slots of a source block
    src_v_offset,  # words from a source slot's K row to its V row
    src_head_offset,  # words from a source slot's row start to head h0
    dst_token_stride,
    dst_v_offset,
    dst_head_offset,
    src_block_size,  # slots per source block (1: every slot one token stride from the last)
    src_block_stride,  # words between source blocks
    src_head_stride,  # words between a source slot's heads
    dst_block_size,
    dst_block_stride,
    dst_head_stride,
    ROW: tl.constexpr,  # words of one K (or V) row of the selected heads
    DIM: tl.constexpr,  # words of one head's row
    SRC_SPLIT: tl.constexpr,  # a source slot's heads lie src_head_stride apart, not side by side
    DST_SPLIT: tl.constexpr,
    KV: tl.constexpr,  # 2, or 1 for MLA
    SRC_COPIES: tl.constexpr,  # copies per source replica (it reads the first)
    DST_COPIES: tl.constexpr,  # copies per destination replica (it writes every one)
    BLOCK: tl.constexpr,  # words of a row moved per step: a power of two
):
    """One program moves one token's rows of one layer, loading K and V before storing
    either (twice the bytes in flight per program, as `paged_kv._move_kv` does). Addresses
    as in `kvrt._pools`: each side its own blocks, strides and head spacing."""
    token = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    word = word_like.dtype.element_ty
    r = tl.load(src_replica + token).to(tl.int64)  # int32 indexes too: addresses are 64-bit
    q = tl.load(dst_replica + token).to(tl.int64)
    src_slot = tl.load(src_slots + token).to(tl.int64)
    dst_slot = tl.load(dst_slots + token).to(tl.int64)
    src_base = tl.load(src_addresses + r * SRC_COPIES * layers + layer).to(tl.pointer_type(word))
    src_row = src_base + (
        (src_slot // src_block_size) * src_block_stride + (src_slot % src_block_size) * src_token_stride
        + src_head_offset
    )  # fmt: skip
    dst_row_start = (
        (dst_slot // dst_block_size) * dst_block_stride + (dst_slot % dst_block_size) * dst_token_stride
        + dst_head_offset
    )  # fmt: skip
    for start in tl.static_range(0, ROW, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        if ROW % BLOCK == 0:  # noqa: SIM108 (a static branch: Triton folds it at compile time)
            mask = None
        else:
            mask = offsets < ROW
        if SRC_SPLIT:  # noqa: SIM108 (a static branch)
            src_at = (offsets // DIM) * src_head_stride + offsets % DIM
        else:
            src_at = offsets
        if DST_SPLIT:  # noqa: SIM108 (a static branch)
            dst_at = (offsets // DIM) * dst_head_stride + offsets % DIM
        else:
            dst_at = offsets
        k = tl.load(src_row + src_at, mask=mask)
        if KV == 2:
            v = tl.load(src_row + src_v_offset + src_at, mask=mask)
        for copy in tl.static_range(DST_COPIES):
            base = tl.load(dst_addresses + (q * DST_COPIES + copy) * layers + layer)
            dst_row = base.to(tl.pointer_type(word)) + dst_row_start
            tl.store(dst_row + dst_at, k, mask=mask)
            if KV == 2:
                tl.store(dst_row + dst_v_offset + dst_at, v, mask=mask)


def _check_pair(src: PoolTable, dst: PoolTable, src_heads: tuple[int, int], dst_heads: tuple[int, int]) -> None:
    for table in (src, dst):
        if not table.geometry.strided:
            raise InvalidInputError("head-major block pools (vLLM's CPU layout) have no token stride: not on GPUs")
    if src.dtype != dst.dtype:
        raise InvalidInputError(f"pools of {src.dtype} cannot move into pools of {dst.dtype}")
    if src.geometry.head_dim != dst.geometry.head_dim or src.geometry.kv != dst.geometry.kv:
        raise InvalidInputError(
            f"source pools ({src.layout.value}, head_dim {src.geometry.head_dim}) and destination pools "
            f"({dst.layout.value}, head_dim {dst.geometry.head_dim}) hold different rows"
        )
    if src.layers != dst.layers:
        raise InvalidInputError(f"source pools have {src.layers} layers, the destination {dst.layers}")
    if src_heads[1] - src_heads[0] != dst_heads[1] - dst_heads[0]:
        raise InvalidInputError(f"head ranges {src_heads} and {dst_heads} differ in width")


def _word(src: PoolTable, dst: PoolTable, src_heads: tuple[int, int], dst_heads: tuple[int, int]) -> torch.dtype:
    """The widest word that divides every address and offset of both sides."""
    itemsize = src.dtype.itemsize
    offsets = [(src_heads[1] - src_heads[0]) * src.geometry.head_dim]
    for table, heads in ((src, src_heads), (dst, dst_heads)):
        g = table.geometry
        offsets += [g.token_stride, g.v_offset, heads[0] * g.head_stride, g.block_stride, g.head_stride, g.head_dim]
    # Both alignments are powers of two: the smaller divides the larger.
    alignment = min(src.address_alignment, dst.address_alignment)
    return widest_word(alignment, [offset * itemsize for offset in offsets])


def move_between(
    src: PoolTable, src_replica: torch.Tensor | int, src_slots: torch.Tensor,
    dst: PoolTable, dst_replica: torch.Tensor | int, dst_slots: torch.Tensor, *,
    src_heads: tuple[int, int] | None = None, dst_heads: tuple[int, int] | None = None,
    check: bool = True, tuning: Tuning = DEFAULT_TUNING,
) -> None:  # fmt: skip
    """Queue, on the current stream of `src`'s device, the move of every layer of a request's
    KV from `src` (token t from replica src_replica[t], slot src_slots[t]) into `dst` (replica
    dst_replica[t], slot dst_slots[t], every copy), heads `src_heads` into `dst_heads`. The
    indexes live on `src`'s device; `dst`'s pools must be writable from it (the same device,
    a peer with access enabled, or memory opened there by CUDA IPC). `check` refuses indexes
    outside either table first (one read back from the device per table)."""
    src_range, dst_range = _head_range(src, src_heads), _head_range(dst, dst_heads)
    _check_pair(src, dst, src_range, dst_range)
    src_replicas, dst_replicas = per_token(src_replica, src_slots), per_token(dst_replica, dst_slots)
    if dst_slots.shape != src_slots.shape:
        raise InvalidInputError(f"{src_slots.numel()} source slots for {dst_slots.numel()} destination slots")
    for name, index in (("source", src_slots), ("destination", dst_slots)):
        if index.device != src.device:
            raise InvalidInputError(f"{name} indexes must be on {src.device}, where the kernel runs")
    if check:
        check_indices(src, src_replicas, src_slots)
        check_indices(dst, dst_replicas.to(dst.device), dst_slots.to(dst.device))
    tokens = src_slots.numel()
    if tokens == 0:
        return
    word = _word(src, dst, src_range, dst_range)
    scale = src.dtype.itemsize
    size = word.itemsize

    def words(elements: int) -> int:
        return elements * scale // size  # exact: _word divides every offset

    heads = src_range[1] - src_range[0]
    row = words(heads * src.geometry.head_dim)
    block = min(triton.next_power_of_2(max(1, tuning.block_words)), triton.next_power_of_2(row))
    dst_addresses = dst.addresses if dst.addresses.device == src.device else dst.addresses.to(src.device)
    s, d = src.geometry, dst.geometry
    launch: Any = _move_rows[(tokens, src.layers)]  # Triton's launcher is untyped
    launch(
        src.addresses, src_replicas, src_slots, dst_addresses, dst_replicas, dst_slots,
        torch.empty(1, dtype=word, device=src.device), src.layers,
        words(s.token_stride), words(s.v_offset), words(src_range[0] * s.head_stride),
        words(d.token_stride), words(d.v_offset), words(dst_range[0] * d.head_stride),
        s.block_size, words(s.block_stride), words(s.head_stride),
        d.block_size, words(d.block_stride), words(d.head_stride),
        ROW=row, DIM=words(s.head_dim), SRC_SPLIT=heads > 1 and s.head_stride != s.head_dim,
        DST_SPLIT=heads > 1 and d.head_stride != d.head_dim, KV=s.kv, SRC_COPIES=src.copies,
        DST_COPIES=dst.copies, BLOCK=block, num_warps=tuning.warps,
    )  # fmt: skip


def move_between_reference(
    src: PoolTable, src_replica: torch.Tensor | int, src_slots: torch.Tensor,
    dst: PoolTable, dst_replica: torch.Tensor | int, dst_slots: torch.Tensor, *,
    src_heads: tuple[int, int] | None = None, dst_heads: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """The same move in plain torch: a gather of the source rows, scattered into the
    destination (on the destination's device)."""
    src_replicas, dst_replicas = per_token(src_replica, src_slots), per_token(dst_replica, dst_slots)
    rows = gather_reference(src, src_replicas, src_slots, heads=src_heads).to(dst.device)
    scatter_reference(dst, rows, dst_replicas.to(dst.device), dst_slots.to(dst.device), heads=dst_heads)


__all__ = ["move_between", "move_between_reference"]
