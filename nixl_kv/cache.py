"""The reference paged KV cache and the protocol a server implements to embed nixl_kv (DESIGN §4)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from nixl_kv.allocator import BlockAllocator
from nixl_kv.dtypes import DataType
from nixl_kv.errors import BufferExhaustedError
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, RnnLayout
from nixl_kv.memory import allocate, on_device, region_of
from nixl_kv.rnn_cache import RnnStatePools
from nixl_kv.views import gather, scatter

__all__ = ["BlockAllocator", "CacheManager", "PagedKVCache"]


@runtime_checkable
class CacheManager(Protocol):
    """What nixl_kv needs from a server's KV cache manager.

    ``pin`` and ``unpin`` are called from the transceiver's progress thread: implementations must be
    thread-safe against the server's own allocate/free. On a GPU, a request's KV must be complete in memory
    (its stream synchronized) before the server calls ``respond_and_send_async`` or marks a layer done.

    ``layout`` describes the pools (registered once with the agent). ``pin`` returns a request's block ids
    and keeps them from being freed or reused until ``unpin``; the ctx side pins for the life of a transfer.

    Optional, for caches that keep more than paged KV (read with ``getattr``; absent means None):
    ``indexer_layout`` (the DSA indexer-K pools of an MLA cache, indexed by the same block ids),
    ``rnn_layout`` (Mamba state pools) with ``rnn_slot(request_id)``, the request's state slot. Every rank of an
    instance gives a request the same slot, as it gives it the same block ids; ``pin`` covers the slot too.
    ``dtype`` (the ``DataType`` of the KV elements): checked against the cache state at start, as the layout is.
    """

    @property
    def layout(self) -> KVLayout: ...

    def block_ids(self, request_id: int) -> np.ndarray: ...

    def pin(self, request_id: int) -> np.ndarray: ...

    def unpin(self, request_id: int) -> None: ...


@dataclass
class _Allocation:
    blocks: np.ndarray
    slot: int | None = None  # the Mamba state slot, for caches with RNN state
    pins: int = 0
    freed: bool = False


@dataclass
class PagedKVCache:
    """A paged KV cache for one rank, in any ``LayoutKind``, on DRAM or VRAM.

    Elements are stored as unsigned integers of the dtype's width (data moves as bytes). ``free`` of a
    pinned request is deferred until its last ``unpin``, so a transfer never reads reused blocks.
    """

    num_blocks: int
    num_layers: int
    num_heads: int
    tokens_per_block: int
    head_dim: int
    dtype: DataType
    kv_factor: int = 2
    kind: LayoutKind = LayoutKind.BLOCK_MAJOR
    memory: MemoryKind = MemoryKind.DRAM
    device_id: int = 0
    indexer_bytes_per_token: int = 0  # > 0: also keep a DSA indexer-K cache (uint8) in the same kind of pools
    rnn: RnnStatePools | None = None  # Mamba state of hybrid models, one slot per request
    pools: list[Any] = field(init=False)
    layout: KVLayout = field(init=False)
    indexer_layout: KVLayout | None = field(init=False, default=None)
    indexer_pools: list[Any] = field(init=False, default_factory=list)
    _allocator: BlockAllocator = field(init=False)
    _requests: dict[int, _Allocation] = field(init=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        L, K, H, T, D = self.num_layers, self.kv_factor, self.num_heads, self.tokens_per_block, self.head_dim
        if self.kind is LayoutKind.BLOCK_MAJOR:
            shapes = [(self.num_blocks, L, K, H, T, D)]
        elif self.kind is LayoutKind.PER_LAYER_NHD:
            shapes = [(self.num_blocks, T, H, D)] * (L * K)
        elif self.kind is LayoutKind.PER_LAYER_HKND:
            shapes = [(self.num_blocks, H, K, T, D)] * L
        else:
            shapes = [(self.num_blocks, H, T, D)] * (L * K)
        self.pools = [allocate(shape, self.dtype.storage, self.memory, self.device_id) for shape in shapes]
        for pool in self.pools:
            pool.fill(0)  # touch every page now, not on the first transfer
        self._allocator = BlockAllocator(self.num_blocks)
        self.layout = self._describe(self.kind, K, H, D, self.dtype.itemsize, self.pools)
        if self.indexer_bytes_per_token:
            per_layer = self.kind is not LayoutKind.BLOCK_MAJOR
            kind = LayoutKind.PER_LAYER_HND if per_layer else LayoutKind.BLOCK_MAJOR
            B = self.indexer_bytes_per_token
            shapes = [(self.num_blocks, 1, T, B)] * L if per_layer else [(self.num_blocks, L, 1, 1, T, B)]
            self.indexer_pools = [allocate(shape, np.dtype(np.uint8), self.memory, self.device_id) for shape in shapes]
            for pool in self.indexer_pools:
                pool.fill(0)
            self.indexer_layout = self._describe(kind, 1, 1, B, 1, self.indexer_pools)

    def _describe(self, kind: LayoutKind, kv: int, heads: int, dim: int, itemsize: int, pools: list[Any]) -> KVLayout:
        return KVLayout(
            kind=kind,
            num_blocks=self.num_blocks,
            num_layers=self.num_layers,
            kv_factor=kv,
            num_heads=heads,
            tokens_per_block=self.tokens_per_block,
            head_dim=dim,
            itemsize=itemsize,
            pools=tuple(region_of(pool, self.memory, self.device_id) for pool in pools),
        )

    # --- allocation --------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return self._allocator.free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def allocate(self, request_id: int, num_tokens: int) -> np.ndarray:
        if num_tokens < 0:
            raise ValueError(f"request {request_id}: num_tokens must not be negative, got {num_tokens}")
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id} already holds blocks")
            blocks = self._allocator.allocate(self.blocks_for(num_tokens))
            slot = None
            if self.rnn is not None:
                try:
                    slot = int(self.rnn.slots.allocate(1)[0])
                except BufferExhaustedError:
                    self._allocator.free(blocks)
                    raise
            self._requests[request_id] = _Allocation(blocks, slot)
            return blocks

    def free(self, request_id: int) -> None:
        """Give the request's blocks back; deferred while a transfer still pins them."""
        with self._lock:
            entry = self._requests[request_id]
            entry.freed = True
            self._release_if_done(request_id, entry)

    # --- CacheManager protocol --------------------------------------------------------------------------
    def block_ids(self, request_id: int) -> np.ndarray:
        with self._lock:
            entry = self._requests.get(request_id)
        if entry is None:
            raise KeyError(f"request {request_id} holds no blocks in this cache")
        return entry.blocks

    def pin(self, request_id: int) -> np.ndarray:
        with self._lock:
            entry = self._requests.get(request_id)
            if entry is None or entry.freed:
                raise KeyError(f"request {request_id} holds no blocks in this cache")
            entry.pins += 1
            return entry.blocks

    def unpin(self, request_id: int) -> None:
        with self._lock:
            entry = self._requests[request_id]
            if entry.pins < 1:
                raise ValueError(f"request {request_id} is not pinned")
            entry.pins -= 1
            self._release_if_done(request_id, entry)

    def _release_if_done(self, request_id: int, entry: _Allocation) -> None:
        if entry.freed and entry.pins <= 0:
            del self._requests[request_id]
            self._allocator.free(entry.blocks)
            if entry.slot is not None:
                self.rnn.slots.free([entry.slot])

    @property
    def pinned_requests(self) -> int:
        """Requests whose blocks a transfer still pins (none once every transfer has ended)."""
        with self._lock:
            return sum(entry.pins > 0 for entry in self._requests.values())

    @property
    def rnn_layout(self) -> RnnLayout | None:
        return None if self.rnn is None else self.rnn.layout

    def rnn_slot(self, request_id: int) -> int:
        with self._lock:
            entry = self._requests.get(request_id)
        if entry is None or entry.slot is None:
            raise KeyError(f"request {request_id} holds no RNN state slot in this cache")
        return entry.slot

    # --- element access (tests, fill and verify) ---------------------------------------------------
    def read_tokens(self, request_id: int, num_tokens: int) -> Any:
        """The request's first ``num_tokens`` tokens as ``[layer, kv, head, token, dim]`` (a copy)."""
        return self._read(self.layout, self.pools, request_id, num_tokens)

    def write_tokens(self, request_id: int, values: Any) -> None:
        """Write ``[layer, kv, head, token, dim]`` values into the request's first tokens. Synchronous, also
        on a GPU: a transfer may read the blocks as soon as this returns."""
        self._write(self.layout, self.pools, request_id, values)

    def read_indexer(self, request_id: int, num_tokens: int) -> Any:
        """The request's first indexer-K tokens as ``[layer, token, bytes]`` (a copy)."""
        return self._read(self.indexer_layout, self.indexer_pools, request_id, num_tokens)[:, 0, 0]

    def write_indexer(self, request_id: int, values: Any) -> None:
        """Write ``[layer, token, bytes]`` into the request's first indexer-K tokens (synchronous)."""
        self._write(self.indexer_layout, self.indexer_pools, request_id, values[:, None, None])

    def _read(self, layout: KVLayout, pools: list[Any], request_id: int, num_tokens: int) -> Any:
        blocks, layers = self.block_ids(request_id), range(self.num_layers)
        with on_device(layout.pools[0]):
            return gather(layout, pools, blocks, layers, range(layout.num_heads))[..., :num_tokens, :]

    def _write(self, layout: KVLayout, pools: list[Any], request_id: int, values: Any) -> None:
        blocks, layers, heads = self.block_ids(request_id), range(self.num_layers), range(layout.num_heads)
        with on_device(layout.pools[0]):
            full = gather(layout, pools, blocks, layers, heads)
            full[..., : values.shape[3], :] = values
            scatter(layout, pools, blocks, layers, heads, full)
