"""The host-side math of the CUDA IPC gather (``nixl_kv.ipc_gather``): tiles and address translation, checked with
numpy stand-ins of the kernel (the kernel itself runs in tests/test_gpu.py, on the GPU machine)."""

from __future__ import annotations

import numpy as np
import pytest

from nixl_kv.errors import IncompatibleStateError
from nixl_kv.ipc_gather import TILE_BYTES, PoolHandle, tile_table, translate
from nixl_kv.layout import MemoryKind, MemoryRegion


def _copy_tiles(memory: np.ndarray, table: np.ndarray) -> None:
    """What the kernel does, tile by tile, on one flat byte array standing for the address space."""
    for dst, src, n in table.reshape(-1, 3).astype(np.int64):
        memory[dst : dst + n] = memory[src : src + n]


def test_tiles_cover_every_row_exactly_once() -> None:
    rng = np.random.default_rng(7)
    lengths = np.array([TILE_BYTES * 3, 48, TILE_BYTES + 16, 0, 2 * TILE_BYTES - 32], dtype=np.int64)
    sources = np.cumsum(np.concatenate(([0], lengths[:-1])))
    total = int(lengths.sum())
    destinations = sources + total + 64
    memory = np.zeros(2 * total + 64, dtype=np.uint8)
    memory[:total] = rng.integers(0, 256, total, dtype=np.uint8)
    table, vector = tile_table(destinations, sources, lengths)
    assert vector and table.dtype == np.uint64
    sizes = table.reshape(-1, 3)[:, 2].tolist()
    assert sizes == [TILE_BYTES] * 3 + [48, TILE_BYTES, 16, TILE_BYTES, TILE_BYTES - 32]
    _copy_tiles(memory, table)
    assert np.array_equal(memory[total + 64 :], memory[:total])
    assert not tile_table(np.array([1]), np.array([0]), np.array([32]))[1]  # an odd address: bytes, not vectors


def test_rows_translate_into_the_mapping_of_their_own_pool_only() -> None:
    regions = (
        MemoryRegion(0x7000_0000, 4096, 0, MemoryKind.VRAM),
        MemoryRegion(0x1000_0000, 8192, 0, MemoryKind.VRAM),
    )
    mapped = np.array([0x5_0000_0000, 0x9_0000_0000], dtype=np.int64)
    rows = np.array([[0x1000_0000 + 4096, 4096, 0], [0x7000_0000 + 16, 64, 0]], dtype=np.uint64)
    assert translate(rows, regions, mapped).tolist() == [0x9_0000_0000 + 4096, 0x5_0000_0000 + 16]
    for bad in ([0x1000_0000 + 4096, 4097, 0], [0x0FFF_FFFF, 1, 0], [0x7000_0000 + 4096, 1, 0]):
        with pytest.raises(IncompatibleStateError, match="outside"):
            translate(np.array([bad], dtype=np.uint64), regions, mapped)


def test_pool_handles_travel_and_bad_ones_are_refused() -> None:
    pool = PoolHandle(b"\x01" * 64, 512, MemoryRegion(0x1000, 4096, 1, MemoryKind.VRAM))
    assert PoolHandle.from_wire(pool.to_wire()) == pool
    for bad in ((b"\x01" * 63, 0, 1, 1, 0), (b"\x01" * 64, -1, 1, 1, 0), ("x" * 64, 0, 1, 1, 0)):
        with pytest.raises(IncompatibleStateError):
            PoolHandle.from_wire(bad)
