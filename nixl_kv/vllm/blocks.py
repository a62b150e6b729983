"""vLLM's blocks as nixl_kv's cache-manager protocol (``nixl_kv.cache.CacheManager``).

vLLM's scheduler owns allocation; this only remembers which blocks each in-flight request has and how many
transfers pin them, so the worker can tell vLLM when it may free them (``pinned``) and never earlier.
"""

from __future__ import annotations

import threading

import numpy as np

from nixl_kv.layout import KVLayout


class VllmBlocks:
    def __init__(self, layout: KVLayout) -> None:
        self._layout = layout
        self._lock = threading.Lock()
        self._blocks: dict[int, np.ndarray] = {}
        self._pins: dict[int, int] = {}

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def register(self, request_id: int, block_ids: tuple[int, ...]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self._layout.num_blocks]
        if bad:
            raise ValueError(f"request {request_id}: block ids {bad[:4]} outside the {self._layout.num_blocks} blocks")
        with self._lock:
            self._blocks[request_id] = np.asarray(block_ids, dtype=np.int64)
            self._pins[request_id] = 0

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._blocks.pop(request_id, None)
            self._pins.pop(request_id, None)

    def pinned(self, request_id: int) -> bool:
        with self._lock:
            return self._pins.get(request_id, 0) > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    # --- CacheManager protocol (called from the transceiver's progress thread too) -------------------------------
    def block_ids(self, request_id: int) -> np.ndarray:
        with self._lock:
            blocks = self._blocks.get(request_id)
        if blocks is None:
            raise KeyError(f"request {request_id} holds no blocks in this cache")
        return blocks

    def pin(self, request_id: int) -> np.ndarray:
        with self._lock:
            blocks = self._blocks.get(request_id)
            if blocks is None:
                raise KeyError(f"request {request_id} holds no blocks in this cache")
            self._pins[request_id] += 1
            return blocks

    def unpin(self, request_id: int) -> None:
        with self._lock:
            if self._pins.get(request_id, 0) < 1:
                raise ValueError(f"request {request_id} is not pinned")
            self._pins[request_id] -= 1
