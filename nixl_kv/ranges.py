"""Explicit (address, length, device) rows for direct reads of state beside the paged KV, merged into runs."""

from __future__ import annotations

import numpy as np


def coalesce(
    local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, local_device: int, remote_device: int
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 local and remote rows for entry-by-entry copies of ``lengths`` bytes, each entry merged into the one
    before it when it continues it on both sides (so NIXL posts one descriptor per run, not per entry)."""
    local, remote = np.asarray(local, dtype=np.int64), np.asarray(remote, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(lengths):
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    continues = (local[1:] == local[:-1] + lengths[:-1]) & (remote[1:] == remote[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    merged = np.add.reduceat(lengths, starts)

    def rows(addresses: np.ndarray, device: int) -> np.ndarray:
        return np.stack([addresses[starts], merged, np.full(len(starts), device, dtype=np.int64)], axis=1).astype(
            np.uint64
        )

    return rows(local, local_device), rows(remote, remote_device)
