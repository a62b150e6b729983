"""Allocation of numbered units (KV blocks, Mamba state slots) that keeps a request's blocks in one run."""

from __future__ import annotations

import numpy as np

from nixl_kv.errors import BufferExhaustedError


class BlockAllocator:
    """Free blocks as a mask. A request gets the smallest run of free blocks that holds it (the lowest such run
    among equals), so its blocks are adjacent and a transfer reads them as one descriptor (``nixl_kv.runs``), while
    longer runs stay whole for longer requests; where no run holds it, the lowest free ids, in ascending order (as
    many runs as the free space forces). Vectorised: no Python loop per block."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = np.ones(num_blocks, dtype=bool)
        self._free_count = num_blocks

    @property
    def free_blocks(self) -> int:
        return self._free_count

    def allocate(self, count: int) -> np.ndarray:
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > self._free_count:
            raise BufferExhaustedError(f"need {count} blocks, {self._free_count} of {self.num_blocks} are free")
        blocks = self._run_of(count)
        if blocks is None:
            blocks = np.flatnonzero(self._free)[:count]
        self._free[blocks] = False
        self._free_count -= count
        return blocks

    def _run_of(self, count: int) -> np.ndarray | None:
        """The first ``count`` ids of the smallest free run of at least ``count`` blocks; None if there is none."""
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        if self._free_count == self.num_blocks:  # nothing allocated: the whole pool is one run
            return np.arange(count, dtype=np.int64)
        edges = np.diff(np.concatenate(([0], self._free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        lengths = ends - starts
        fits = np.flatnonzero(lengths >= count)
        if not len(fits):
            return None
        best = fits[np.argmin(lengths[fits])]  # the first of the smallest: the lowest start among equals
        return np.arange(starts[best], starts[best] + count, dtype=np.int64)

    def free(self, blocks: np.ndarray) -> None:
        self._free[np.asarray(blocks, dtype=np.int64)] = True
        self._free_count += len(blocks)
