"""A 64-bit checksum of a tensor's bytes computed where they lie, on the GPU, at memory speed.

`kvrt._checksum` hashes an item in host memory with XXH3-64, whose lanes depend on each
other: a GPU would read its bytes in one sequential chain. This checksum is a sum of words
mixed one by one, so any number of programs each sum a share and their sums add up in any
order, to the same value.

The definition (all arithmetic modulo 2**64; `n` bytes, `seed` in [0, 2**64)):

    w[i]   = bytes [8i, 8i + 8) read as a little-endian unsigned 64-bit word, the last one
             zero-padded when n is not a multiple of 8; i in [0, ceil(n / 8))
    mix(x) = splitmix64's output function (Stafford's Mix13):
                 x ^= x >> 30;  x *= 0xBF58476D1CE4E5B9
                 x ^= x >> 27;  x *= 0x94D049BB133111EB
                 x ^= x >> 31                                   (>> is a logical shift)
    S      = sum over i of mix(w[i] + seed + (i + 1) * 0x9E3779B97F4A7C15)
    result = mix(S ^ (seed + 0x9E3779B97F4A7C15 + n * 0xC2B2AE3D27D4EB4F))

What it guarantees, and why:
- Every change to one word (so every single-bit flip) changes the result: for a fixed index
  and seed, a word's term is a bijection of the word (an addition, xor-shifts, odd
  multiplies), so its term and with it S change, and the final mix is a bijection of S.
- The same words under another length (a zero tail, `n` and `n + 1` bytes of which the last
  is 0) change the result: `n * 0xC2B2...` is a bijection of `n` (an odd multiplier), and so
  is the xor into S. Two different lengths whose word counts differ add a word's term too.
- The term of a word depends on its index: two different words swapped change S unless
  their four terms happen to cancel (as likely as any other 64-bit collision).
- The seed enters every term and the final step: `seed` domain-separates checksums.

It is an error-detecting checksum, not a MAC: anyone can forge a sum.

`checksum` runs the Triton kernel on a contiguous CUDA tensor (and on CPU tensors under
`TRITON_INTERPRET=1`, as the tests run it) and waits for its result; `queue_checksum` only
queues it, on the current stream, and its `result()` reads it later. `checksum_reference`
computes the same value in plain torch on any device, vectorised (it also checks on the host
an item that a GPU checksummed). `checksum_blocks` is the checksum of blocks of a paged pool
taken in a given order, as if they had been gathered first (`checksum_blocks_reference`
beside it). `kvrt bench checksum` times the kernel beside `torch.sum` of the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import triton
import triton.language as tl

from kvrt._errors import InvalidInputError

_GOLDEN: Final = 0x9E3779B97F4A7C15
"""2**64 / golden ratio, odd: the step between consecutive words' keys (splitmix64's)."""
_MIX_1: Final = 0xBF58476D1CE4E5B9
_MIX_2: Final = 0x94D049BB133111EB
_LENGTH: Final = 0xC2B2AE3D27D4EB4F
"""Odd, so that distinct lengths give distinct final inputs (xxHash's PRIME64_2)."""
# The same constants as the kernels read them (a Triton kernel reads globals only as constexpr).
_GOLDEN_K = tl.constexpr(_GOLDEN)
_MIX_1_K = tl.constexpr(_MIX_1)
_MIX_2_K = tl.constexpr(_MIX_2)
_WORD_MASK: Final = (1 << 64) - 1
_WORD_BYTES: Final = 8


@dataclass(frozen=True, slots=True)
class Tuning:
    """Launch shape. A program sums one chunk of `tiles_per_program` tiles of `block_words`
    words (a power of two), their loads independent of each other so that they are in flight
    together, in registers; fewer tiles per program when that leaves fewer than
    `programs_per_sm` programs per streaming multiprocessor. `kvrt bench checksum` sweeps a
    few shapes on a GPU."""

    block_words: int = 2048
    tiles_per_program: int = 8
    warps: int = 8
    programs_per_sm: int = 4


DEFAULT_TUNING = Tuning()
_SUM_SLOTS: Final = 32
"""Programs add their sums atomically into this many slots (program % slots), read back and
added on the host: fewer programs contend for one address than with a single sum."""
_INTERPRETED_SMS: Final = 1
"""What `Tuning.programs_per_sm` multiplies under TRITON_INTERPRET=1, with no SMs to count."""
_REFERENCE_CHUNK_WORDS: Final = 1 << 20
"""Words the torch reference mixes at a time (8 MiB and a few temporaries of that size)."""


@triton.jit
def _mix(x):  # type: ignore[no-untyped-def]  # a Triton function: its types are Triton's
    """splitmix64's output function on uint64 (a bijection; `>>` of uint64 is logical)."""
    x = (x ^ (x >> 30)) * _MIX_1_K
    x = (x ^ (x >> 27)) * _MIX_2_K
    return x ^ (x >> 31)


@triton.jit
def _byte_words(raw, words, byte_count):  # type: ignore[no-untyped-def]  # a Triton function
    """Words `words` assembled from their bytes (little-endian), those at or past byte
    `byte_count` read as 0: any alignment and a partial last word."""
    at = words[:, None] * 8 + tl.arange(0, 8)[None, :]
    octets = tl.load(raw + at, mask=at < byte_count, other=0).to(tl.uint64)
    shifts = (tl.arange(0, 8) * 8).to(tl.uint64)
    return tl.sum(octets << shifts[None, :], axis=1)


# `first_key` carries the seed. Annotated int64, Triton neither types it int32 when it fits nor
# specializes on its value (1, multiples of 16): one compiled variant serves every seed, and
# likewise every length (`word_count`, `byte_count`).
@triton.jit  # type: ignore[untyped-decorator]
def _sum_words(  # type: ignore[no-untyped-def]  # Triton reads its own annotations (constexpr)
    words,  # int64 words of the input (its uint8 bytes when BYTES)
    raw,  # uint8: the input's bytes
    sums,  # int64 [SLOTS]: sums of terms, added to atomically
    word_count: tl.int64,  # ceil(byte_count / 8)
    byte_count: tl.int64,
    first_key: tl.int64,  # seed + GOLDEN mod 2**64 (the key of word 0), as a signed 64-bit value
    BLOCK: tl.constexpr,  # words per tile: a power of two
    TILES: tl.constexpr,  # tiles per program
    BYTES: tl.constexpr,  # the input is not 8-byte aligned: load bytes and assemble words
    SLOTS: tl.constexpr,
):
    """Program p sums the terms of words [p, p + 1) x BLOCK x TILES: unmasked when they are
    all whole words; else (the last program) from bytes, masked (its last word may be partial)."""
    program = tl.program_id(0).to(tl.int64)
    chunk = program * (BLOCK * TILES)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    keys = first_key.to(tl.uint64) + (chunk + lanes).to(tl.uint64) * _GOLDEN_K
    tile_keys = tl.full([BLOCK], BLOCK, tl.uint64) * _GOLDEN_K  # from a word's key to the next tile's
    total = tl.zeros([BLOCK], dtype=tl.uint64)
    if chunk + BLOCK * TILES <= byte_count // 8:
        for tile in tl.static_range(TILES):
            offsets = chunk + tile * BLOCK + lanes
            if BYTES:  # noqa: SIM108 (a static branch: Triton folds it at compile time)
                w = _byte_words(raw, offsets, byte_count)
            else:
                w = tl.load(words + offsets).to(tl.uint64, bitcast=True)
            total += _mix(w + keys)
            keys += tile_keys
    else:
        for tile in tl.static_range(TILES):
            offsets = chunk + tile * BLOCK + lanes
            term = _mix(_byte_words(raw, offsets, byte_count) + keys)
            total += tl.where(offsets < word_count, term, 0)
            keys += tile_keys
    tl.atomic_add(sums + program % SLOTS, tl.sum(total).to(tl.int64, bitcast=True))


@triton.jit  # type: ignore[untyped-decorator]
def _sum_blocks(  # type: ignore[no-untyped-def]  # Triton reads its own annotations (constexpr)
    base,  # int64 words of the pool
    block_ids,  # int32 or int64 [blocks]: which pool block comes k-th
    sums,  # int64 [SLOTS + 1]: sums of terms, then the count of ids outside the pool
    pool_blocks,  # ids outside [0, pool_blocks) are counted, not read
    block_words,
    first_key: tl.int64,  # seed + GOLDEN mod 2**64, as a signed 64-bit value
    BLOCK: tl.constexpr,  # words per tile: a power of two
    TILES: tl.constexpr,  # tiles per program
    EVEN: tl.constexpr,  # block_words % (BLOCK * TILES) == 0: no tile needs a mask
    SLOTS: tl.constexpr,
):
    """Program (k, c) sums chunk c (TILES tiles of BLOCK words) of the k-th block named; word r
    of that block is word k * block_words + r of the blocks laid end to end."""
    k = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64) * (BLOCK * TILES)
    slot = (k * tl.num_programs(1) + tl.program_id(1)) % SLOTS
    block = tl.load(block_ids + k).to(tl.int64)
    if (block >= 0) & (block < pool_blocks):
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        first = first_key.to(tl.uint64)
        keys = first + (k * block_words + chunk + lanes).to(tl.uint64) * _GOLDEN_K
        tile_keys = tl.full([BLOCK], BLOCK, tl.uint64) * _GOLDEN_K
        words = base + block * block_words
        total = tl.zeros([BLOCK], dtype=tl.uint64)
        for tile in tl.static_range(TILES):
            offsets = chunk + tile * BLOCK + lanes
            if EVEN:
                total += _mix(tl.load(words + offsets).to(tl.uint64, bitcast=True) + keys)
            else:
                in_block = offsets < block_words
                w = tl.load(words + offsets, mask=in_block, other=0).to(tl.uint64, bitcast=True)
                total += tl.where(in_block, _mix(w + keys), 0)
            keys += tile_keys
        tl.atomic_add(sums + slot, tl.sum(total).to(tl.int64, bitcast=True))
    else:
        tl.atomic_add(sums + SLOTS, 1)


