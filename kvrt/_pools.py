"""Paged KV pools as the runtime sees them: their layouts, their geometry, and checks of a
request's replica and slot indexes (torch and numpy only: no Triton).

Serving engines keep KV in paged pools, one per layer, and with data parallelism one set of
pools per replica: a request's tokens may sit in any replica, at any slots. A `PoolTable`
names every pool of a node, `pools[replica][copy][layer]`; `Producer.register_pools` and
`Consumer.pull(into=...)` take one. Pool layouts, per layer:

    token-major  [slots, 2*H, D]                K heads, then V heads (LightLLM)
                 [slots, 1, D]                  one latent per token: MLA as LightLLM keeps it
    block        [2, blocks, block_size, H, D]  slot = block * block_size + offset (vLLM < 0.32)
    bhnc         [blocks, H, block_size, 2*D]   per block, head and slot one row: the key's D
                                                elements, then the value's; any strides, the
                                                row contiguous (vLLM >= 0.32 on GPUs, in every
                                                physical order its KV cache layout names:
                                                NHD, HND, cross-layer blocks)
    block, head-major
                 [blocks, H, 2, block_size, D]  per block and head, its keys transposed (D
                                                rows of block_size: a slot is a column), then
                                                its values (block_size rows of D): vLLM's CPU
                                                backend with its vec and vec16 kernels (CPU
                                                pools only)
    mla          [slots, D] or [slots, 1, D]    one latent per token, the same on every card;
                 [blocks, 1, block_size, D]     also in blocks, any strides (vLLM >= 0.32)

Every layout but head-major blocks is one addressing scheme (`PoolGeometry`): a slot's row of
head h, part kv (0: K, 1: V) starts at

    (slot // block_size) * block_stride + (slot % block_size) * token_stride + kv * v_offset
        + h * head_stride

elements from the pool's first, and runs `head_dim` elements. That is what the Triton kernels
compute, so a producer and a consumer of different layouts and block sizes move the same
tokens: each side addresses its own pools.

Replica and slot indexes are int32 or int64 (engines keep them as either), on the pools'
device or the host.

The kernels that move KV in and out of such pools are in `kvrt.kernels.paged_kv`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import torch

from kvrt._errors import InvalidInputError
from kvrt._tensors import host_to_device

WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
"""The word types a kernel may move a pool's bytes as, widest first."""

INDEX_DTYPES: Final = (torch.int32, torch.int64)
"""What replica and slot indexes may be."""

Part = Literal["key", "value"]
"""Only the K rows or only the V rows of a request (None: both)."""


class Layout(enum.Enum):
    """How one layer's pool lays out its slots (the shapes in this module's docstring)."""

    TOKEN_MAJOR = "token_major"
    BLOCK = "block"
    BHNC = "bhnc"
    BLOCK_HEAD_MAJOR = "block_head_major"
    MLA = "mla"


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """Where a slot's K and V rows sit in one layer's pool, in elements of the pool's dtype
    (the address in this module's docstring)."""

    layout: Layout
    slots: int
    heads: int
    head_dim: int
    token_stride: int
    """From a slot to the next one of its block (to the next slot, where blocks are of one)."""
    v_offset: int
    """From a slot's K row to its V row (0 for a latent, which has no V)."""
    kv: int = 2
    """Rows per slot: K and V, or 1 for a latent (MLA)."""
    block_size: int = 1
    """Slots per block where a block's slots are not all one stride apart; 1 elsewhere."""
    block_stride: int = 0
    """From a block to the next; 0 (the default) for blocks that are runs of `block_size` slots
    `token_stride` apart."""
    head_stride: int = 0
    """From a slot's head to the next; 0 (the default) for heads that lie side by side."""

    def __post_init__(self) -> None:
        # The defaults resolve here so that two geometries of one address compare equal however
        # they were spelled.
        if self.block_stride == 0:
            object.__setattr__(self, "block_stride", self.token_stride * self.block_size)
        if self.head_stride == 0:
            object.__setattr__(self, "head_stride", self.head_dim)

    @property
    def strided(self) -> bool:
        """Whether every row is where the address says, `head_dim` elements long (the Triton
        kernels move such pools); head-major blocks keep their keys transposed."""
        return self.layout is not Layout.BLOCK_HEAD_MAJOR


def _flat_geometry(
    layout: Layout, slots: int, heads: int, dim: int, slot_stride: int, v_offset: int, kv: int = 2
) -> PoolGeometry:
    """A pool whose slots are all one stride apart and whose heads lie side by side."""
    return PoolGeometry(
        layout, slots, heads, dim, slot_stride, v_offset, kv=kv, block_stride=slot_stride, head_stride=dim
    )


