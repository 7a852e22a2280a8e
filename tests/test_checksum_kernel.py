"""The GPU checksum of an item's bytes (`kvrt.kernels.checksum`): the Triton kernel against its
torch reference, bit for bit (on CPU under TRITON_INTERPRET=1), the reference against the
definition in the module's docstring, and the changes the checksum must detect. Large inputs
go through the reference only: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

from kvrt._errors import InvalidInputError
from kvrt.kernels.checksum import (
    DEFAULT_TUNING,
    Tuning,
    checksum,
    checksum_blocks,
    checksum_blocks_reference,
    checksum_reference,
    queue_checksum,
)
from tests.conftest import KERNEL_DEVICE, TRITON_KERNEL_MARKS

pytestmark = TRITON_KERNEL_MARKS
DEVICE = KERNEL_DEVICE
MAX_SEED = 2**64 - 1
SEEDS = [0, 1, MAX_SEED]
SMALL_TILES = Tuning(block_words=16, tiles_per_program=4)
"""Tiles of 16 words, up to 4 a program: small inputs span several tiles and programs, and
end in a partial chunk."""
TUNINGS = {"default": DEFAULT_TUNING, "small-tiles": SMALL_TILES}
over_tunings = pytest.mark.parametrize("tuning", list(TUNINGS.values()), ids=list(TUNINGS))


def random_bytes(count: int, seed: int, device: str = DEVICE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator).to(device)


def definition(data: bytes, seed: int) -> int:
    """The module docstring's definition, word by word in Python ints."""
    mask = 2**64 - 1

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    total = 0
    for i in range(-(-len(data) // 8)):
        word = int.from_bytes(data[8 * i : 8 * i + 8], "little")  # a short last slice: zero-padded
        total += mix((word + seed + (i + 1) * 0x9E3779B97F4A7C15) & mask)
    return mix((total & mask) ^ ((seed + 0x9E3779B97F4A7C15 + len(data) * 0xC2B2AE3D27D4EB4F) & mask))


def flipped(data: torch.Tensor, bit: int) -> torch.Tensor:
    out = data.clone()
    out[bit // 8] ^= 1 << (bit % 8)
    return out


KNOWN_INPUT = torch.tensor([(7 * i + 3) % 256 for i in range(1003)], dtype=torch.uint8)
KNOWN_ANSWERS = {0: 0x3BA649BE876A9138, 1: 0xEEAB72ACCE1B9C14, MAX_SEED: 0x698E6424A28513D7}
"""Computed once from the definition: a change to it fails here, not silently."""
KNOWN_EMPTY = {0: 0xE220A8397B1DCDAF, 1: 0x910A2DEC89025CC1, MAX_SEED: 0xE4D971771B652C20}


@pytest.mark.parametrize("seed", SEEDS)
def test_known_answers_pin_the_definition(seed: int) -> None:
    assert definition(bytes(KNOWN_INPUT.tolist()), seed) == KNOWN_ANSWERS[seed]
    assert checksum_reference(KNOWN_INPUT, seed) == KNOWN_ANSWERS[seed]
    assert checksum(KNOWN_INPUT.to(DEVICE), seed) == KNOWN_ANSWERS[seed]
    assert checksum(KNOWN_INPUT[:0].to(DEVICE), seed) == checksum_reference(KNOWN_INPUT[:0], seed) == KNOWN_EMPTY[seed]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_reference_computes_the_definition_for_every_short_length(seed: int) -> None:
    data = random_bytes(41, seed=3, device="cpu")
    for length in range(data.numel() + 1):
        assert checksum_reference(data[:length], seed) == definition(bytes(data[:length].tolist()), seed), length


def test_torch_int64_sums_and_products_wrap_modulo_2_to_the_64() -> None:
    """What the reference relies on (torch documents no overflow behaviour for integers)."""
    assert int(torch.tensor([2**63 - 1, 1]).sum()) == -(2**63)
    assert int(torch.tensor([2**63 - 1] * 1000 + [5]).sum()) == (1000 * (2**63 - 1) + 5 + 2**63) % 2**64 - 2**63
    big = torch.full((1000,), 0x7FFF_FFFF_FFFF_FFF1, dtype=torch.int64)
    wrapped = (0x7FFF_FFFF_FFFF_FFF1 * 0x9E37 + 2**63) % 2**64 - 2**63
    assert (big * 0x9E37).eq(wrapped).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("length", "tuning"),
    [
        *(pytest.param(length, tuning, id=f"{length}-{name}") for length in [0, 1, 7, 8, 9, 15, 16, 17, 127, 128,
          129, 4095, 4096, 4097] for name, tuning in TUNINGS.items()),
        pytest.param((1 << 20) + 3, DEFAULT_TUNING, id="1MiB+3-default"),  # 16-word tiles: too slow interpreted
    ],
)  # fmt: skip
def test_the_kernel_equals_the_reference_bit_for_bit(length: int, seed: int, tuning: Tuning) -> None:
    data = random_bytes(length, seed=length)
    value = checksum(data, seed, tuning=tuning)
    assert value == checksum_reference(data, seed)
    assert isinstance(value, int) and 0 <= value < 2**64


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64,
              torch.bool, torch.float8_e4m3fn],
    ids=str,
)  # fmt: skip
def test_a_tensor_of_any_dtype_is_checksummed_as_its_bytes(dtype: torch.dtype) -> None:
    shape = (3, 5, 7)
    raw = random_bytes(105 * dtype.itemsize, seed=1)
    if dtype == torch.bool:
        raw = raw % 2
    data = raw.view(dtype).view(shape)
    assert checksum(data, 9) == checksum(raw, 9) == checksum_reference(data, 9) == checksum_reference(raw, 9)


