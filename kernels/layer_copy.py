"""Copy one layer's K and V into a block of their own, [2, tokens, heads, head_dim], in one launch.

A prefill hands `put_layer` its K and V as views: often columns of a wider projection output
(`out[:, :H*D]`), whose tokens lie a whole row of that output apart. torch copies such a view
element by element (its strided path, `kvrt bench kernels` times it), and that copy shares
the GPU with the sends of the layers before. Each token's heads x head_dim are contiguous in
such views, so one program moves one token's row as words (8, 4, 2 or 1 bytes, the widest
every address and stride allows), as `paged_kv` does.

`copy_layer_reference` is the plain-torch reference the tests compare against, bit for bit,
under `TRITON_INTERPRET=1` on CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
_BLOCK_WORDS = 1024
"""Words of a row moved per step, at most (8 KiB of 8-byte words)."""


@triton.jit  # type: ignore[untyped-decorator]
def _copy_rows(  # type: ignore[no-untyped-def]  # Triton reads its own annotations (constexpr)
    key,  # words: where token 0's K row starts
    value,  # words: where token 0's V row starts
    block,  # words: [2, tokens, row]
    key_stride,  # words between tokens' K rows
    value_stride,  # words between tokens' V rows
    tokens,
    ROW: tl.constexpr,  # words of a row (heads x head_dim)
    BLOCK: tl.constexpr,  # words per step: a power of two
):
    """One program moves one token's K row and V row; a step loads both before it stores
    either (twice the bytes in flight, as in `paged_kv._move_kv`)."""
    token = tl.program_id(0).to(tl.int64)
    key_row = key + token * key_stride
    value_row = value + token * value_stride
    out_key = block + token * ROW
    out_value = block + (tokens + token) * ROW
    for start in tl.static_range(0, ROW, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        if ROW % BLOCK == 0:  # noqa: SIM108 (a static branch: Triton folds it at compile time)
            mask = None
        else:
            mask = offsets < ROW
        k = tl.load(key_row + offsets, mask=mask)
        v = tl.load(value_row + offsets, mask=mask)
        tl.store(out_key + offsets, k, mask=mask)
        tl.store(out_value + offsets, v, mask=mask)


def rows_contiguous(tensor: torch.Tensor) -> bool:
    """Whether each token's [heads, head_dim] of a [tokens, heads, head_dim] tensor lies
    contiguous (its tokens may lie any whole number of elements apart)."""
    _, heads, dim = tensor.shape
    return (heads == 1 or tensor.stride(1) == dim) and (dim == 1 or tensor.stride(2) == 1)


class PreparedCopy:
    """A `copy_layer` launch with its arguments worked out, not yet queued: a caller on an event
    loop asks whether it would compile first (`compiled`: a first launch compiles, for about a
    second), then `launch`es it where it may wait that long."""

    __slots__ = ("_args", "_constants", "_grid", "_key")
    _args: tuple[Any, ...]
    _constants: dict[str, int]
    _grid: tuple[int] | None
    _key: tuple[object, ...]

    def __init__(self, block: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        _, tokens, heads, dim = block.shape
        itemsize = block.dtype.itemsize
        row_bytes = heads * dim * itemsize
        byte_values = [
            row_bytes, key.stride(0) * itemsize, value.stride(0) * itemsize,
            key.data_ptr(), value.data_ptr(), block.data_ptr(),
        ]  # fmt: skip
        word = next(w for w in _WORDS if all(v % w.itemsize == 0 for v in byte_values))
        size = word.itemsize
        row = row_bytes // size
        self._grid = (tokens,) if tokens and row else None
        if self._grid is None:  # nothing to move (a view of no tokens may point past its storage)
            self._args, self._constants, self._key = (), {}, ()
            return
        ints = (key.stride(0) * itemsize // size, value.stride(0) * itemsize // size, tokens)
        self._args = (_words(key, word), _words(value, word), block.view(-1).view(word), *ints)
        self._constants = {"ROW": row, "BLOCK": min(_BLOCK_WORDS, triton.next_power_of_2(max(1, row)))}
        # What Triton specializes a compiled kernel on (as of 3.x): each pointer's 16-byte
        # alignment, each int's being 1 or a multiple of 16, the constants.
        self._key = (
            word,
            *(address % 16 == 0 for address in byte_values[3:]),
            *((value == 1, value % 16 == 0) for value in ints),
            tuple(sorted(self._constants.items())),
        )

    @property
    def compiled(self) -> bool:
        return self._grid is None or self._key in _LAUNCHED

    def launch(self) -> None:
        """Queue the copy on the current stream."""
        if self._grid is None:
            return
        launch: Any = _copy_rows[self._grid]  # Triton's launcher is untyped
        launch(*self._args, **self._constants)
        _LAUNCHED.add(self._key)


_LAUNCHED: set[tuple[object, ...]] = set()


def copy_layer(block: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """`block[0] = key; block[1] = value` in one launch, queued on the current stream. `block` is
    a contiguous [2, tokens, heads, head_dim]; `key` and `value` match one half of it, on its
    device, each token's row contiguous (`rows_contiguous`)."""
    PreparedCopy(block, key, value).launch()


def _words(rows: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """`rows` as a flat tensor of words from its first element to its last (its strides' gaps
    included): the kernel indexes it by token stride."""
    tokens, heads, dim = rows.shape
    span = max(0, (tokens - 1) * rows.stride(0) + heads * dim)
    return torch.as_strided(rows, (span,), (1,)).view(torch.uint8).view(word)


def copy_layer_reference(block: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    block[0].copy_(key)
    block[1].copy_(value)
