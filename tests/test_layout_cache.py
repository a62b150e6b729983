"""KVLayout descriptors and consistency checks; the reference PagedKVCache and its block allocator."""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

from nixl_kv.cache import BlockAllocator, CacheManager, PagedKVCache
from nixl_kv.dtypes import DataType
from nixl_kv.errors import BufferExhaustedError
from nixl_kv.harness.fill import Slice, expected
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion

PER_LAYER_KINDS = [LayoutKind.PER_LAYER_NHD, LayoutKind.PER_LAYER_HND]


def make_layout(
    kind: LayoutKind,
    num_blocks: int = 5,
    num_layers: int = 3,
    kv_factor: int = 2,
    num_pools: int | None = None,
    pool_nbytes: int | None = None,
) -> KVLayout:
    """3 layers, 2 kv, 4 heads, 8 tokens, 16 dims of 2 bytes: 1024-byte chunks; pools 0x10000 bytes apart."""
    chunk = 4 * 8 * 16 * 2
    segment = num_layers * kv_factor * chunk if kind is LayoutKind.BLOCK_MAJOR else chunk
    if num_pools is None:
        num_pools = 1 if kind is LayoutKind.BLOCK_MAJOR else num_layers * kv_factor
    nbytes = num_blocks * segment if pool_nbytes is None else pool_nbytes
    pools = tuple(MemoryRegion(0x10_0000 + i * 0x1_0000, nbytes, 7, MemoryKind.VRAM) for i in range(num_pools))
    return KVLayout(
        kind=kind,
        num_blocks=num_blocks,
        num_layers=num_layers,
        kv_factor=kv_factor,
        num_heads=4,
        tokens_per_block=8,
        head_dim=16,
        itemsize=2,
        pools=pools,
    )


# --- KVLayout ---------------------------------------------------------------------------------------------------
def test_block_major_sizes_and_descriptors() -> None:
    layout = make_layout(LayoutKind.BLOCK_MAJOR)
    assert layout.num_pools == 1
    assert layout.chunk_bytes == 1024
    assert layout.segment_bytes == 6144
    assert layout.block_bytes == 6144
    assert layout.pool_bytes == 30720
    assert layout.problems() == []
    assert layout.unit_bytes == 256  # one head's tokens of a block
    rows = layout.unit_descriptors()
    assert rows.dtype == np.uint64
    np.testing.assert_array_equal(rows, np.array([[0x10_0000, 256, 7, 256, 5 * 3 * 2 * 4]], dtype=np.uint64))


@pytest.mark.parametrize("kind", PER_LAYER_KINDS)
def test_per_layer_sizes_and_descriptors(kind: LayoutKind) -> None:
    layout = make_layout(kind)
    assert layout.num_pools == 6
    assert layout.chunk_bytes == 1024
    assert layout.segment_bytes == 1024
    assert layout.block_bytes == 6144
    assert layout.pool_bytes == 5120
    assert layout.problems() == []
    rows = layout.unit_descriptors()
    assert rows.dtype == np.uint64
    unit, count = (1024, 5) if kind is LayoutKind.PER_LAYER_NHD else (256, 5 * 4)
    want = [[0x10_0000 + i * 0x1_0000, unit, 7, unit, count] for i in range(6)]
    np.testing.assert_array_equal(rows, np.array(want, dtype=np.uint64))


def test_descriptors_of_a_layout_without_pools_have_five_columns() -> None:
    layout = make_layout(LayoutKind.PER_LAYER_NHD, num_pools=0)
    assert layout.unit_descriptors().shape == (0, 5)


def test_block_major_unit_indices_follow_memory_order() -> None:
    layout = make_layout(LayoutKind.BLOCK_MAJOR)  # 3 layers, kv 2, 4 heads, 5 blocks
    indices = layout.unit_indices(np.array([3, 0]), range(1, 2), range(2, 4), block_first=True)
    assert indices.dtype == np.int32
    np.testing.assert_array_equal(indices, np.array([82, 83, 86, 87, 10, 11, 14, 15], dtype=np.int32))


def test_per_layer_hnd_unit_indices_are_layer_first() -> None:
    layout = make_layout(LayoutKind.PER_LAYER_HND)
    indices = layout.unit_indices(np.array([3, 0]), range(1, 2), range(2, 4), block_first=False)
    np.testing.assert_array_equal(indices, np.array([54, 55, 42, 43, 74, 75, 62, 63], dtype=np.int32))


