"""Gather a request's KV out of paged pools into one staging buffer, and scatter it back.

A request's tokens may sit in any data-parallel replica's pools, at any slots (the pools and
their layouts: `kvrt._pools`, exported as `kvrt.PoolTable` and `kvrt.Layout`). `gather`
copies them, for every layer at once, into a contiguous staging buffer

    staging[layer, token, kv, head, dim]      kv: 0 = K, 1 = V (MLA: K only)

ready for one transfer; `scatter` writes a staging buffer into the replica and slots the
receiving side chose. This is the shape of LightLLM's kv_trans kernels for dp > 1. Replica and
slot indexes are int32 or int64 (engines keep them as either), on the pools' device or the host;
the kernels read either and compute addresses in 64 bits.

Both go through one kernel and one code path for dp == 1 and dp > 1, so that no path can
use a name another path defines: a table holds the base address of every (replica, copy,
layer) pool, and each token names its replica and slot. A head range [h0, h1) moves only
those heads (a decode TP that shards heads differently from prefill). For MLA a scatter
writes every copy of a replica (every card of its group).

The kernel moves bytes, not numbers: the host wrapper views everything as the widest word
(8, 4, 2 or 1 bytes) that the layout's strides allow, so fp16, bf16, fp32 and fp8 stored as
uint8 share one compiled path per word size. Each has a plain-torch reference below, which
the tests compare bit for bit under `TRITON_INTERPRET=1` on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import triton
import triton.language as tl

from kvrt._errors import InvalidInputError
from kvrt._pools import WORDS

# The pools' types and index checks live in `kvrt._pools` (no Triton there); callers of the
# kernels may name them here too.
from kvrt._pools import Layout as Layout
from kvrt._pools import Part as Part
from kvrt._pools import PoolGeometry as PoolGeometry
from kvrt._pools import PoolTable as PoolTable
from kvrt._pools import check_indices as check_indices
from kvrt._pools import checked_indexes as checked_indexes
from kvrt._pools import geometry as geometry
from kvrt._pools import index_ranges as index_ranges
from kvrt._pools import per_token as per_token
from kvrt._pools import ranges_fit as ranges_fit


def _head_range(table: PoolTable, heads: tuple[int, int] | None) -> tuple[int, int]:
    if heads is None:
        return 0, table.geometry.heads
    first, end = heads
    if not 0 <= first < end <= table.geometry.heads:
        raise InvalidInputError(f"head range [{first}, {end}) is outside the pools' {table.geometry.heads} heads")
    if table.geometry.kv == 1 and (first, end) != (0, 1):
        raise InvalidInputError("an MLA latent has no heads to select")
    return first, end


def _word(table: PoolTable, heads: tuple[int, int], stage_bytes: Sequence[int]) -> tuple[torch.dtype, int]:
    """The widest word that divides every offset and address the kernel uses, and its size."""
    itemsize = table.dtype.itemsize
    g = table.geometry
    offsets = [
        g.token_stride, g.v_offset, g.block_stride, g.head_stride, g.head_dim, heads[0] * g.head_stride,
        (heads[1] - heads[0]) * g.head_dim,
    ]  # fmt: skip
    word = widest_word(table.address_alignment, [offset * itemsize for offset in offsets] + list(stage_bytes))
    return word, word.itemsize


def widest_word(alignment: int, byte_offsets: Sequence[int]) -> torch.dtype:
    """The widest word (of `WORDS`) that divides `alignment` and every one of `byte_offsets`."""
    for word in WORDS:
        size = word.itemsize
        if alignment % size == 0 and all(value % size == 0 for value in byte_offsets):
            return word
    raise AssertionError("uint8 divides everything")  # the loop ends on 1-byte words


# `first_layer` changes from call to call and is not used in any address's alignment:
# specializing on it (Triton does for 1 and multiples of 16) would compile a new variant
# for a new chunk start, mid-transfer.
@triton.jit(do_not_specialize=["first_layer"])  # type: ignore[untyped-decorator]
def _move_kv(  # type: ignore[no-untyped-def]  # Triton reads its own annotations (constexpr)
    addresses,  # int64 [replicas, copies, layers]: base address of each pool
    replica,  # int32 or int64 [tokens]
    slots,  # int32 or int64 [tokens]
    stage_k,  # words: where the staged K rows start
    stage_v,  # words: where the staged V rows start (unused for MLA)
    layers,
    first_layer,  # the launch covers layers [first_layer, first_layer + grid[1]), of the pools and the staging
    token_stride,  # words between consecutive slots of a pool
    v_offset,  # words from a slot's K row to its V row
    head_offset,  # words from a slot's row start to head h0
    stage_layer_stride,  # words between layers in the staging
    stage_token_stride,  # words between tokens in the staging
    block_size,  # slots per block (1: every slot one token_stride from the last)
    block_stride,  # words between blocks of a pool
    head_stride,  # words between a slot's heads in a pool
    ROW: tl.constexpr,  # words of one K (or V) row of the selected heads
    DIM: tl.constexpr,  # words of one head's row
    SPLIT_HEADS: tl.constexpr,  # a slot's heads lie head_stride apart in the pools, not side by side
    KV: tl.constexpr,  # 2, or 1 for MLA and for one part (keys or values) alone
    COPIES: tl.constexpr,  # copies per replica (MLA: cards of a group); gather reads the first
    BLOCK: tl.constexpr,  # words of a row moved per step: a power of two
    GATHER: tl.constexpr,  # pools -> staging; else staging -> every copy's pools
):
    """One program moves one token's rows of one layer. A step loads its K and V words
    before it stores either: twice the bytes in flight per program, which is what brings a
    gather of random slots near a device copy of the same bytes (`kvrt bench kernels`).
    The staging holds a token's heads side by side; in the pools they may lie apart (heads
    before tokens in a block, or K and V of a head side by side): word i of the row is then
    word i % DIM of head i // DIM."""
    token = tl.program_id(0).to(tl.int64)
    layer = first_layer + tl.program_id(1).to(tl.int64)
    r = tl.load(replica + token).to(tl.int64)  # int32 indexes too: addresses are 64-bit
    slot = tl.load(slots + token).to(tl.int64)
    row_start = (slot // block_size) * block_stride + (slot % block_size) * token_stride + head_offset
    stage_k_row = stage_k + layer * stage_layer_stride + token * stage_token_stride
    stage_v_row = stage_v + layer * stage_layer_stride + token * stage_token_stride
    word = stage_k.dtype.element_ty
    if GATHER:
        pool_row = tl.load(addresses + r * COPIES * layers + layer).to(tl.pointer_type(word)) + row_start
    for start in tl.static_range(0, ROW, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        if ROW % BLOCK == 0:  # noqa: SIM108 (a static branch: Triton folds it at compile time)
            mask = None  # no predicate at all when the steps tile the row
        else:
            mask = offsets < ROW
        if SPLIT_HEADS:  # noqa: SIM108 (a static branch)
            in_pool = (offsets // DIM) * head_stride + offsets % DIM
        else:
            in_pool = offsets
        if GATHER:
            k = tl.load(pool_row + in_pool, mask=mask)
            if KV == 2:
                v = tl.load(pool_row + v_offset + in_pool, mask=mask)
                tl.store(stage_v_row + offsets, v, mask=mask)
            tl.store(stage_k_row + offsets, k, mask=mask)
        else:
            k = tl.load(stage_k_row + offsets, mask=mask)
            if KV == 2:
                v = tl.load(stage_v_row + offsets, mask=mask)
            for copy in tl.static_range(COPIES):
                base = tl.load(addresses + (r * COPIES + copy) * layers + layer)
                copy_row = base.to(tl.pointer_type(word)) + row_start
                tl.store(copy_row + in_pool, k, mask=mask)
                if KV == 2:
                    tl.store(copy_row + v_offset + in_pool, v, mask=mask)


_MAX_BLOCK_WORDS: Final = 2048
"""Longest row step: 16 KiB of 8-byte words, K and V each (a whole token-major row of up to 64
heads of 128 in bf16 in one step)."""


@dataclass(frozen=True, slots=True)
class Tuning:
    """Launch shape: words of a row per step (rounded to a power of two, at most the row),
    and warps per program (see `kvrt bench kernels`)."""

    block_words: int = _MAX_BLOCK_WORDS
    warps: int = 4


DEFAULT_TUNING = Tuning()


@dataclass(frozen=True, slots=True)
class _Stage:
    """Where the staged rows are: K (and V) bases, and the strides between layers and tokens,
    in elements. One buffer [layers, tokens, kv, heads, dim], or separate K and V tensors
    [layers, tokens, heads, dim] (an item's own key and value)."""

    key: torch.Tensor
    value: torch.Tensor
    key_offset: int
    value_offset: int
    layer_stride: int
    token_stride: int


def _combined(staging: torch.Tensor, kv: int) -> _Stage:
    _, tokens, _, heads, dim = staging.shape
    row = heads * dim
    return _Stage(staging, staging, 0, row if kv == 2 else 0, tokens * kv * row, kv * row)


def _split(key: torch.Tensor, value: torch.Tensor, kv: int) -> _Stage:
    layers, tokens, heads, dim = key.shape
    row = heads * dim
    layer_stride = key.stride(0) if layers > 1 else tokens * row  # a cut item's layers lie further apart
    return _Stage(key, value if kv == 2 else key, 0, 0, layer_stride, row)


@dataclass(frozen=True, slots=True)
class _Launch:
    """One launch of `_move_kv`, planned: what it takes, and what Triton compiles it for."""

    grid: tuple[int, int]
    args: tuple[Any, ...]
    constants: dict[str, Any]
    warps: int
    key: tuple[object, ...] = ()
    """`signature()`, worked out once by `_plan` (its chunks share it: `for_layers`)."""

    def signature(self) -> tuple[object, ...]:
        """What Triton specializes a compiled kernel on (as of Triton 3.x): each pointer's
        dtype and 16-byte alignment; each int's width, and whether it is 1 or a multiple of
        16 (not for `first_layer`, marked do_not_specialize); the constants; the warps."""
        parts: list[object] = []
        for index, arg in enumerate(self.args):
            if isinstance(arg, torch.Tensor):
                parts.append((arg.dtype, arg.device, arg.data_ptr() % 16 == 0))
            else:
                width = "i32" if -(2**31) <= arg < 2**31 else "u64" if arg >= 2**63 else "i64"
                parts.append((width,) if index == _FIRST_LAYER_ARG else (width, arg == 1, arg % 16 == 0))
        return (*parts, tuple(sorted(self.constants.items())), self.warps)

    def for_layers(self, first: int, end: int) -> _Launch:
        """The same launch over layers [first, end): the staging is indexed by pool layer, so
        only the grid and `first_layer` change (and not what Triton compiled it for)."""
        args = (*self.args[:_FIRST_LAYER_ARG], first, *self.args[_FIRST_LAYER_ARG + 1 :])
        return _Launch((self.grid[0], end - first), args, self.constants, self.warps, self.key)


_FIRST_LAYER_ARG: Final = 6
_LAUNCHED: set[tuple[object, ...]] = set()
"""Signatures launched in this process so far: Triton has compiled those."""


def _plan(
    table: PoolTable, stage: _Stage, replica: torch.Tensor, slots: torch.Tensor, heads: tuple[int, int], *,
    gather: bool, layers: tuple[int, int] | None = None, part: Part | None = None, tuning: Tuning = DEFAULT_TUNING,
) -> _Launch | None:  # fmt: skip
    """The launch that moves `layers` (all by default) of the pools and of the staging, or
    None when there is nothing to move. `part` moves only the K rows or only the V rows:
    either is a one-row launch (KV = 1) whose rows start at K's or V's offset, so a receiver
    can scatter a chunk's keys while its values are still on the wire."""
    if not table.geometry.strided:
        raise InvalidInputError(
            "head-major block pools (vLLM's CPU layout) have no token stride: the torch references move them "
            "(the `*_any` functions), not the Triton kernels"
        )
    tokens = slots.numel()
    first_layer, end_layer = (0, table.layers) if layers is None else layers
    if tokens == 0 or end_layer == first_layer:
        return None
    if slots.device != table.device or replica.device != table.device:
        raise InvalidInputError(f"a kernel reads its replica and slot indexes on {table.device}, not the host's")
    g = table.geometry
    kv = g.kv if part is None else 1
    row_offset = g.v_offset if part == "value" else 0
    itemsize = table.dtype.itemsize
    stage_bytes = [
        stage.key.data_ptr() + stage.key_offset * itemsize,
        stage.value.data_ptr() + stage.value_offset * itemsize,
        stage.layer_stride * itemsize,
        stage.token_stride * itemsize,
    ]
    word, word_size = _word(table, heads, stage_bytes)

    def to_words(elements: int) -> int:
        return elements * itemsize // word_size  # exact: _word divides every offset

    row = to_words((heads[1] - heads[0]) * g.head_dim)
    block = min(triton.next_power_of_2(max(1, tuning.block_words)), triton.next_power_of_2(row))
    stage_k = _flat(stage.key).view(word)[to_words(stage.key_offset) :]
    stage_v = _flat(stage.value).view(word)[to_words(stage.value_offset) :]
    split_heads = heads[1] - heads[0] > 1 and g.head_stride != g.head_dim
    args = (
        table.addresses,
        replica,
        slots,
        stage_k,
        stage_v,
        table.layers,
        first_layer,
        to_words(g.token_stride),
        to_words(g.v_offset),
        to_words(row_offset + heads[0] * g.head_stride),
        to_words(stage.layer_stride),
        to_words(stage.token_stride),
        g.block_size,
        to_words(g.block_stride),
        to_words(g.head_stride),
    )
    constants = {
        "ROW": row, "DIM": to_words(g.head_dim), "SPLIT_HEADS": split_heads, "KV": kv, "COPIES": table.copies,
        "BLOCK": block, "GATHER": gather,
    }  # fmt: skip
    launch = _Launch((tokens, end_layer - first_layer), args, constants, tuning.warps)
    return _Launch(launch.grid, args, constants, tuning.warps, launch.signature())


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s elements from its first to its last as one 1-D view: `view(-1)` of a
    contiguous tensor; of one cut along its tokens, the rows between its layers too (the
    kernel steps over them)."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.as_strided((last + 1,), (1,))


def _launch(
    table: PoolTable, stage: _Stage, replica: torch.Tensor, slots: torch.Tensor, heads: tuple[int, int], *,
    gather: bool, layers: tuple[int, int] | None = None, tuning: Tuning = DEFAULT_TUNING,
) -> None:  # fmt: skip
    plan = _plan(table, stage, replica, slots, heads, gather=gather, layers=layers, tuning=tuning)
    if plan is not None:
        _run(plan)


def _run(plan: _Launch) -> None:
    launch: Any = _move_kv[plan.grid]  # Triton's launcher is untyped
    launch(*plan.args, **plan.constants, num_warps=plan.warps)
    _LAUNCHED.add(plan.key or plan.signature())


def gather(
    table: PoolTable, replica: torch.Tensor, slots: torch.Tensor, *, heads: tuple[int, int] | None = None,
    out: torch.Tensor | None = None, check: bool = True, tuning: Tuning = DEFAULT_TUNING,
) -> torch.Tensor:  # fmt: skip
    """A request's KV from the pools into a new (or the given) staging buffer
    [layers, tokens, kv, heads, head_dim]: token i from replica[i], slot slots[i].
    `check=False` skips the index check (one flag read back from the GPU, which waits for
    the stream), for a caller that ran `check_indices` on these indexes already."""
    head_range = _head_range(table, heads)
    if check:
        check_indices(table, replica, slots)
    shape = table.staging_shape(slots.numel(), head_range)
    if out is None:
        out = torch.empty(shape, dtype=table.dtype, device=table.device)
    elif out.shape != shape or out.dtype != table.dtype or not out.is_contiguous():
        raise InvalidInputError(f"out must be a contiguous {table.dtype} tensor of shape {shape}")
    _launch(table, _combined(out, table.geometry.kv), replica, slots, head_range, gather=True, tuning=tuning)
    return out


def scatter(
    table: PoolTable, staging: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor, *,
    heads: tuple[int, int] | None = None, check: bool = True, tuning: Tuning = DEFAULT_TUNING,
) -> None:  # fmt: skip
    """Write a staging buffer into the pools: token i into replica[i], slot slots[i] (every
    copy of that replica for MLA). `check` as for `gather`."""
    head_range = _head_range(table, heads)
    if check:
        check_indices(table, replica, slots)
    shape = table.staging_shape(slots.numel(), head_range)
    if staging.shape != shape or staging.dtype != table.dtype or not staging.is_contiguous():
        raise InvalidInputError(f"staging must be a contiguous {table.dtype} tensor of shape {shape}")
    _launch(table, _combined(staging, table.geometry.kv), replica, slots, head_range, gather=False, tuning=tuning)


def _check_split(table: PoolTable, key: torch.Tensor, value: torch.Tensor, tokens: int, heads: tuple[int, int]) -> None:
    """Separate K and V [layers, >= tokens, heads, head_dim], each layer's rows back to back:
    contiguous, or cut along the token axis (an item a TP group agreed to shorten), K and V
    with one layer stride."""
    shape = (table.layers, heads[1] - heads[0], table.geometry.head_dim)
    for name, tensor in (("key", key), ("value", value) if table.geometry.kv == 2 else ("key", key)):
        if (
            tensor.dim() != 4
            or (tensor.shape[0], tensor.shape[2], tensor.shape[3]) != shape
            or tensor.shape[1] < tokens
            or tensor.dtype != table.dtype
            or not _layers_packed(tensor)
            or (table.layers > 1 and tensor.stride(0) != key.stride(0))
        ):
            raise InvalidInputError(
                f"{name} must be a {table.dtype} tensor [{shape[0]}, >= {tokens}, {shape[1]}, {shape[2]}] whose "
                f"layers each lie contiguous (K and V one layer stride apart), got {tensor.dtype} "
                f"{tuple(tensor.shape)} strides {tensor.stride()}"
            )


def _layers_packed(tensor: torch.Tensor) -> bool:
    """Whether each layer of `tensor` [layers, tokens, heads, head_dim] lies contiguous and the
    layers do not overlap (a contiguous tensor, or one cut along its tokens)."""
    return tensor[0].is_contiguous() and (tensor.shape[0] == 1 or tensor.stride(0) >= tensor[0].numel())


def _layer_range(table: PoolTable, layers: tuple[int, int] | None) -> tuple[int, int]:
    if layers is None:
        return 0, table.layers
    first, end = layers
    if not 0 <= first <= end <= table.layers:
        raise InvalidInputError(f"layer range [{first}, {end}) is outside the pools' {table.layers} layers")
    return first, end


def _check_part(table: PoolTable, part: Part | None) -> None:
    if part not in (None, "key", "value"):
        raise InvalidInputError(f'part must be None, "key" or "value", got {part!r}')
    if part == "value" and table.geometry.kv == 1:
        raise InvalidInputError("an MLA pool holds no values (part='value')")


def gather_into(
    table: PoolTable, replica: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
    heads: tuple[int, int] | None = None, layers: tuple[int, int] | None = None, part: Part | None = None,
    check: bool = True, tuning: Tuning = DEFAULT_TUNING,
) -> None:  # fmt: skip
    """Gather straight into separate K and V tensors [layers, tokens, heads, head_dim] (for
    MLA, `value` is ignored): token i of the request becomes token i of `key` and `value`.

    `layers` = (first, end) moves only those layers (into the same layers of `key` and
    `value`): a request gathered in chunks can travel chunk by chunk. `part` moves only the
    keys or only the values. `check=False` skips the index check, for a caller that ran
    `check_indices` once for all its chunks (the check reads a flag back from the GPU, which
    waits for the stream)."""
    prepared = prepare_gather_into(
        table, replica, slots, key, value, heads=heads, layers=layers, part=part, tuning=tuning
    )
    if check:
        check_indices(table, replica, slots)
    prepared.launch()


class PreparedGather:
    """A `gather_into` launch with its arguments worked out, not yet queued: a caller can ask
    whether it would compile first (`compiled`), then `launch` it, or the same gather over a
    chunk of its layers (`for_layers`), paying for the checks and the planning once."""

    __slots__ = ("_layers", "_plan")

    def __init__(self, plan: _Launch | None, layers: tuple[int, int]) -> None:
        self._plan = plan
        self._layers = layers

    @property
    def compiled(self) -> bool:
        """Whether this process launched the same specialization already: a first launch of a
        new one compiles, for about a second (a caller on an event loop must not wait there)."""
        return self._plan is None or (self._plan.key or self._plan.signature()) in _LAUNCHED

    def for_layers(self, first: int, end: int) -> PreparedGather:
        """This gather over layers [first, end) only (inside its own layers), with the same
        compiled kernel: a chunk of a request that travels chunk by chunk."""
        if not self._layers[0] <= first <= end <= self._layers[1]:
            raise InvalidInputError(f"layer range [{first}, {end}) is outside this gather's {self._layers}")
        plan = None if self._plan is None or first == end else self._plan.for_layers(first, end)
        return PreparedGather(plan, (first, end))

    def launch(self) -> None:
        """Queue the gather on the current stream."""
        if self._plan is not None:
            _run(self._plan)


def prepare_gather_into(
    table: PoolTable, replica: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
    heads: tuple[int, int] | None = None, layers: tuple[int, int] | None = None, part: Part | None = None,
    tuning: Tuning = DEFAULT_TUNING,
) -> PreparedGather:  # fmt: skip
    """`gather_into` (with `check=False`), prepared but not launched."""
    plan = _split_plan(table, key, value, replica, slots, heads, layers, part, tuning, gather=True)
    return PreparedGather(plan, _layer_range(table, layers))


def _split_plan(
    table: PoolTable, key: torch.Tensor, value: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor,
    heads: tuple[int, int] | None, layers: tuple[int, int] | None, part: Part | None, tuning: Tuning, *,
    gather: bool,
) -> _Launch | None:  # fmt: skip
    """The launch between the pools and separate K and V tensors (`gather_into`,
    `scatter_from`), after the host-side checks of its arguments."""
    head_range = _head_range(table, heads)
    _check_split(table, key, value, slots.numel(), head_range)
    _check_part(table, part)
    layer_range = _layer_range(table, layers)
    if part == "value":
        stage = _split(value, value, 1)
    elif part == "key":
        stage = _split(key, key, 1)
    else:
        stage = _split(key, value, table.geometry.kv)
    return _plan(table, stage, replica, slots, head_range, gather=gather, layers=layer_range, part=part, tuning=tuning)


def scatter_from(
    table: PoolTable, key: torch.Tensor, value: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor, *,
    heads: tuple[int, int] | None = None, layers: tuple[int, int] | None = None, part: Part | None = None,
    check: bool = True, tuning: Tuning = DEFAULT_TUNING,
) -> None:  # fmt: skip
    """Scatter the first len(slots) tokens of separate K and V tensors [layers, tokens, heads,
    head_dim] (an item as it arrived) into the pools, with no staging copy. `layers`, `part`
    and `check` as for `gather_into`: a pull scatters each chunk of layers as it lands, its
    keys as soon as they are there."""
    plan = _split_plan(table, key, value, replica, slots, heads, layers, part, tuning, gather=False)
    if check:
        check_indices(table, replica, slots)
    if plan is not None:
        _run(plan)


# -- one layer at a time: streams ------------------------------------------------------------


def _layer_plan(
    table: PoolTable, key: torch.Tensor, value: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor,
    layer: int, tuning: Tuning, *, gather: bool, heads: tuple[int, int] | None = None,
) -> _Launch | None:  # fmt: skip
    """The launch between layer `layer` of the pools (heads `heads`, all by default) and one
    layer's K and V [tokens, heads, head_dim]: a stage whose layer stride is 0, so that the
    kernel's layer `layer` is them."""
    head_range = _head_range(table, heads)
    _check_layer(table, key, value, slots.numel(), layer, head_range)
    g = table.geometry
    stage = _Stage(key, value if g.kv == 2 else key, 0, 0, 0, (head_range[1] - head_range[0]) * g.head_dim)
    return _plan(table, stage, replica, slots, head_range, gather=gather, layers=(layer, layer + 1), tuning=tuning)


def _check_layer(
    table: PoolTable, key: torch.Tensor, value: torch.Tensor, tokens: int, layer: int,
    heads: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    if not isinstance(layer, int) or not 0 <= layer < table.layers:
        raise InvalidInputError(f"layer {layer!r} is outside the pools' {table.layers} layers")
    g = table.geometry
    count = g.heads if heads is None else heads[1] - heads[0]
    for name, tensor in (("key", key), ("value", value)) if g.kv == 2 else (("key", key),):
        if (
            tensor.dim() != 3
            or (tensor.shape[1], tensor.shape[2]) != (count, g.head_dim)
            or tensor.shape[0] < tokens
            or tensor.dtype != table.dtype
            or tensor.device != table.device
            or not tensor.is_contiguous()
        ):
            raise InvalidInputError(
                f"{name} must be a contiguous {table.dtype} tensor [>= {tokens}, {count}, {g.head_dim}] on "
                f"{table.device}, got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
            )


def prepare_gather_layer(
    table: PoolTable, replica: torch.Tensor, slots: torch.Tensor, layer: int, key: torch.Tensor,
    value: torch.Tensor, *, tuning: Tuning = DEFAULT_TUNING,
) -> PreparedGather:  # fmt: skip
    """Layer `layer` of a request gathered into `key` and `value` [tokens, heads, head_dim]
    each (`value` is ignored for MLA), prepared, not launched, its indexes not checked: a
    stream gathers each layer as the prefill wrote it."""
    plan = _layer_plan(table, key, value, replica, slots, layer, tuning, gather=True)
    return PreparedGather(plan, (layer, layer + 1))


def scatter_layer_from(
    table: PoolTable, key: torch.Tensor, value: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor,
    layer: int, *, heads: tuple[int, int] | None = None, check: bool = True, tuning: Tuning = DEFAULT_TUNING,
) -> None:  # fmt: skip
    """The first len(slots) tokens of one layer's K and V [tokens, heads, head_dim] written into
    layer `layer` of the pools (into their heads `heads`, all by default): a stream's reader
    places each layer as it lands."""
    plan = _layer_plan(table, key, value, replica, slots, layer, tuning, gather=False, heads=heads)
    if check:
        check_indices(table, replica, slots)
    if plan is not None:
        _run(plan)


# -- plain-torch references -----------------------------------------------------------------


def _rows(table: PoolTable, pool: torch.Tensor, kv: int) -> torch.Tensor:
    """One layer's pool as [slots, heads, head_dim] for K (kv=0) or V (kv=1), indexed by
    `_at`: for pools in blocks (head-major, bhnc, MLA in blocks) a view [blocks, block_size,
    heads, head_dim]."""
    g = table.geometry
    if table.layout is Layout.TOKEN_MAJOR:
        return pool[:, kv * g.heads : (kv + 1) * g.heads]
    if table.layout is Layout.BLOCK:
        return pool[kv].reshape(g.slots, g.heads, g.head_dim)
    if table.layout is Layout.BLOCK_HEAD_MAJOR:
        blocks, heads, _, block_size, dim = pool.shape
        if kv == 0:  # a block's keys of one head are [head_dim, block_size]: a slot is a column
            return pool[:, :, 0].view(blocks, heads, dim, block_size).permute(0, 3, 1, 2)
        return pool[:, :, 1].permute(0, 2, 1, 3)
    if table.layout is Layout.BHNC:  # [blocks, heads, block_size, K | V] -> [blocks, block_size, heads, dim]
        return pool[..., kv * g.head_dim : (kv + 1) * g.head_dim].permute(0, 2, 1, 3)
    if pool.dim() == 4:  # MLA in blocks: [blocks, 1, block_size, dim] -> [blocks, block_size, 1, dim]
        return pool.permute(0, 2, 1, 3)
    return pool.view(g.slots, 1, g.head_dim)


def _at(table: PoolTable, slots: torch.Tensor, heads: slice | None = None) -> tuple[torch.Tensor | slice, ...]:
    """The index of `slots` (and `heads`) into `_rows`: the slots, or (block, offset) for pools
    whose `_rows` keep their blocks."""
    block_size = table.geometry.block_size
    in_blocks = table.layout in (Layout.BLOCK_HEAD_MAJOR, Layout.BHNC) or table.pools[0][0][0].dim() == 4
    at: tuple[torch.Tensor | slice, ...] = (slots // block_size, slots % block_size) if in_blocks else (slots,)
    return at if heads is None else (*at, heads)


def gather_reference(
    table: PoolTable, replica: torch.Tensor, slots: torch.Tensor, *, heads: tuple[int, int] | None = None
) -> torch.Tensor:
    first, end = _head_range(table, heads)
    out = torch.empty(table.staging_shape(slots.numel(), (first, end)), dtype=table.dtype, device=table.device)
    for layer in range(table.layers):
        for kv in range(table.geometry.kv):
            for r in range(table.replicas):
                chosen = (replica == r).nonzero().flatten()
                rows = _rows(table, table.pools[r][0][layer], kv)
                out[layer, chosen, kv] = rows[_at(table, slots[chosen], slice(first, end))]
    return out


def scatter_reference(
    table: PoolTable, staging: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor, *,
    heads: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    first, end = _head_range(table, heads)
    for layer in range(table.layers):
        for kv in range(table.geometry.kv):
            for r in range(table.replicas):
                chosen = (replica == r).nonzero().flatten()
                for copy in range(table.copies):
                    rows = _rows(table, table.pools[r][copy][layer], kv)
                    rows[_at(table, slots[chosen], slice(first, end))] = staging[layer, chosen, kv]


def gather_layer_reference(
    table: PoolTable, replica: torch.Tensor, slots: torch.Tensor, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer` of a request: its K and V [tokens, heads, head_dim] (V empty for MLA)."""
    g = table.geometry
    shape = (slots.numel(), g.heads, g.head_dim)
    parts = [torch.empty(shape, dtype=table.dtype, device=table.device) for _ in range(g.kv)]
    for kv, out in enumerate(parts):
        for r in range(table.replicas):
            chosen = (replica == r).nonzero().flatten()
            out[chosen] = _rows(table, table.pools[r][0][layer], kv)[_at(table, slots[chosen])]
    value = parts[1] if g.kv == 2 else torch.empty((slots.numel(), 1, 0), dtype=table.dtype, device=table.device)
    return parts[0], value


def scatter_layer_reference(
    table: PoolTable, key: torch.Tensor, value: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor, layer: int,
    *, heads: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    first, end = _head_range(table, heads)
    tokens = slots.numel()
    for kv, source in enumerate([key, value][: table.geometry.kv]):
        for r in range(table.replicas):
            chosen = (replica == r).nonzero().flatten()
            for copy in range(table.copies):
                rows = _rows(table, table.pools[r][copy][layer], kv)
                rows[_at(table, slots[chosen], slice(first, end))] = source[:tokens][chosen]


# -- on the host: block by block ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Runs:
    """A request's slots in one replica's block pools as runs: `full` blocks (a run of all of
    a block's slots in order, starting at its first) moved by one `index_copy_` a layer, each
    at tokens [i * block_size, ...) of the request, and the other runs one slice each:
    (first token, block, first offset, length)."""

    full: torch.Tensor
    full_tokens: torch.Tensor
    partial: list[tuple[int, int, int, int]]
    in_order: bool
    """Whether the full blocks' tokens follow each other (one `index_copy_` moves them all)."""


MAX_PARTIAL_RUNS: Final = 8
"""Runs shorter than a block that a host move copies one by one (a request's are its first
and last block at most); slots that fall into more runs move element by element instead."""


def _block_runs(table: PoolTable, replica: torch.Tensor, slots: torch.Tensor) -> _Runs | None:
    """`slots` as runs of blocks, where the pools are in blocks, of one replica, and the slots
    run through them in order (a serving engine's pages); None otherwise, and None where an
    index is outside the pools (runs are only made of indexes in range: a move by runs needs
    no other check). In plain Python over the slots' list: a request's few runs cost a few
    list comparisons, where a dozen numpy calls cost ~30 us warm and ~200 us with the caches
    cold, as they are between forward passes."""
    block_size = table.geometry.block_size
    in_blocks = table.layout in (Layout.BLOCK, Layout.BLOCK_HEAD_MAJOR, Layout.BHNC) or (
        table.layout is Layout.MLA and table.pools[0][0][0].dim() == 4
    )
    if not in_blocks or table.replicas != 1 or not slots.numel() or replica.device.type != "cpu":
        return None
    if replica.numel() != slots.numel() or bool(replica.any()):
        return None
    at: list[int] = slots.tolist()
    count, bound = len(at), table.geometry.slots
    full: list[int] = []
    full_tokens: list[int] = []
    partial: list[tuple[int, int, int, int]] = []
    token = 0
    while token < count:
        first = at[token]
        if not 0 <= first < bound:
            return None
        block, offset = divmod(first, block_size)
        length = min(block_size - offset, count - token)
        if at[token : token + length] != list(range(first, first + length)):
            length = next(step for step in range(1, length) if at[token + step] != first + step)
        if length == block_size:
            full.append(block)
            full_tokens.append(token)
        elif len(partial) == MAX_PARTIAL_RUNS:
            return None
        else:
            partial.append((token, block, offset, length))
        token += length
    # Each full run is a block's worth of tokens: they follow each other iff they span no more.
    in_order = not full_tokens or full_tokens[-1] - full_tokens[0] == (len(full_tokens) - 1) * block_size
    return _Runs(torch.tensor(full, dtype=torch.int64), torch.tensor(full_tokens, dtype=torch.int64), partial, in_order)


def _rows_in_blocks(table: PoolTable, pool: torch.Tensor, kv: int) -> torch.Tensor:
    """`_rows` of a pool in blocks, always as [blocks, block_size, heads, head_dim]."""
    rows = _rows(table, pool, kv)
    if table.layout is Layout.BLOCK:
        return rows.view(-1, table.geometry.block_size, *rows.shape[1:])
    return rows


def _move_runs(
    table: PoolTable, runs: _Runs, sources: Sequence[torch.Tensor], heads: tuple[int, int], *, scatter: bool,
    layers: range,
) -> None:  # fmt: skip
    """Scatter `sources` ([layers, tokens, heads, head_dim] each: K, and V unless MLA) into the
    runs' slots, or gather the runs' slots into them, layer by layer, block by block."""
    block_size = table.geometry.block_size
    first, end = heads
    every_head = first == 0 and end == table.geometry.heads
    full = runs.full.numel()
    first_token = int(runs.full_tokens[0]) if full and runs.in_order else 0
    copies = range(table.copies if scatter else 1)
    for index, layer in enumerate(layers):
        for kv, source in enumerate(sources):
            tokens = source[index]
            blocks = None
            if full and runs.in_order:
                run = tokens[first_token : first_token + full * block_size]
                blocks = run.view(full, block_size, *tokens.shape[1:])
            for copy in copies:
                rows = _rows_in_blocks(table, table.pools[0][copy][layer], kv)
                if not every_head:
                    rows = rows[:, :, first:end]
                if blocks is not None:
                    if scatter:
                        rows.index_copy_(0, runs.full, blocks)
                    elif blocks.is_contiguous():  # straight into the item: no staging copy
                        torch.index_select(rows, 0, runs.full, out=blocks)
                    else:
                        blocks.copy_(rows.index_select(0, runs.full))
                elif full:
                    for block, start in zip(runs.full.tolist(), runs.full_tokens.tolist(), strict=True):
                        _move_one(rows[block], tokens[start : start + block_size], scatter)
                for start, block, offset, length in runs.partial:
                    _move_one(rows[block, offset : offset + length], tokens[start : start + length], scatter)


def _move_one(rows: torch.Tensor, tokens: torch.Tensor, scatter: bool) -> None:
    if scatter:
        rows.copy_(tokens)
    else:
        tokens.copy_(rows)


# -- the path the runtime takes: Triton on GPUs, block by block (or the references) on CPU ------


def gather_into_any(
    table: PoolTable, replica: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """`gather_into` where Triton runs (CUDA); on the host block by block where the slots run
    through blocks in order (`_block_runs`), else through its torch reference."""
    if table.device.type == "cuda":
        gather_into(table, replica, slots, key, value)
        return
    _check_split(table, key, value, slots.numel(), _head_range(table, None))
    tokens = slots.numel()
    runs = _block_runs(table, replica, slots)  # made of indexes in range only
    if runs is not None:
        sources = [key[:, :tokens], value[:, :tokens]][: table.geometry.kv]
        _move_runs(table, runs, sources, _head_range(table, None), scatter=False, layers=range(table.layers))
        return
    check_indices(table, replica, slots)
    staging = gather_reference(table, replica, slots)
    key[:, :tokens] = staging[:, :, 0]
    if table.geometry.kv == 2:
        value[:, :tokens] = staging[:, :, 1]


def scatter_from_any(
    table: PoolTable, key: torch.Tensor, value: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor, *,
    heads: tuple[int, int] | None = None, check: bool = True,
) -> None:  # fmt: skip
    """`scatter_from` where Triton runs (CUDA); on the host block by block where the slots run
    through blocks in order (`_block_runs`), else through its torch reference. `check`: False
    where the caller checked the indexes already (as for `scatter_from`)."""
    if table.device.type == "cuda":
        scatter_from(table, key, value, replica, slots, heads=heads, check=check)
        return
    _check_split(table, key, value, slots.numel(), _head_range(table, heads))
    tokens = slots.numel()
    parts = [key[:, :tokens]] if table.geometry.kv == 1 else [key[:, :tokens], value[:, :tokens]]
    runs = _block_runs(table, replica, slots)  # made of indexes in range only
    if runs is None and check:
        check_indices(table, replica, slots)
    if runs is not None:
        _move_runs(table, runs, parts, _head_range(table, heads), scatter=True, layers=range(table.layers))
        return
    scatter_reference(table, torch.stack(parts, dim=2), replica, slots, heads=heads)


def gather_layer_into_any(
    table: PoolTable, replica: torch.Tensor, slots: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor
) -> None:
    """One layer's gather (`prepare_gather_layer`, launched) where Triton runs (CUDA); on the
    host block by block or through its torch reference, as `gather_into_any`; the indexes are
    not checked."""
    if table.device.type == "cuda":
        prepare_gather_layer(table, replica, slots, layer, key, value).launch()
        return
    _check_layer(table, key, value, slots.numel(), layer)
    tokens = slots.numel()
    runs = _block_runs(table, replica, slots)
    if runs is not None:
        sources = [key[None, :tokens], value[None, :tokens]][: table.geometry.kv]
        _move_runs(table, runs, sources, _head_range(table, None), scatter=False, layers=range(layer, layer + 1))
        return
    gathered_key, gathered_value = gather_layer_reference(table, replica, slots, layer)
    key[:tokens] = gathered_key
    if table.geometry.kv == 2:
        value[:tokens] = gathered_value


def scatter_layer_from_any(
    table: PoolTable, key: torch.Tensor, value: torch.Tensor, replica: torch.Tensor, slots: torch.Tensor, layer: int,
    *, heads: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """`scatter_layer_from` (indexes not checked) where Triton runs; on the host block by block
    or through its torch reference, as `scatter_from_any`."""
    if table.device.type == "cuda":
        scatter_layer_from(table, key, value, replica, slots, layer, heads=heads, check=False)
        return
    _check_layer(table, key, value, slots.numel(), layer, _head_range(table, heads))
    runs = _block_runs(table, replica, slots)
    if runs is not None:
        tokens = slots.numel()
        sources = [key[None, :tokens], value[None, :tokens]][: table.geometry.kv]
        _move_runs(table, runs, sources, _head_range(table, heads), scatter=True, layers=range(layer, layer + 1))
        return
    scatter_layer_reference(table, key, value, replica, slots, layer, heads=heads)