@over_tunings
@pytest.mark.parametrize("offset", range(1, 9))
def test_a_view_that_starts_mid_storage_is_checksummed_as_a_copy_of_it(offset: int, tuning: Tuning) -> None:
    storage = random_bytes(1200, seed=offset)
    for length in (0, 5, 8, 301, 1000):
        view = storage[offset : offset + length]
        expected = checksum_reference(view.clone(), 7)
        assert checksum(view, 7, tuning=tuning) == checksum_reference(view, 7) == expected, length


def test_a_view_of_wider_elements_off_a_word_boundary_is_checksummed_as_its_bytes() -> None:
    storage = random_bytes(2 * 500, seed=2).view(torch.float16)
    view = storage[3:401]  # 6 bytes into the storage
    assert checksum(view) == checksum_reference(view.clone())


def test_the_queued_checksum_reads_the_same_value() -> None:
    data = random_bytes(999, seed=4)
    assert queue_checksum(data, 3).result() == checksum(data, 3)


@pytest.mark.parametrize("length", [64, 67])
def test_every_single_bit_flip_changes_the_checksum(length: int) -> None:
    """A word's term is a bijection of the word: one bit flipped changes the sum."""
    data = random_bytes(length, seed=length)
    original = checksum(data)
    for bit in range(8 * length):
        assert checksum(flipped(data, bit)) != original, bit


def test_bit_flips_at_sampled_positions_of_a_large_input_change_the_checksum() -> None:
    data = random_bytes((4 << 20) + 5, seed=5, device="cpu")
    original = checksum_reference(data)
    generator = torch.Generator().manual_seed(6)
    bits = [0, 8 * data.numel() - 1, *torch.randint(0, 8 * data.numel(), (30,), generator=generator).tolist()]
    for bit in bits:
        assert checksum_reference(flipped(data, bit)) != original, bit


def test_bit_flips_in_an_input_of_many_tiles_change_the_kernel_checksum() -> None:
    data = random_bytes((1 << 18) + 3, seed=7)
    original = checksum(data)
    for bit in [0, 7, 64 * 2048 * 8 - 1, 64 * 2048 * 8, 8 * data.numel() - 1]:
        assert checksum(flipped(data, bit)) != original, bit