@dataclass(frozen=True, slots=True)
class QueuedChecksum:
    """A checksum kernel queued on a stream, its sums not read yet. `result` reads them back
    (one small device-to-host copy on that stream: it waits for the kernel) and finishes the
    checksum; a caller that must not block calls it where it may wait, from any thread."""

    sums: torch.Tensor
    """int64 [slots]: sums of terms modulo 2**64; for blocks, one more: the ids outside the pool."""
    byte_count: int
    seed: int
    pool_blocks: int | None = None
    """For a blocks checksum: blocks in the pool (to name them when an id lies outside)."""
    stream: torch.cuda.Stream | None = None
    """The stream the kernel was queued on (None on the host, under the interpreter)."""

    def result(self) -> int:
        if self.stream is None:
            values = self.sums.cpu().tolist()
        else:
            with torch.cuda.stream(self.stream):  # after the kernel, whichever thread reads
                values = self.sums.cpu().tolist()
        if self.pool_blocks is not None and values.pop():
            raise InvalidInputError(f"a block id lies outside the pool's {self.pool_blocks} blocks")
        return _finish(sum(values), self.byte_count, self.seed)


def checksum(data: torch.Tensor, seed: int = 0, *, tuning: Tuning = DEFAULT_TUNING) -> int:
    """The checksum (module docstring) of `data`'s bytes: a contiguous tensor of any dtype on
    a CUDA device. Queued on the current stream; waits for it to read the result back."""
    return queue_checksum(data, seed, tuning=tuning).result()