def test_per_layer_nhd_units_are_whole_chunks() -> None:
    layout = make_layout(LayoutKind.PER_LAYER_NHD)
    assert not layout.heads_inner
    indices = layout.unit_indices(np.array([3, 0]), range(1, 2), None, block_first=False)
    np.testing.assert_array_equal(indices, np.array([13, 10, 18, 15], dtype=np.int32))


def test_unit_indices_of_no_blocks() -> None:
    layout = make_layout(LayoutKind.PER_LAYER_HND)
    assert layout.unit_indices(np.array([], dtype=np.int64), range(3), range(4), block_first=False).tolist() == []


@pytest.mark.parametrize(
    "kind,num_pools,want",
    [
        (LayoutKind.BLOCK_MAJOR, 2, "block_major needs 1 pools, got 2"),
        (LayoutKind.BLOCK_MAJOR, 0, "block_major needs 1 pools, got 0"),
        (LayoutKind.PER_LAYER_NHD, 1, "per_layer_nhd needs 6 pools, got 1"),
        (LayoutKind.PER_LAYER_HND, 7, "per_layer_hnd needs 6 pools, got 7"),
    ],
)
def test_problems_wrong_pool_count(kind: LayoutKind, num_pools: int, want: str) -> None:
    assert make_layout(kind, num_pools=num_pools).problems() == [want]


def test_problems_pool_too_small() -> None:
    layout = make_layout(LayoutKind.PER_LAYER_NHD, pool_nbytes=5119)
    assert layout.problems() == [f"pool {i} holds 5119 bytes, the layout needs 5120" for i in range(6)]


def test_problems_bad_dimensions() -> None:
    zero_heads = KVLayout(LayoutKind.BLOCK_MAJOR, 4, 2, 2, 0, 8, 16, 2, (MemoryRegion(0, 1 << 20, 0, MemoryKind.DRAM),))
    assert zero_heads.problems() == ["every dimension must be at least 1"]
    three_kv = make_layout(LayoutKind.BLOCK_MAJOR, kv_factor=3)
    assert three_kv.problems() == ["kv_factor must be 1 or 2, got 3"]
    zero_kv = make_layout(LayoutKind.PER_LAYER_HND, kv_factor=0, num_pools=0)
    assert zero_kv.problems() == ["every dimension must be at least 1", "kv_factor must be 1 or 2, got 0"]


def test_problems_too_many_descriptors() -> None:
    layout = make_layout(LayoutKind.PER_LAYER_NHD, num_blocks=1 << 29, num_layers=2, kv_factor=2)
    assert layout.problems() == ["pools x units must stay below 2**31 descriptors"]
    below = make_layout(LayoutKind.PER_LAYER_NHD, num_blocks=(1 << 29) - 1, num_layers=2, kv_factor=2)
    assert below.problems() == []


# --- PagedKVCache -----------------------------------------------------------------------------------------------
L, H, T, D = 3, 2, 4, 5


def make_cache(
    kind: LayoutKind, dtype: DataType = DataType.FLOAT16, kv_factor: int = 2, blocks: int = 8
) -> PagedKVCache:
    return PagedKVCache(
        num_blocks=blocks,
        num_layers=L,
        num_heads=H,
        tokens_per_block=T,
        head_dim=D,
        dtype=dtype,
        kv_factor=kv_factor,
        kind=kind,
    )


def fill(seed: int, num_tokens: int, itemsize: int, kv_factor: int = 2, token_start: int = 0) -> np.ndarray:
    where = Slice(
        layer_start=0,
        num_layers=L,
        head_start=0,
        num_heads=H,
        kv_factor=kv_factor,
        head_dim=D,
        token_start=token_start,
        num_tokens=num_tokens,
    )
    return expected(seed, where, itemsize)