def test_swapping_two_different_words_changes_the_checksum() -> None:
    words = random_bytes(8 * 40, seed=8).view(torch.int64)
    original = checksum(words)
    for first, second in [(0, 1), (0, 39), (5, 6), (17, 30), (38, 39)]:
        assert bool(words[first] != words[second])
        swapped = words.clone()
        swapped[[first, second]] = words[[second, first]]
        assert checksum(swapped) != original, (first, second)


def test_inputs_that_differ_only_in_trailing_zero_bytes_differ() -> None:
    prefix = random_bytes(13, seed=9)
    padded = [torch.cat([prefix, torch.zeros(zeros, dtype=torch.uint8, device=DEVICE)]) for zeros in range(20)]
    values = {checksum(data) for data in padded}
    zeros = {checksum(torch.zeros(length, dtype=torch.uint8, device=DEVICE)) for length in range(33)}
    assert len(values) == len(padded) and len(zeros) == 33


@pytest.mark.parametrize("first_key", [5, -5, 2**31 + 5], ids=["small", "small-negative", "over-31-bits"])
def test_a_seed_whose_first_word_key_fits_32_bits_is_read_whole(first_key: int) -> None:
    """The kernels take the key of word 0 (seed + 0x9E37...) as a signed 64-bit argument; one
    that fits 32 bits (which Triton would type int32, unless told) is read whole, with its sign."""
    seed = (first_key - 0x9E3779B97F4A7C15) % 2**64
    data = random_bytes(300, seed=21)
    assert checksum(data, seed, tuning=SMALL_TILES) == checksum_reference(data, seed)
    ids = torch.tensor([3, 1], device=DEVICE)
    assert checksum_blocks(data, ids, 72, seed) == checksum_reference(torch.cat([data[216:288], data[72:144]]), seed)


def test_every_seed_gives_another_checksum_of_the_same_bytes() -> None:
    for data in (random_bytes(100, seed=10), random_bytes(0, seed=10)):
        assert len({checksum(data, seed) for seed in [0, 1, 2, 2**63, MAX_SEED]}) == 5


@over_tunings
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("block_bytes", [8, 64, 328, 4096])
def test_blocks_checksum_as_the_concatenation_of_the_blocks_named(
    block_bytes: int, index_dtype: torch.dtype, tuning: Tuning
) -> None:
    pool = random_bytes(24 * block_bytes, seed=block_bytes).view(torch.float16)
    ids = torch.tensor([5, 0, 23, 5, 11, 12], dtype=index_dtype, device=DEVICE)  # out of order, one twice
    flat = pool.view(torch.uint8)
    gathered = torch.cat([flat[i * block_bytes : (i + 1) * block_bytes] for i in ids.tolist()])
    for seed in SEEDS:
        expected = checksum_reference(gathered, seed)
        assert checksum_blocks(pool, ids, block_bytes, seed, tuning=tuning) == expected
        assert checksum_blocks_reference(pool, ids, block_bytes, seed) == expected
        assert checksum(gathered, seed, tuning=tuning) == expected


def test_blocks_of_a_pool_whose_bytes_end_in_a_partial_block_are_named_from_the_whole_ones() -> None:
    pool = random_bytes(10 * 64 + 40, seed=11)
    ids = torch.tensor([9, 0], device=DEVICE)
    assert checksum_blocks(pool, ids, 64) == checksum(torch.cat([pool[576:640], pool[:64]]))
    with pytest.raises(InvalidInputError, match="outside the pool's 10 blocks"):
        checksum_blocks(pool, torch.tensor([10], device=DEVICE), 64)


def test_blocks_named_from_host_ids_checksum_alike() -> None:
    pool = random_bytes(8 * 256, seed=12)
    ids = torch.tensor([3, 1, 4, 1, 5])
    assert checksum_blocks(pool, ids, 256) == checksum_blocks(pool, ids.to(DEVICE), 256)


