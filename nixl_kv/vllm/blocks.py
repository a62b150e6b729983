"""vLLM's blocks as nixl_kv's cache-manager protocol (``nixl_kv.cache.CacheManager``).

vLLM's scheduler owns allocation; this only remembers which blocks each in-flight request has and how many
transfers pin them, so the worker can tell vLLM when it may free them (``pinned``) and never earlier. A hybrid
model's request also has a Mamba state slot (its block of the Mamba group), pinned with its blocks.
"""

from __future__ import annotations

import threading

import numpy as np

from nixl_kv.layout import KVLayout, RnnLayout


class VllmBlocks:
    def __init__(self, layout: KVLayout, rnn_layout: RnnLayout | None = None) -> None:
        self._layout = layout
        self.rnn_layout = rnn_layout  # the CacheManager protocol's optional Mamba state pools
        self._lock = threading.Lock()
        self._blocks: dict[int, np.ndarray] = {}
        self._slots: dict[int, int] = {}
        self._pins: dict[int, int] = {}

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def register(self, request_id: int, block_ids: tuple[int, ...], slot: int | None = None) -> None:
        bad = [b for b in block_ids if not 0 <= b < self._layout.num_blocks]
        if bad:
            raise ValueError(f"request {request_id}: block ids {bad[:4]} outside the {self._layout.num_blocks} blocks")
        if (slot is None) != (self.rnn_layout is None):
            raise ValueError(f"request {request_id}: a Mamba state slot is needed exactly when the model has Mamba")
        if slot is not None and not 0 <= slot < self.rnn_layout.num_slots:
            raise ValueError(f"request {request_id}: state slot {slot} outside the {self.rnn_layout.num_slots} slots")
        with self._lock:
            self._blocks[request_id] = np.asarray(block_ids, dtype=np.int64)
            if slot is not None:
                self._slots[request_id] = slot
            self._pins[request_id] = 0

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._blocks.pop(request_id, None)
            self._slots.pop(request_id, None)
            self._pins.pop(request_id, None)

    def rnn_slot(self, request_id: int) -> int:
        with self._lock:
            slot = self._slots.get(request_id)
        if slot is None:
            raise KeyError(f"request {request_id} holds no state slot in this cache")
        return slot

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