def test_paged_cache_is_a_cache_manager() -> None:
    assert isinstance(make_cache(LayoutKind.BLOCK_MAJOR), CacheManager)


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_cache_layout_matches_its_pools(kind: LayoutKind) -> None:
    cache = make_cache(kind, DataType.FLOAT32)
    layout = cache.layout
    assert layout.problems() == []
    assert layout.itemsize == 4
    pools = {LayoutKind.BLOCK_MAJOR: 1, LayoutKind.PER_LAYER_HKND: L}.get(kind, L * 2)
    assert len(cache.pools) == layout.num_pools == pools
    for pool, region in zip(cache.pools, layout.pools, strict=True):
        assert pool.dtype == np.uint32
        assert region.address == pool.ctypes.data
        assert region.nbytes == pool.nbytes == layout.pool_bytes
        assert region.memory is MemoryKind.DRAM
        assert pool.flags["C_CONTIGUOUS"]
        assert not pool.any()


@pytest.mark.parametrize("kind", list(LayoutKind))
@pytest.mark.parametrize("dtype", [DataType.FLOAT16, DataType.FLOAT32, DataType.FLOAT8])
@pytest.mark.parametrize("kv_factor", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, T - 1, T, T + 1, 2 * T + 3])
def test_write_then_read_tokens(kind: LayoutKind, dtype: DataType, kv_factor: int, num_tokens: int) -> None:
    cache = make_cache(kind, dtype, kv_factor)
    blocks = cache.allocate(request_id=11, num_tokens=num_tokens)
    assert len(blocks) == -(-num_tokens // T)
    values = fill(seed=11, num_tokens=num_tokens, itemsize=dtype.itemsize, kv_factor=kv_factor)
    assert values.shape == (L, kv_factor, H, num_tokens, D)

    cache.write_tokens(11, values)

    got = cache.read_tokens(11, num_tokens)
    assert got.dtype == dtype.storage
    np.testing.assert_array_equal(got, values)
    # the rest of the last block was never written and is still zero
    whole = cache.read_tokens(11, len(blocks) * T)
    np.testing.assert_array_equal(whole[..., :num_tokens, :], values)
    assert not whole[..., num_tokens:, :].any()


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_read_tokens_returns_a_copy(kind: LayoutKind) -> None:
    cache = make_cache(kind)
    cache.allocate(1, T)
    values = fill(1, T, 2)
    cache.write_tokens(1, values)
    got = cache.read_tokens(1, T)
    got[...] = 0
    np.testing.assert_array_equal(cache.read_tokens(1, T), values)


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_writing_one_request_leaves_other_blocks_alone(kind: LayoutKind) -> None:
    cache = make_cache(kind, blocks=10)
    cache.allocate(1, 2 * T + 1)  # 3 blocks
    cache.allocate(2, 3 * T)  # 3 blocks
    cache.allocate(3, 1)  # 1 block
    cache.write_tokens(1, fill(101, 2 * T + 1, 2))
    cache.write_tokens(2, fill(102, 3 * T, 2))
    cache.write_tokens(3, fill(103, 1, 2))
    before = [pool.copy() for pool in cache.pools]

    cache.write_tokens(2, fill(202, 3 * T - 2, 2))  # rewrite request 2, fewer tokens than it holds

    np.testing.assert_array_equal(cache.read_tokens(1, 2 * T + 1), fill(101, 2 * T + 1, 2))
    np.testing.assert_array_equal(cache.read_tokens(3, 1), fill(103, 1, 2))
    got2 = cache.read_tokens(2, 3 * T)
    np.testing.assert_array_equal(got2[..., : 3 * T - 2, :], fill(202, 3 * T - 2, 2))
    # the last two tokens of request 2 keep their old values
    np.testing.assert_array_equal(got2[..., 3 * T - 2 :, :], fill(102, 3 * T, 2)[..., 3 * T - 2 :, :])
    others = np.setdiff1d(np.arange(10), cache.block_ids(2))
    for pool, old in zip(cache.pools, before, strict=True):
        np.testing.assert_array_equal(pool[others], old[others])


def raw_segment(cache: PagedKVCache, pool: int, block: int) -> bytes:
    """The bytes a NIXL descriptor of (pool, block) covers, read from the address in the layout."""
    layout = cache.layout
    return ctypes.string_at(layout.pools[pool].address + block * layout.segment_bytes, layout.segment_bytes)


@pytest.mark.parametrize("dtype", [DataType.FLOAT16, DataType.FLOAT32])
def test_block_major_block_is_contiguous_layer_kv_head_token_dim(dtype: DataType) -> None:
    cache = make_cache(LayoutKind.BLOCK_MAJOR, dtype)
    cache.allocate(0, 1)  # occupy block 0 so request 5 gets non-trivial block ids
    blocks = cache.allocate(5, 3 * T)
    np.testing.assert_array_equal(blocks, [1, 2, 3])
    values = fill(5, 3 * T, dtype.itemsize)
    cache.write_tokens(5, values)

    pool = cache.pools[0]
    assert pool.shape == (8, L, 2, H, T, D)
    for i, block in enumerate(blocks):
        want = np.ascontiguousarray(values[:, :, :, i * T : (i + 1) * T, :])  # [layer, kv, head, token, dim]
        np.testing.assert_array_equal(pool[block], want)
        assert pool.reshape(8, -1)[block].tobytes() == want.tobytes()
        assert raw_segment(cache, 0, int(block)) == want.tobytes()
    assert not pool[0].any()
    assert not pool[4:].any()


@pytest.mark.parametrize("kv_factor", [1, 2])
def test_per_layer_nhd_pool_holds_block_token_head_dim(kv_factor: int) -> None:
    cache = make_cache(LayoutKind.PER_LAYER_NHD, DataType.FLOAT32, kv_factor)
    cache.allocate(0, 2 * T)
    blocks = cache.allocate(9, 2 * T)
    np.testing.assert_array_equal(blocks, [2, 3])
    values = fill(9, 2 * T, 4, kv_factor)
    cache.write_tokens(9, values)

    for layer in range(L):
        for kv in range(kv_factor):
            index = layer * kv_factor + kv
            pool = cache.pools[index]
            assert pool.shape == (8, T, H, D)
            for i, block in enumerate(blocks):
                want = np.ascontiguousarray(values[layer, kv, :, i * T : (i + 1) * T, :].transpose(1, 0, 2))
                np.testing.assert_array_equal(pool[block], want)
                assert raw_segment(cache, index, int(block)) == want.tobytes()
            assert not pool[:2].any()
            assert not pool[4:].any()


def test_per_layer_hnd_pool_holds_block_head_token_dim() -> None:
    cache = make_cache(LayoutKind.PER_LAYER_HND, DataType.FLOAT16)
    blocks = cache.allocate(4, 2 * T)
    values = fill(4, 2 * T, 2)
    cache.write_tokens(4, values)
    for layer in range(L):
        for kv in range(2):
            pool = cache.pools[layer * 2 + kv]
            assert pool.shape == (8, H, T, D)
            for i, block in enumerate(blocks):
                want = np.ascontiguousarray(values[layer, kv, :, i * T : (i + 1) * T, :])
                np.testing.assert_array_equal(pool[block], want)
                assert raw_segment(cache, layer * 2 + kv, int(block)) == want.tobytes()


# --- allocation, pinning, freeing -------------------------------------------------------------------------------
def test_block_allocator_hands_out_lowest_ids_first_and_reuses_freed() -> None:
    allocator = BlockAllocator(6)
    first = allocator.allocate(3)
    np.testing.assert_array_equal(first, [0, 1, 2])
    np.testing.assert_array_equal(allocator.allocate(2), [3, 4])
    assert allocator.free_blocks == 1
    allocator.free(first)
    assert allocator.free_blocks == 4
    again = allocator.allocate(4)
    assert sorted(again.tolist()) == [0, 1, 2, 5]
    assert allocator.free_blocks == 0


def test_block_allocator_exhaustion() -> None:
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    with pytest.raises(BufferExhaustedError, match=r"^need 2 blocks, 1 of 4 are free$"):
        allocator.allocate(2)
    assert allocator.free_blocks == 1  # a failed allocation takes nothing
    np.testing.assert_array_equal(allocator.allocate(1), [3])


def test_cache_allocate_exhaustion() -> None:
    cache = make_cache(LayoutKind.PER_LAYER_NHD, blocks=4)
    cache.allocate(1, 3 * T)
    with pytest.raises(BufferExhaustedError, match=r"^need 2 blocks, 1 of 4 are free$"):
        cache.allocate(2, T + 1)
    with pytest.raises(KeyError):
        cache.block_ids(2)  # the failed request holds nothing
    np.testing.assert_array_equal(cache.allocate(2, T), [3])


def test_allocating_a_request_twice_is_refused() -> None:
    cache = make_cache(LayoutKind.BLOCK_MAJOR)
    cache.allocate(1, T)
    with pytest.raises(ValueError, match="request 1 already holds blocks"):
        cache.allocate(1, T)
    assert cache.free_blocks == 7


def test_free_of_pinned_request_is_deferred_until_unpin() -> None:
    cache = make_cache(LayoutKind.BLOCK_MAJOR, blocks=4)
    blocks = cache.allocate(1, 2 * T)
    np.testing.assert_array_equal(cache.pin(1), blocks)
    cache.write_tokens(1, fill(1, 2 * T, 2))

    cache.free(1)

    assert cache.free_blocks == 2
    np.testing.assert_array_equal(cache.block_ids(1), blocks)  # still reachable by the transfer
    with pytest.raises(KeyError):
        cache.pin(1)  # but no new pins after free
    other = cache.allocate(2, 2 * T)
    assert set(other.tolist()).isdisjoint(blocks.tolist())
    with pytest.raises(BufferExhaustedError):
        cache.allocate(3, 1)  # the pinned blocks are not reallocated
    np.testing.assert_array_equal(cache.read_tokens(1, 2 * T), fill(1, 2 * T, 2))

    cache.unpin(1)

    assert cache.free_blocks == 2
    with pytest.raises(KeyError):
        cache.block_ids(1)
    np.testing.assert_array_equal(np.sort(cache.allocate(3, 2 * T)), np.sort(blocks))


def test_free_waits_for_the_last_of_several_pins() -> None:
    cache = make_cache(LayoutKind.PER_LAYER_HND, blocks=4)
    blocks = cache.allocate(1, T)
    cache.pin(1)
    cache.pin(1)
    cache.free(1)
    cache.unpin(1)
    assert cache.free_blocks == 3
    np.testing.assert_array_equal(cache.block_ids(1), blocks)
    cache.unpin(1)
    assert cache.free_blocks == 4


def test_unpinned_request_is_freed_at_once_and_only_once() -> None:
    cache = make_cache(LayoutKind.BLOCK_MAJOR, blocks=4)
    cache.allocate(1, T)
    cache.pin(1)
    cache.unpin(1)
    cache.free(1)
    assert cache.free_blocks == 4
    with pytest.raises(KeyError):
        cache.free(1)
    assert cache.free_blocks == 4


def test_pin_of_unknown_request_raises_key_error() -> None:
    cache = make_cache(LayoutKind.BLOCK_MAJOR)
    with pytest.raises(KeyError, match="request 99 holds no blocks in this cache"):
        cache.pin(99)
    with pytest.raises(KeyError, match="request 99 holds no blocks in this cache"):
        cache.block_ids(99)


# --- misuse that must not corrupt the allocator ---------------------------------------------
def test_unbalanced_unpin_cannot_release_a_later_pin() -> None:
    cache = make_cache(LayoutKind.BLOCK_MAJOR, blocks=4)
    blocks = cache.allocate(1, T)
    with contextlib.suppress(KeyError, ValueError, RuntimeError):
        cache.unpin(1)  # a bug in the caller: never pinned
    cache.pin(1)  # a transfer pins the request ...
    cache.free(1)  # ... so free must wait for its unpin
    assert cache.free_blocks == 3
    np.testing.assert_array_equal(cache.block_ids(1), blocks)


def test_negative_token_count_cannot_double_allocate() -> None:
    cache = make_cache(LayoutKind.BLOCK_MAJOR, blocks=4)
    first = cache.allocate(1, T)
    with contextlib.suppress(ValueError, BufferExhaustedError):
        cache.allocate(2, -T - 1)
    assert cache.free_blocks == 3
    second = cache.allocate(3, T)
    assert set(second.tolist()).isdisjoint(first.tolist())


def test_allocator_hands_out_the_lowest_free_blocks_in_order() -> None:
    cache = make_cache(LayoutKind.BLOCK_MAJOR, blocks=8)
    first, second = cache.allocate(1, 2 * T), cache.allocate(2, 3 * T)
    assert first.tolist() == [0, 1] and second.tolist() == [2, 3, 4]
    cache.free(1)
    assert cache.allocate(3, 4 * T).tolist() == [0, 1, 5, 6]  # reused holes first, ascending