def test_blocks_of_a_pool_that_starts_off_a_word_boundary_checksum_alike() -> None:
    storage = random_bytes(3 + 6 * 32, seed=13)
    pool = storage[3:]
    ids = torch.tensor([2, 5, 0], device=DEVICE)
    expected = checksum(torch.cat([pool[64:96], pool[160:192], pool[:32]]), 4)
    assert checksum_blocks(pool, ids, 32, 4) == checksum_blocks_reference(pool, ids, 32, 4) == expected


def test_no_blocks_checksum_as_no_bytes() -> None:
    pool = random_bytes(64, seed=14)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert checksum_blocks(pool, none, 8, 2) == checksum_blocks_reference(pool, none, 8, 2) == checksum(pool[:0], 2)


@pytest.mark.parametrize("block_id", [-1, 8, 2**31])
def test_a_block_id_outside_the_pool_is_refused(block_id: int) -> None:
    pool = random_bytes(8 * 64, seed=15)
    ids = torch.tensor([0, block_id], device=DEVICE)
    with pytest.raises(InvalidInputError, match="outside the pool's 8 blocks"):
        checksum_blocks(pool, ids, 64)
    with pytest.raises(InvalidInputError, match="outside the pool's 8 blocks"):
        checksum_blocks_reference(pool, ids, 64)


@pytest.mark.parametrize("block_bytes", [0, 4, 12, 100])
def test_blocks_that_are_not_a_whole_number_of_words_are_refused(block_bytes: int) -> None:
    pool = random_bytes(1200, seed=16)
    ids = torch.tensor([0], device=DEVICE)
    with pytest.raises(InvalidInputError, match="multiple of 8"):
        checksum_blocks(pool, ids, block_bytes)
    with pytest.raises(InvalidInputError, match="multiple of 8"):
        checksum_blocks_reference(pool, ids, block_bytes)


def test_block_ids_of_another_dtype_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="int32 or int64"):
        checksum_blocks(random_bytes(64, seed=17), torch.tensor([0.0], device=DEVICE), 8)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.0])
def test_a_seed_outside_64_bits_is_refused(seed: int) -> None:
    data = random_bytes(8, seed=18)
    with pytest.raises(InvalidInputError, match="seed"):
        checksum(data, seed)
    with pytest.raises(InvalidInputError, match="seed"):
        checksum_reference(data, seed)


def test_a_tensor_that_is_not_contiguous_is_refused() -> None:
    data = random_bytes(64, seed=19).view(8, 8).t()
    with pytest.raises(InvalidInputError, match="contiguous"):
        checksum(data)
    with pytest.raises(InvalidInputError, match="contiguous"):
        checksum_reference(data)


@pytest.mark.gpu
def test_the_reference_on_a_cuda_tensor_equals_the_reference_on_the_host() -> None:
    data = random_bytes((1 << 24) + 5, seed=20, device="cpu")
    on_gpu = data.to("cuda")
    for seed in SEEDS:
        expected = checksum_reference(data, seed)
        assert checksum_reference(on_gpu, seed) == expected
        assert checksum(on_gpu, seed) == expected


@pytest.mark.gpu
def test_checksums_queued_after_an_event_read_what_was_written_before_it() -> None:
    """`queue_checksums_after` on a stream of its own: each tensor's bytes as the work before
    the event left them (written on another stream, which 50 ms of GPU work keeps busy)."""
    from kvrt.kernels.checksum import queue_checksums_after

    written_on, checking = torch.cuda.Stream(), torch.cuda.Stream()
    first, second = torch.zeros(1 << 20, device="cuda"), torch.zeros(3 << 18, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(written_on):
        torch.cuda._sleep(100_000_000)  # about 50 ms of GPU work before the writes
        first.fill_(1.5)
        second.fill_(-2.0)
        written = torch.cuda.Event()
        written.record(written_on)
    read = queue_checksums_after((first, second), 7, checking, written)
    assert read() == [checksum_reference(first.cpu(), 7), checksum_reference(second.cpu(), 7)]
