"""The layer-copy kernel (a layer's K and V into a block of their own) against its torch
reference, bit for bit, from views whose tokens lie apart (columns of a wider output) and
from contiguous tensors. On CPU under TRITON_INTERPRET=1; the block is poisoned first."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.kernels.layer_copy import PreparedCopy, copy_layer, copy_layer_reference, rows_contiguous
from tests._checks import same_bits
from tests.conftest import KERNEL_DEVICE, TRITON_KERNEL_MARKS

pytestmark = TRITON_KERNEL_MARKS
DEVICE = KERNEL_DEVICE
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.bool]


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    count = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (count,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(shape).to(DEVICE)


def poisoned_block(tokens: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    count = 2 * tokens * heads * dim * dtype.itemsize
    return (
        torch.full((count,), 1 if dtype == torch.bool else 0xA5, dtype=torch.uint8, device=DEVICE)
        .view(dtype)
        .view(2, tokens, heads, dim)
    )


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(0, 9), heads=st.integers(1, 4), dim=st.sampled_from([1, 2, 3, 8, 64]),
    extra=st.integers(0, 5), shift=st.integers(0, 3), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_columns_of_a_wider_output_are_copied_bit_for_bit(
    tokens: int, heads: int, dim: int, extra: int, shift: int, dtype: torch.dtype, seed: int
) -> None:
    """K and V as columns of one projection output [tokens, shift + 2*H*D + extra], as a prefill
    hands them over; `shift` moves them off the widest word."""
    row = heads * dim
    out = random_bytes((tokens, shift + 2 * row + extra), dtype, seed)
    key = out[:, shift : shift + row].view(tokens, heads, dim)
    value = out[:, shift + row : shift + 2 * row].view(tokens, heads, dim)
    assert rows_contiguous(key) and rows_contiguous(value)
    block = poisoned_block(tokens, heads, dim, dtype)
    expected = poisoned_block(tokens, heads, dim, dtype)
    copy_layer(block, key, value)
    copy_layer_reference(expected, key, value)
    assert same_bits(block, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_contiguous_key_and_value_are_copied_bit_for_bit(dtype: torch.dtype) -> None:
    key, value = random_bytes((5, 2, 8), dtype, 1), random_bytes((5, 2, 8), dtype, 2)
    block = poisoned_block(5, 2, 8, dtype)
    copy_layer(block, key, value)
    assert same_bits(block[0], key) and same_bits(block[1], value)


def test_rows_that_are_not_contiguous_are_told_apart() -> None:
    tensor = torch.zeros(4, 3, 8)
    assert rows_contiguous(tensor) and rows_contiguous(tensor[::2])
    assert not rows_contiguous(tensor.transpose(0, 1).contiguous().transpose(0, 1))
    assert not rows_contiguous(tensor[:, :, ::2])


def test_a_prepared_copy_knows_whether_its_kernel_was_launched() -> None:
    # A row of 7 float64 (56 bytes): a specialization no other test launches, so it starts uncompiled.
    key, value = (torch.ones(3, 1, 7, dtype=torch.float64, device=DEVICE) for _ in range(2))
    block = torch.zeros(2, 3, 1, 7, dtype=torch.float64, device=DEVICE)
    prepared = PreparedCopy(block, key, value)
    assert not prepared.compiled
    prepared.launch()
    assert prepared.compiled and PreparedCopy(block, key, value).compiled
    assert torch.equal(block, torch.ones_like(block))