def queue_checksum(data: torch.Tensor, seed: int = 0, *, tuning: Tuning = DEFAULT_TUNING) -> QueuedChecksum:
    """`checksum`, queued on the current stream and not waited for."""
    _check_seed(seed)
    _check_device(data)
    if not data.is_contiguous():
        raise InvalidInputError(f"checksum needs a contiguous tensor, got strides {data.stride()}")
    raw = data.reshape(-1).view(torch.uint8)
    byte_count = raw.numel()
    if byte_count == 0:
        return QueuedChecksum(torch.zeros(1, dtype=torch.int64), 0, seed)  # nothing to read: no launch
    sums = torch.zeros(_SUM_SLOTS, dtype=torch.int64, device=data.device)
    word_count = -(-byte_count // _WORD_BYTES)
    block, tiles = _chunk_shape(word_count, 1, data.device, tuning)
    # A view that starts off an 8-byte boundary cannot be read as 64-bit words: the kernel
    # then loads bytes and assembles the words from them (slower, and rare: an allocation is
    # aligned, and KV views start at whole rows).
    unaligned = raw.data_ptr() % _WORD_BYTES != 0
    words = raw if unaligned else raw[: byte_count // _WORD_BYTES * _WORD_BYTES].view(torch.int64)
    launch: Any = _sum_words[(-(-word_count // (block * tiles)),)]  # Triton's launcher is untyped
    launch(
        words, raw, sums, word_count, byte_count, _signed(seed + _GOLDEN),
        BLOCK=block, TILES=tiles, BYTES=unaligned, SLOTS=_SUM_SLOTS, num_warps=tuning.warps,
    )  # fmt: skip
    return QueuedChecksum(sums, byte_count, seed, stream=_current_stream(data.device))


def queue_checksums_after(
    tensors: Sequence[torch.Tensor], seed: int, stream: torch.cuda.Stream, after: torch.cuda.Event | None
) -> Callable[[], list[int]]:
    """`queue_checksum` of each of `tensors` (contiguous, on `stream`'s device) with `seed`,
    queued on `stream` once `after` fired; each tensor's memory is kept from reuse until its
    kernel ran. What it returns reads their results, in order, waiting for the GPU (a stream's
    layer checked where it was written, or where it landed)."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        for tensor in tensors:
            tensor.record_stream(stream)
        queued = [queue_checksum(tensor, seed) for tensor in tensors]
    return lambda: [sums.result() for sums in queued]


def checksum_blocks(
    base: torch.Tensor, block_ids: torch.Tensor, block_bytes: int, seed: int = 0, *, tuning: Tuning = DEFAULT_TUNING
) -> int:
    """The checksum of the blocks of `base`'s bytes (a contiguous tensor on a CUDA device, cut
    in blocks of `block_bytes`) that `block_ids` (int32 or int64, on `base`'s device or the
    host) names, in that order: the same value as `checksum` of their concatenation, without
    gathering them. `block_bytes` must be a multiple of 8 (a word never spans two blocks).
    Waits for the current stream to read the result back."""
    return queue_checksum_blocks(base, block_ids, block_bytes, seed, tuning=tuning).result()


def queue_checksum_blocks(
    base: torch.Tensor, block_ids: torch.Tensor, block_bytes: int, seed: int = 0, *, tuning: Tuning = DEFAULT_TUNING
) -> QueuedChecksum:
    """`checksum_blocks`, queued on the current stream and not waited for; an id outside the
    pool raises when the result is read."""
    _check_seed(seed)
    _check_device(base)
    pool_blocks = _check_blocks(base, block_ids, block_bytes)
    ids = block_ids.reshape(-1).to(base.device)
    byte_count = ids.numel() * block_bytes
    if byte_count == 0:
        return QueuedChecksum(torch.zeros(2, dtype=torch.int64), 0, seed, pool_blocks)  # no launch
    raw = base.reshape(-1).view(torch.uint8)
    if raw.data_ptr() % _WORD_BYTES != 0:
        # A pool's allocation is aligned; a view that starts off an 8-byte boundary is
        # checksummed by the reference on its device instead (it gathers the blocks).
        total = _blocks_sum_of_terms(base, block_ids, block_bytes, pool_blocks, seed)
        return QueuedChecksum(torch.tensor([_signed(total), 0]), byte_count, seed, pool_blocks)
    sums = torch.zeros(_SUM_SLOTS + 1, dtype=torch.int64, device=base.device)
    block_words = block_bytes // _WORD_BYTES
    block, tiles = _chunk_shape(block_words, ids.numel(), base.device, tuning)
    chunks = -(-block_words // (block * tiles))
    launch: Any = _sum_blocks[(ids.numel(), chunks)]  # Triton's launcher is untyped
    launch(
        raw[: pool_blocks * block_bytes].view(torch.int64), ids, sums, pool_blocks, block_words,
        _signed(seed + _GOLDEN), BLOCK=block, TILES=tiles, EVEN=block_words % (block * tiles) == 0,
        SLOTS=_SUM_SLOTS, num_warps=tuning.warps,
    )  # fmt: skip
    return QueuedChecksum(sums, byte_count, seed, pool_blocks, _current_stream(base.device))


def _chunk_shape(words: int, streams: int, device: torch.device, tuning: Tuning) -> tuple[int, int]:
    """Words per tile and tiles per program for `streams` runs of `words` words each: the
    tuning's, or one tile per program where that many would not fill the GPU. Two shapes
    only, so that a process compiles each kernel twice at most (`warm_up` does it ahead of the
    first item: a compilation takes about a second)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _INTERPRETED_SMS
    programs = streams * -(-words // (tuning.block_words * tuning.tiles_per_program))
    return tuning.block_words, tuning.tiles_per_program if programs >= sms * tuning.programs_per_sm else 1


def warm_up(device: torch.device, *, tuning: Tuning = DEFAULT_TUNING) -> None:
    """Compile `checksum`'s kernel for both of its launch shapes on `device` (a CUDA device),
    and wait for it: a producer that checksums does this before it serves, so that no
    delivery's header waits for a compilation."""
    with torch.cuda.device(device):  # Triton launches on the current device, whichever thread this is
        raw = torch.zeros(_WORD_BYTES, dtype=torch.uint8, device=device)
        sums = torch.zeros(_SUM_SLOTS, dtype=torch.int64, device=device)
        for tiles in {1, tuning.tiles_per_program}:
            launch: Any = _sum_words[(1,)]  # Triton's launcher is untyped
            launch(
                raw.view(torch.int64), raw, sums, 1, _WORD_BYTES, 0,
                BLOCK=tuning.block_words, TILES=tiles, BYTES=False, SLOTS=_SUM_SLOTS, num_warps=tuning.warps,
            )  # fmt: skip
        torch.cuda.synchronize(device)


def checksum_reference(data: torch.Tensor, seed: int = 0) -> int:
    """`checksum` in plain torch, on a contiguous tensor on any device (the same value, bit
    for bit). Vectorised over chunks of words: it checks an item that landed in host memory."""
    _check_seed(seed)
    if not data.is_contiguous():
        raise InvalidInputError(f"checksum needs a contiguous tensor, got strides {data.stride()}")
    raw = data.reshape(-1).view(torch.uint8)
    return _finish(_sum_of_terms(raw, 0, seed), raw.numel(), seed)


def checksum_blocks_reference(base: torch.Tensor, block_ids: torch.Tensor, block_bytes: int, seed: int = 0) -> int:
    """`checksum_blocks` in plain torch, on any device: gathers a chunk of blocks at a time."""
    _check_seed(seed)
    pool_blocks = _check_blocks(base, block_ids, block_bytes)
    total = _blocks_sum_of_terms(base, block_ids, block_bytes, pool_blocks, seed)
    return _finish(total, block_ids.numel() * block_bytes, seed)


def _blocks_sum_of_terms(
    base: torch.Tensor, block_ids: torch.Tensor, block_bytes: int, pool_blocks: int, seed: int
) -> int:
    ids = block_ids.reshape(-1).to(device=base.device, dtype=torch.int64)
    if ids.numel() and not bool(((ids >= 0) & (ids < pool_blocks)).all()):
        raise InvalidInputError(f"a block id lies outside the pool's {pool_blocks} blocks")
    pool = base.reshape(-1).view(torch.uint8)[: pool_blocks * block_bytes].view(pool_blocks, block_bytes)
    per_chunk = max(1, _REFERENCE_CHUNK_WORDS * _WORD_BYTES // block_bytes)
    total = 0
    for first in range(0, ids.numel(), per_chunk):
        gathered = pool.index_select(0, ids[first : first + per_chunk]).view(-1)
        total += _sum_of_terms(gathered, first * block_bytes // _WORD_BYTES, seed)
    return total


def _sum_of_terms(raw: torch.Tensor, first_index: int, seed: int) -> int:
    """S of the module docstring over the words of `raw` (contiguous uint8), numbered from
    `first_index`, as a Python int (not reduced). torch's int64 arithmetic wraps (two's
    complement), so it computes modulo 2**64; its `>>` is arithmetic, masked to a logical one."""
    byte_count = raw.numel()
    full_words = byte_count // _WORD_BYTES
    whole = raw[: full_words * _WORD_BYTES]
    if whole.storage_offset() % _WORD_BYTES:
        whole = whole.clone()  # torch views as int64 only from an 8-byte offset
    words = whole.view(torch.int64)
    chunk = max(1, min(_REFERENCE_CHUNK_WORDS, full_words))
    lane_keys = torch.arange(chunk, dtype=torch.int64, device=raw.device) * _signed(_GOLDEN)
    total = 0
    for start in range(0, full_words, chunk):
        part = words[start : start + chunk]
        terms = lane_keys[: part.numel()] + _signed(seed + (first_index + start + 1) * _GOLDEN)
        terms += part
        _mix_in_place(terms)
        total += int(terms.sum())  # int64 sums wrap too: each chunk's sum is right modulo 2**64
    tail = raw[full_words * _WORD_BYTES :]
    if tail.numel():
        word = int.from_bytes(bytes(tail.cpu().tolist()), "little")
        total += _mix_int(word + seed + (first_index + full_words + 1) * _GOLDEN)
    return total


def _mix_in_place(x: torch.Tensor) -> None:
    """`mix` of the module docstring on int64 words holding uint64 bits."""
    _xor_shift(x, 30)
    x.mul_(_signed(_MIX_1))
    _xor_shift(x, 27)
    x.mul_(_signed(_MIX_2))
    _xor_shift(x, 31)


def _xor_shift(x: torch.Tensor, bits: int) -> None:
    x.bitwise_xor_(torch.bitwise_right_shift(x, bits).bitwise_and_((1 << (64 - bits)) - 1))


def _mix_int(value: int) -> int:
    x = value & _WORD_MASK
    x = ((x ^ (x >> 30)) * _MIX_1) & _WORD_MASK
    x = ((x ^ (x >> 27)) * _MIX_2) & _WORD_MASK
    return x ^ (x >> 31)


def _finish(total: int, byte_count: int, seed: int) -> int:
    return _mix_int((total & _WORD_MASK) ^ ((seed + _GOLDEN + byte_count * _LENGTH) & _WORD_MASK))


def _signed(value: int) -> int:
    """`value` modulo 2**64 as the int64 with those bits (torch and Triton take int64 scalars)."""
    value &= _WORD_MASK
    return value - (1 << 64) if value >> 63 else value


def _current_stream(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _check_seed(seed: int) -> None:
    if not isinstance(seed, int) or not 0 <= seed <= _WORD_MASK:
        raise InvalidInputError(f"a checksum seed is an int in [0, 2**64), got {seed!r}")


def _check_device(data: torch.Tensor) -> None:
    if data.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidInputError(
            f"the checksum kernel reads a CUDA tensor, not one on {data.device} (checksum_reference hashes it there)"
        )


def _check_blocks(base: torch.Tensor, block_ids: torch.Tensor, block_bytes: int) -> int:
    """Blocks in the pool, once the arguments are usable."""
    if not base.is_contiguous():
        raise InvalidInputError(f"a pool to checksum blocks of must be contiguous, got strides {base.stride()}")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise InvalidInputError(f"block ids are int32 or int64, got {block_ids.dtype}")
    if block_bytes <= 0 or block_bytes % _WORD_BYTES:
        raise InvalidInputError(
            f"block_bytes must be a positive multiple of {_WORD_BYTES} (a word never spans two blocks), "
            f"got {block_bytes}"
        )
    return base.numel() * base.element_size() // block_bytes