def geometry(pool: torch.Tensor, layout: Layout) -> PoolGeometry:
    """The geometry of one layer's pool, checking its shape against `layout`."""
    if layout is Layout.BHNC or (layout is Layout.MLA and pool.dim() == 4):
        return _strided_geometry(pool, layout)
    if not pool.is_contiguous():
        raise InvalidInputError(f"KV pools of the {layout.value} layout must be contiguous")
    if layout is Layout.TOKEN_MAJOR:
        if pool.dim() == 3 and pool.shape[1] == 1:  # one latent per token (MLA): no V heads
            slots, _, dim = pool.shape
            return _flat_geometry(layout, slots, 1, dim, dim, 0, kv=1)
        if pool.dim() != 3 or pool.shape[1] % 2:
            raise InvalidInputError(
                "a token-major pool is [slots, 2*heads, head_dim] (K heads, then V heads) or [slots, 1, latent_dim] "
                f"(MLA), got {tuple(pool.shape)}"
            )
        slots, two_heads, dim = pool.shape
        return _flat_geometry(layout, slots, two_heads // 2, dim, two_heads * dim, two_heads // 2 * dim)
    if layout is Layout.BLOCK:
        if pool.dim() != 5 or pool.shape[0] != 2:
            raise InvalidInputError(
                f"a block pool is [2, blocks, block_size, heads, head_dim], got {tuple(pool.shape)}"
            )
        _, blocks, block_size, heads, dim = pool.shape
        return _flat_geometry(layout, blocks * block_size, heads, dim, heads * dim, blocks * block_size * heads * dim)
    if layout is Layout.BLOCK_HEAD_MAJOR:
        if pool.dim() != 5 or pool.shape[2] != 2:
            raise InvalidInputError(
                f"a head-major block pool is [blocks, heads, 2, block_size, head_dim], got {tuple(pool.shape)}"
            )
        if pool.device.type != "cpu":
            raise InvalidInputError("head-major block pools (vLLM's CPU backend) are supported on CPU pools only")
        blocks, heads, _, block_size, dim = pool.shape
        return PoolGeometry(layout, blocks * block_size, heads, dim, 0, block_size * dim, block_size=block_size)
    if pool.dim() == 3 and pool.shape[1] == 1:
        pool = pool.view(pool.shape[0], pool.shape[2])
    if pool.dim() != 2:
        raise InvalidInputError(
            f"an MLA pool is [slots, latent_dim], [slots, 1, latent_dim] or [blocks, 1, block_size, latent_dim], "
            f"got {tuple(pool.shape)}"
        )
    slots, dim = pool.shape
    return _flat_geometry(layout, slots, 1, dim, dim, 0, kv=1)


def _strided_geometry(pool: torch.Tensor, layout: Layout) -> PoolGeometry:
    """[blocks, heads, block_size, content] of any strides whose content is contiguous: K and
    V rows side by side (`BHNC`), or one latent (MLA, one head)."""
    mla = layout is Layout.MLA
    if pool.dim() != 4 or pool.stride(3) != 1 or (mla and pool.shape[1] != 1) or (not mla and pool.shape[3] % 2):
        what = "[blocks, 1, block_size, latent_dim]" if mla else "[blocks, heads, block_size, 2*head_dim]"
        raise InvalidInputError(
            f"a {layout.value} pool is {what} with each row's elements contiguous, got {tuple(pool.shape)} strides "
            f"{pool.stride()}"
        )
    blocks, heads, block_size, content = pool.shape
    block_stride, head_stride, token_stride, _ = pool.stride()
    dim = content if mla else content // 2
    return PoolGeometry(
        layout, blocks * block_size, heads, dim, token_stride, 0 if mla else dim, kv=1 if mla else 2,
        block_size=block_size, block_stride=block_stride, head_stride=head_stride,
    )  # fmt: skip


class PoolTable:
    """Every pool of a node: `pools[replica][copy][layer]`, all alike; registered once.

    `copy` is for MLA, where every card of a replica's group holds the same latents (one
    copy per card); other layouts have one copy per replica.
    """

    def __init__(
        self, pools: Sequence[Sequence[Sequence[torch.Tensor]]], layout: Layout, *, heads: slice | None = None
    ) -> None:
        if not pools or not pools[0] or not pools[0][0]:
            raise InvalidInputError("pools must name at least one replica, copy and layer")
        first = pools[0][0][0]
        self.layout = layout
        self.geometry = geometry(first, layout)
        self.first_head = _first_head(heads, self.geometry.heads)
        """The first of the model's KV heads the pools hold (`heads=`, a TP rank's share; 0 when
        not said): a landing call's `heads=` count in the model's numbering."""
        self.heads_said = heads is not None
        """Whether `heads=` was given: then a whole item of a producer that says which heads it
        holds lands at their place among the pools' heads."""
        self.dtype = first.dtype
        self.device = first.device
        self.replicas = len(pools)
        self.copies = len(pools[0])
        self.layers = len(pools[0][0])
        addresses = []
        for replica, copies in enumerate(pools):
            if len(copies) != self.copies or any(len(layers) != self.layers for layers in copies):
                raise InvalidInputError(f"replica {replica} has a different number of copies or layers")
            for layers in copies:
                for pool in layers:
                    if (
                        pool.shape != first.shape
                        or pool.stride() != first.stride()
                        or pool.dtype != first.dtype
                        or pool.device != first.device
                    ):
                        raise InvalidInputError(
                            f"every pool must match the first: {tuple(first.shape)} strides {first.stride()} "
                            f"{first.dtype} on {first.device}"
                        )
                    addresses.append(pool.data_ptr())
        self.pools = [[list(layers) for layers in copies] for copies in pools]
        self.address_alignment = next(w.itemsize for w in WORDS if all(a % w.itemsize == 0 for a in addresses))
        """The widest word (bytes) every pool's address is a multiple of (found once: a
        launch must not walk every pool)."""
        self.addresses = torch.tensor(addresses, dtype=torch.int64, device=self.device).view(
            self.replicas, self.copies, self.layers
        )
        self.host_addresses = np.array(addresses, dtype=np.int64).reshape(self.replicas, self.copies, self.layers)
        """`addresses` on the host, for transports that name the pools' memory themselves."""

    def staging_shape(self, tokens: int, heads: tuple[int, int]) -> tuple[int, ...]:
        return (self.layers, tokens, self.geometry.kv, heads[1] - heads[0], self.geometry.head_dim)


def _first_head(heads: object, count: int) -> int:
    if heads is None:
        return 0
    if (
        not isinstance(heads, slice)
        or not isinstance(heads.start, int)
        or not isinstance(heads.stop, int)
        or heads.step not in (None, 1)
        or heads.start < 0
        or heads.stop - heads.start != count
    ):
        raise InvalidInputError(
            f"heads must be None or slice(h0, h0 + {count}): the model's KV heads the pools' {count} heads are, "
            f"got {heads!r}"
        )
    return heads.start


def landing_ranges(
    table: PoolTable, replicas: np.ndarray, slots: np.ndarray, *, item_tokens: int, key_offset: int,
    value_offset: int,
) -> np.ndarray | None:  # fmt: skip
    """Where an item's K and V rows land in `table` for its first `len(slots)` tokens (token
    i at `slots[i]` of replica `replicas[i]`, every copy): int64 rows (pool address, offset
    in the item's payload, bytes), one per layer, copy, part (K, then V) and run of tokens.

    The item's key (and value) are [layers, item_tokens, heads, head_dim] of the pools' dtype
    and geometry, at `key_offset` (and `value_offset`) of its payload. A run is a stretch of
    tokens whose slots follow each other in one replica where the layout keeps one slot's
    rows right after the previous slot's (block and MLA pools: one row for a whole page, or
    more); token-major pools interleave each slot's K and V, so there a token is a run. None
    where a slot's rows are not contiguous at all (head-major blocks): the item must be
    scattered by a kernel. Indexes must be in range (`check_indices`)."""
    g = table.geometry
    if g.block_size != 1 or g.head_stride != g.head_dim:
        return None
    count = len(slots)
    if not count:
        return np.empty((0, 3), dtype=np.int64)
    slots, replicas = slots.astype(np.int64, copy=False), replicas.astype(np.int64, copy=False)
    itemsize = table.dtype.itemsize
    row = g.heads * g.head_dim
    if g.token_stride == row:
        breaks = np.flatnonzero((np.diff(slots) != 1) | (np.diff(replicas) != 0)) + 1
        starts = np.concatenate((np.zeros(1, dtype=np.int64), breaks))
    else:
        starts = np.arange(count, dtype=np.int64)
    lengths = np.diff(np.append(starts, count))
    layers = np.arange(table.layers, dtype=np.int64)
    parts = [(0, key_offset)] + ([(g.v_offset, value_offset)] if g.kv == 2 else [])
    bases = table.host_addresses[replicas[starts]].transpose(2, 1, 0)  # [layer, copy, run]
    rows = []
    for pool_offset, item_offset in parts:
        local = bases + ((pool_offset + slots[starts] * g.token_stride) * itemsize)[None, None, :]
        remote = item_offset + (layers[:, None] * item_tokens + starts[None, :]) * (row * itemsize)  # [layer, run]
        nbytes = (lengths * row * itemsize)[None, None, :]
        rows.append(np.stack(np.broadcast_arrays(local, remote[:, None, :], nbytes), axis=-1).reshape(-1, 3))
    return np.concatenate(rows)


PLAIN_RANGE_INDEXES: Final = 4096
"""Up to this many host indexes, their ranges are reduced as lists (past it, numpy is faster)."""


def index_ranges(table: PoolTable, replica: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """int64 [4] where the indexes are: the smallest and largest replica index, then slot
    (zeros when there are none). On the pools' device it is queued, not read (three small
    kernels): a caller can read it with other values in one round trip and pass it to
    `ranges_fit`. Indexes on the host (both of them) are reduced there: no round trip."""
    if _indexes_on_host(table, replica, slots):
        return torch.tensor(_host_ranges(replica, slots), dtype=torch.int64)
    if not slots.numel():
        return torch.zeros(4, dtype=torch.int64, device=slots.device)
    (replica_min, replica_max), (slot_min, slot_max) = torch.aminmax(replica), torch.aminmax(slots)
    return torch.stack([value.to(torch.int64) for value in (replica_min, replica_max, slot_min, slot_max)])


def _indexes_on_host(table: PoolTable, replica: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether both are on the host; refuses indexes that are not 1-D int32 or int64 tensors of
    one length, on the host or the pools' device."""
    on_host = replica.device.type == "cpu" and slots.device.type == "cpu"
    for name, index in (("replica", replica), ("slot", slots)):
        if index.dtype not in INDEX_DTYPES or index.dim() != 1 or not (on_host or index.device == table.device):
            raise InvalidInputError(
                f"{name} indexes must be a 1-D int32 or int64 tensor on {table.device} or on the host, got "
                f"{index.dtype} {tuple(index.shape)} on {index.device}"
            )
    if replica.shape != slots.shape:
        raise InvalidInputError(f"{replica.numel()} replica indexes for {slots.numel()} slots")
    return on_host


def _host_ranges(replica: torch.Tensor, slots: torch.Tensor) -> list[int]:
    """`index_ranges` of indexes on the host, as ints: a request's reduced as Python lists, many
    through numpy. With the caches cold, as between forward passes, numpy's reductions and a
    tensor of their results cost `check_indices` of 300 tokens ~125 us, this ~80 (the same ~25
    warm)."""
    if not slots.numel():
        return [0, 0, 0, 0]
    if slots.numel() <= PLAIN_RANGE_INDEXES:
        listed = [index.tolist() for index in (replica, slots)]
        return [reduce(values) for values in listed for reduce in (min, max)]
    return [int(reduce(index.numpy())) for index in (replica, slots) for reduce in (np.min, np.max)]


def ranges_fit(table: PoolTable, ranges: Sequence[int]) -> bool:
    """Whether `index_ranges`, read back, lie inside the pools."""
    replica_min, replica_max, slot_min, slot_max = (int(value) for value in ranges)
    return replica_min >= 0 and replica_max < table.replicas and slot_min >= 0 and slot_max < table.geometry.slots


def checked_indexes(table: PoolTable, replica: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`check_indices`, then the indexes on the pools' device, where the kernels read them:
    indexes on the host are checked there (no device round trip) and copied over on the
    current stream, without waiting for it."""
    check_indices(table, replica, slots)
    if table.device.type == "cuda" and slots.device.type == "cpu":
        return host_to_device(replica, table.device), host_to_device(slots, table.device)
    return replica, slots


def check_indices(table: PoolTable, replica: torch.Tensor, slots: torch.Tensor) -> None:
    """Refuse replica or slot indexes outside the pools, before anything is launched (one
    read back from the device when all are in range)."""
    if _indexes_on_host(table, replica, slots):
        ranges = _host_ranges(replica, slots)
    else:
        ranges = index_ranges(table, replica, slots).tolist()
    if ranges_fit(table, ranges):
        return
    for name, index, bound in (("replica", replica, table.replicas), ("slot", slots, table.geometry.slots)):
        outside = (index < 0) | (index >= bound)
        if bool(outside.any()):
            raise InvalidInputError(f"{name} index {index[outside][0].item()} is out of range [0, {bound})")


def per_token(replica: torch.Tensor | int, slots: torch.Tensor) -> torch.Tensor:
    """Per-token replica indexes, from one replica for every token or a tensor of them."""
    if not isinstance(slots, torch.Tensor):
        raise InvalidInputError(f"slots must be a 1-D int32 or int64 tensor, got {type(slots).__name__}")
    return torch.full_like(slots, replica) if isinstance(replica, int) else replica
