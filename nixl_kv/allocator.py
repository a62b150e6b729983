"""Lowest-first allocation of numbered units (KV blocks, Mamba state slots)."""

from __future__ import annotations

import numpy as np

from nixl_kv.errors import BufferExhaustedError


class BlockAllocator:
    """Free blocks as a mask; allocation takes the lowest free ids in ascending order, so a request's blocks
    tend to be contiguous and transfers merge them into long runs. Vectorised: no Python loop per block."""

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
        blocks = np.flatnonzero(self._free)[:count]
        self._free[blocks] = False
        self._free_count -= count
        return blocks

    def free(self, blocks: np.ndarray) -> None:
        self._free[np.asarray(blocks, dtype=np.int64)] = True
        self._free_count += len(blocks)
