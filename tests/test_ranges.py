"""Explicit descriptor rows: addresses of descriptor entries, and merging entries into runs within one pool."""

from __future__ import annotations

import numpy as np
import pytest

from nixl_kv.errors import IncompatibleStateError
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion
from nixl_kv.ranges import coalesce


def regions(*spans: tuple[int, int, int]) -> tuple[MemoryRegion, ...]:
    return tuple(MemoryRegion(address, nbytes, device, MemoryKind.DRAM) for address, nbytes, device in spans)


def test_runs_merge_within_a_pool_but_never_across_two() -> None:
    local = regions((1000, 200, 0), (1200, 200, 0))  # adjacent registrations: one run across them is refused
    remote = regions((5000, 400, 3))
    rows = coalesce(
        np.array([1000, 1100, 1200, 1300]), np.array([5000, 5100, 5200, 5300]), np.full(4, 100), local, remote
    )
    assert rows[0].tolist() == [[1000, 200, 0], [1200, 200, 0]]
    assert rows[1].tolist() == [[5000, 200, 3], [5200, 200, 3]]


def test_runs_break_where_either_side_jumps() -> None:
    pool = regions((0, 1000, 1))
    local, remote = np.array([0, 100, 300, 400]), np.array([500, 600, 700, 800])
    rows = coalesce(local, remote, np.full(4, 100), pool, pool)
    assert rows[0].tolist() == [[0, 200, 1], [300, 200, 1]]
    assert rows[1].tolist() == [[500, 200, 1], [700, 200, 1]]


def test_an_entry_outside_the_pools_is_refused() -> None:
    pool, two = regions((0, 1000, 0)), regions((0, 1000, 0), (2000, 1000, 0))
    with pytest.raises(IncompatibleStateError, match="remote state rows fall outside the registered pools"):
        coalesce(np.array([0]), np.array([950]), np.array([100]), pool, pool)
    with pytest.raises(IncompatibleStateError, match="local state rows fall outside the registered pools"):
        coalesce(np.array([1500]), np.array([0]), np.array([100]), two, pool)
    with pytest.raises(IncompatibleStateError, match="local state rows fall outside the registered pools"):
        coalesce(np.array([950]), np.array([0]), np.array([100]), two, pool)  # runs past the end of the first


@pytest.mark.parametrize("kind", list(LayoutKind))
@pytest.mark.parametrize("coarse", [False, True])
def test_unit_addresses_match_the_descriptor_rows(kind: LayoutKind, coarse: bool) -> None:
    layers, kv, heads, tokens, dim, itemsize, blocks = 3, 2, 4, 8, 16, 2, 5
    per_pool = (layers * kv if kind is LayoutKind.BLOCK_MAJOR else 1) * heads * tokens * dim * itemsize * blocks
    pools = regions(
        *(
            (10_000 + i * (per_pool + 64), per_pool, 0)
            for i in range(1 if kind is LayoutKind.BLOCK_MAJOR else layers * kv)
        )
    )
    layout = KVLayout(kind, blocks, layers, kv, heads, tokens, dim, itemsize, pools)
    rows = layout.unit_descriptors(coarse)
    expanded = np.concatenate([row[0] + np.arange(row[4], dtype=np.int64) * row[3] for row in rows.astype(np.int64)])
    assert np.array_equal(layout.unit_addresses(np.arange(len(expanded)), coarse), expanded)


def test_chunk_addresses_list_a_box_in_the_requested_order() -> None:
    pools = regions((0, 4 * 3 * 64, 0))
    layout = KVLayout(LayoutKind.BLOCK_MAJOR, 4, 3, 1, 1, 4, 16, 1, pools)  # chunk: 64 bytes
    assert layout.chunk_addresses(np.array([2, 0]), range(1, 3), block_first=True).tolist() == [448, 512, 64, 128]
    assert layout.chunk_addresses(np.array([2, 0]), range(1, 3), block_first=False).tolist() == [448, 64, 512, 128]
    per_layer = KVLayout(LayoutKind.PER_LAYER_HND, 4, 2, 1, 1, 4, 16, 1, regions((0, 256, 0), (1000, 256, 0)))
    assert per_layer.chunk_addresses(np.array([3]), range(2), block_first=True).tolist() == [192, 1192]
