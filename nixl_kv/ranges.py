"""Explicit (address, length, device) rows for direct reads of state beside the paged KV, merged into runs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nixl_kv.errors import IncompatibleStateError
from nixl_kv.layout import MemoryRegion


def coalesce(
    local: np.ndarray,
    remote: np.ndarray,
    lengths: np.ndarray,
    local_regions: Sequence[MemoryRegion],
    remote_regions: Sequence[MemoryRegion],
) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 local and remote rows for entry-by-entry copies of ``lengths`` bytes, each entry merged into the one
    before it when it continues it on both sides inside the same registered regions (NIXL then posts one
    descriptor per run; a run across two registrations would be refused). Each row carries its region's device.
    An entry outside every region is an IncompatibleStateError (a layout that does not describe its memory)."""
    local, remote = np.asarray(local, dtype=np.int64), np.asarray(remote, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(lengths):
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    local_region = _region_of(local, lengths, local_regions, "local")
    remote_region = _region_of(remote, lengths, remote_regions, "remote")
    continues = (
        (local[1:] == local[:-1] + lengths[:-1])
        & (remote[1:] == remote[:-1] + lengths[:-1])
        & (local_region[1:] == local_region[:-1])
        & (remote_region[1:] == remote_region[:-1])
    )
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    merged = np.add.reduceat(lengths, starts)

    def rows(addresses: np.ndarray, region: np.ndarray, regions: Sequence[MemoryRegion]) -> np.ndarray:
        devices = np.array([r.device_id for r in regions], dtype=np.int64)[region[starts]]
        return np.stack([addresses[starts], merged, devices], axis=1).astype(np.uint64)

    return rows(local, local_region, local_regions), rows(remote, remote_region, remote_regions)


def _region_of(addresses: np.ndarray, lengths: np.ndarray, regions: Sequence[MemoryRegion], side: str) -> np.ndarray:
    """The index of the region holding each entry."""
    if len(regions) == 1:  # the common case: one pool per kind of state
        region = regions[0]
        if addresses.min() < region.address or (addresses + lengths).max() > region.address + region.nbytes:
            raise IncompatibleStateError(f"{side} state rows fall outside the registered pools")
        return np.zeros(len(addresses), dtype=np.int64)
    order = np.argsort([r.address for r in regions])
    starts = np.array([regions[i].address for i in order], dtype=np.int64)
    ends = np.array([regions[i].address + regions[i].nbytes for i in order], dtype=np.int64)
    slot = np.searchsorted(starts, addresses, side="right") - 1
    inside = (slot >= 0) & (addresses + lengths <= ends[np.maximum(slot, 0)])
    if not inside.all():
        raise IncompatibleStateError(f"{side} state rows fall outside the registered pools")
    return order[slot]
