"""Coalesced descriptors: a direct read's entries that continue each other on both sides become one descriptor.

Why: on a GPU a READ costs about 10 µs per descriptor through UCX's cuda_ipc transport, whatever its size up to
4 MiB, and one descriptor runs at the copy engine's speed (issue 33: 4 descriptors of 4 MiB took 40 µs, one of
16 MiB 19 µs). A direct read addresses one prepared entry per block (or per (layer, kv) chunk of a block); blocks
that lie next to each other in the pools of both sides (the allocators hand out runs where they can) are read as
one descriptor of explicit rows instead.

Entries of a prepared list (``KVLayout.unit_descriptors``) are numbered in memory order, pool after pool, so entry
``i + 1`` continues entry ``i`` exactly when it is the next index and not the first entry of the next pool: runs are
found from the indices alone, with no address arithmetic per entry.
"""

from __future__ import annotations

import numpy as np

from nixl_kv.layout import KVLayout

# Explicit rows cost the gen's CPU more than prepared indices: the agent describes and looks up each row per READ.
# Measured on the 2-core CPU machine through the compiled core (DRAM loopback, one READ posted and completed, p50,
# under load): prepared indices 4.0 µs for one 4 KiB entry and 25.8 µs for 64, one row of the same bytes 6.7 and
# 23.2 µs. So on DRAM an entry costs about 0.35 µs and a READ of rows about 2.7 µs more: rows pay where they save 8
# or more; on a GPU an entry costs about 10 µs (cuda_ipc, issue 33), and rows pay where they save one.
MIN_SAVED = {"VRAM": 1, "DRAM": 8}
# Up to this many entries, runs are found in a Python loop: numpy's per-call cost (a few µs an operation, about ten
# operations) is more than the loop's on the fast path's common requests (a few blocks).
SMALL = 64


def entry_runs(
    local: KVLayout, local_indices: np.ndarray, remote: KVLayout, remote_indices: np.ndarray, coarse: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Where each run of entries starts (positions into the index arrays) and how many entries it holds."""
    li = np.asarray(local_indices, dtype=np.int64)
    ri = np.asarray(remote_indices, dtype=np.int64)
    if not len(li):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    continues = (
        (li[1:] == li[:-1] + 1)
        & (ri[1:] == ri[:-1] + 1)
        & (li[1:] % _entries_per_pool(local, coarse) != 0)
        & (ri[1:] % _entries_per_pool(remote, coarse) != 0)
    )
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return starts, np.diff(np.append(starts, len(li)))


def coalesced_rows(
    local: KVLayout,
    local_indices: np.ndarray,
    remote: KVLayout,
    remote_indices: np.ndarray,
    coarse: bool,
    min_saved: int = 1,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Nx3 (address, length, device) local and remote rows, one per run of entries that continue each other on both
    sides; None where that saves fewer than ``min_saved`` descriptors (the prepared indices are cheaper then; 0: always
    rows, as a copy kernel takes them)."""
    if len(local_indices) - 1 < min_saved:  # even one run would save too few: no need to find the runs
        return None
    if len(local_indices) <= SMALL:
        return _small_rows(local, local_indices, remote, remote_indices, coarse, min_saved)
    starts, counts = entry_runs(local, local_indices, remote, remote_indices, coarse)
    if len(local_indices) - len(starts) < min_saved:
        return None
    unit = local.segment_bytes if coarse else local.unit_bytes
    lengths = counts * unit
    return (
        _rows(local, np.asarray(local_indices)[starts], lengths, coarse),
        _rows(remote, np.asarray(remote_indices)[starts], lengths, coarse),
    )


def _entries_per_pool(layout: KVLayout, coarse: bool) -> int:
    return layout.pool_bytes // (layout.segment_bytes if coarse else layout.unit_bytes)


def _rows(layout: KVLayout, indices: np.ndarray, lengths: np.ndarray, coarse: bool) -> np.ndarray:
    indices = indices.astype(np.int64)
    devices = np.array([pool.device_id for pool in layout.pools], dtype=np.int64)
    pool = indices // _entries_per_pool(layout, coarse)
    rows = np.empty((len(indices), 3), dtype=np.uint64)
    rows[:, 0] = layout.unit_addresses(indices, coarse)
    rows[:, 1] = lengths
    rows[:, 2] = devices[pool]
    return rows


def _small_rows(
    local: KVLayout,
    local_indices: np.ndarray,
    remote: KVLayout,
    remote_indices: np.ndarray,
    coarse: bool,
    min_saved: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """``coalesced_rows`` for a few entries, in plain Python (the same runs as ``entry_runs``)."""
    li, ri = local_indices.tolist(), remote_indices.tolist()
    per_local, per_remote = _entries_per_pool(local, coarse), _entries_per_pool(remote, coarse)
    starts = [0] if li else []
    for i in range(1, len(li)):
        a, b = li[i], ri[i]
        if not (a == li[i - 1] + 1 and b == ri[i - 1] + 1 and a % per_local and b % per_remote):
            starts.append(i)
    if len(li) - len(starts) < min_saved:
        return None
    counts = [end - start for start, end in zip(starts, [*starts[1:], len(li)], strict=True)]
    unit = local.segment_bytes if coarse else local.unit_bytes
    return (
        _small_rows_of(local, [li[i] for i in starts], counts, unit, coarse),
        _small_rows_of(remote, [ri[i] for i in starts], counts, unit, coarse),
    )


def _small_rows_of(layout: KVLayout, starts: list[int], counts: list[int], unit: int, coarse: bool) -> np.ndarray:
    per_pool, pools = _entries_per_pool(layout, coarse), layout.pools
    table = []
    for index, count in zip(starts, counts, strict=True):
        pool = pools[index // per_pool]
        table.append((pool.address + index % per_pool * unit, count * unit, pool.device_id))
    return np.array(table, dtype=np.uint64).reshape(-1, 3)
