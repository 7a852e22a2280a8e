"""Items' records for the protocol core's tests, made without torch: the metas an item of these
tokens and KV shape has when the producer's driver packs it (`kvrt._sizes.packed_layout`). The
core keeps records only; what their bytes hold is no business of its."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvrt._errors import InvalidInputError
from kvrt._messages import TensorMeta
from kvrt._protocol.lookup_buffer import BufferedItem, StreamRecord
from kvrt._protocol.waiting import PieceAsked
from kvrt._sizes import meta_nbytes, packed_layout

TOKENS_DTYPE = "int64"


def item_record(
    item_id: int, seq: int, tokens: Sequence[int], *, layers: int = 1, heads: int = 1, head_dim: int = 2,
    dtype: str = "float16", hidden: int | None = None,
) -> BufferedItem:  # fmt: skip
    """A whole item's record: key and value [layers, tokens, heads, head_dim] of `dtype`, hidden
    states [tokens, hidden] if `hidden`."""
    kv = ([layers, len(tokens), heads, head_dim], dtype)
    hidden_spec = None if hidden is None else ([len(tokens), hidden], dtype)
    layout = packed_layout([([len(tokens)], TOKENS_DTYPE), None, kv, kv, hidden_spec])
    return BufferedItem(item_id, seq, np.array(tokens, dtype=np.int64), layout.metas, layout.nbytes)


def stream_record(item_id: int, seq: int, tokens: Sequence[int], *, layers: int) -> BufferedItem:
    """An open stream's record: its tokens packed, its `layers` layers to come."""
    layout = packed_layout([([len(tokens)], TOKENS_DTYPE), None])
    masked, metas = np.array(tokens, dtype=np.int64), (*layout.metas, None, None, None)
    return BufferedItem(item_id, seq, masked, metas, layout.nbytes, stream=StreamRecord(layers))


def layer_meta(item: BufferedItem, *, heads: int = 1, head_dim: int = 2, dtype: str = "float16") -> TensorMeta:
    """A stream's layer [tokens, heads, head_dim], as it travels on its own."""
    return TensorMeta(dtype=dtype, shape=[len(item.masked_tokens), heads, head_dim])


def whole_of(stream: BufferedItem, layer: TensorMeta) -> BufferedItem:
    """A finished stream's whole item (same id and age), its layers stacked."""
    assert stream.stream is not None
    return item_record(
        stream.item_id, stream.seq, stream.masked_tokens.tolist(), layers=stream.stream.layers, heads=layer.shape[1],
        head_dim=layer.shape[2], dtype=layer.dtype,
    )  # fmt: skip


def piece_record(item: BufferedItem, asked: PieceAsked, item_id: int) -> BufferedItem:
    """A piece's record, as the driver cuts it (`kvrt._heads.piece_of`): the heads asked for
    (every head of a latent), the hidden states if asked."""
    tokens, roi, key, value, hidden = item.metas
    assert tokens is not None and key is not None and value is not None
    latent = meta_nbytes(value) == 0
    first, end = (0, key.shape[2]) if latent else (asked.heads.first, asked.heads.end)
    if end > key.shape[2]:
        raise InvalidInputError(f"heads [{first}, {end}) asked of an item with {key.shape[2]} KV heads")
    sliced = [*key.shape[:2], end - first, key.shape[3]]
    layout = packed_layout([
        (tokens.shape, tokens.dtype), None if roi is None else (roi.shape, roi.dtype), (sliced, key.dtype),
        (value.shape if latent else [*sliced[:3], value.shape[3]], value.dtype),
        None if hidden is None or not asked.hidden else (hidden.shape, hidden.dtype),
    ])  # fmt: skip
    return BufferedItem(item_id, item.seq, item.masked_tokens, layout.metas, layout.nbytes)
