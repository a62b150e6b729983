"""Where a rank's KV bytes live: pools of memory and the order of (block, layer, kv, head, token, dim) in them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class LayoutKind(str, Enum):
    """Pool layouts the library can read from and write to.

    BLOCK_MAJOR: one pool ``[block, layer, kv, head, token, dim]``; a block is contiguous over all of the rank's
    layers (the reference cache manager's layout).
    PER_LAYER_NHD: one pool per (layer, kv) ``[block, token, head, dim]`` (vLLM's layout).
    PER_LAYER_HND: one pool per (layer, kv) ``[block, head, token, dim]``.
    PER_LAYER_HKND: one pool per layer ``[block, head, kv, ...]``, vLLM's CPU attention layout (its "vec" kernels):
    per block and head, K dim-major ``[dim, token]``, then V token-major ``[token, dim]``. A unit (a head's K or V
    of a block) holds the same bytes as elsewhere, in another order: only an HKND pool of the same block size reads
    it as it is (``same_interior``); any other pairing is staged, and packing reorders K.
    """

    BLOCK_MAJOR = "block_major"
    PER_LAYER_NHD = "per_layer_nhd"
    PER_LAYER_HND = "per_layer_hnd"
    PER_LAYER_HKND = "per_layer_hknd"


class MemoryKind(str, Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True)
class MemoryRegion:
    """A registered range of memory a peer may read."""

    address: int
    nbytes: int
    device_id: int
    memory: MemoryKind


@dataclass(frozen=True)
class Parts:
    """A box's blocks as token runs of this rank's blocks, where the peer's blocks hold another number of tokens.

    Entry i is tokens ``[index[i] * tokens, (index[i] + 1) * tokens)`` of the box's i-th block. Packed data
    (``[layer, kv, head, token, dim]``, whole peer blocks) holds ``runs`` runs of ``tokens`` per (layer, kv, head);
    entry i is run ``skip + i``. The runs before ``skip`` and after the last entry are tokens this rank does not take
    (it holds them already: prefix reuse; or they lie past the request's end). ``peer_tokens``: the tokens of one
    peer block (whole block-major peer segments are ``[block, layer, kv, head, token, dim]``)."""

    tokens: int
    index: np.ndarray
    skip: int = 0
    runs: int = 0
    peer_tokens: int = 0

    @property
    def peer_blocks(self) -> int:
        """Whole peer blocks in the packed data."""
        return self.runs * self.tokens // self.peer_tokens


@dataclass(frozen=True)
class KVLayout:
    """The shape and placement of one rank's paged KV cache.

    A *segment* is the contiguous bytes of one block in one pool: the whole block for BLOCK_MAJOR, one
    (layer, kv) slice of the block for the per-layer kinds. Direct reads address *units* (``unit_bytes``)
    through one strided descriptor row per pool.
    """

    kind: LayoutKind
    num_blocks: int
    num_layers: int
    kv_factor: int
    num_heads: int
    tokens_per_block: int
    head_dim: int
    itemsize: int
    pools: tuple[MemoryRegion, ...]

    @property
    def num_pools(self) -> int:
        if self.kind is LayoutKind.BLOCK_MAJOR:
            return 1
        return self.num_layers if self.kind is LayoutKind.PER_LAYER_HKND else self.num_layers * self.kv_factor

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one (layer, kv) slice of one block."""
        return self.num_heads * self.tokens_per_block * self.head_dim * self.itemsize

    @property
    def segment_bytes(self) -> int:
        if self.kind is LayoutKind.BLOCK_MAJOR:
            return self.num_layers * self.kv_factor * self.chunk_bytes
        if self.kind is LayoutKind.PER_LAYER_HKND:
            return self.kv_factor * self.chunk_bytes
        return self.chunk_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.segment_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all pools."""
        return self.num_layers * self.kv_factor * self.chunk_bytes

    def problems(self) -> list[str]:
        """Inconsistencies between the dimensions and the pools; empty when the layout is usable."""
        found = []
        dims = (self.num_blocks, self.num_layers, self.kv_factor, self.num_heads, self.tokens_per_block)
        if min(dims + (self.head_dim, self.itemsize)) < 1:
            found.append("every dimension must be at least 1")
        if self.kv_factor not in (1, 2):
            found.append(f"kv_factor must be 1 or 2, got {self.kv_factor}")
        if len(self.pools) != self.num_pools:
            found.append(f"{self.kind.value} needs {self.num_pools} pools, got {len(self.pools)}")
        if (
            min(dims + (self.head_dim, self.itemsize)) >= 1
            and self.num_pools * self.pool_bytes // self.unit_bytes >= 1 << 31
        ):
            found.append("pools x units must stay below 2**31 descriptors")
        for i, pool in enumerate(self.pools):
            if pool.nbytes < self.pool_bytes:
                found.append(f"pool {i} holds {pool.nbytes} bytes, the layout needs {self.pool_bytes}")
        return found

    def same_interior(self, other: KVLayout) -> bool:
        """Whether a unit (a head's tokens of a block) orders its elements alike on both sides, so that bytes can
        move as they are: everywhere but HKND, whose K is dim-major, which only another HKND of its block size does."""
        hknd = (self.kind is LayoutKind.PER_LAYER_HKND, other.kind is LayoutKind.PER_LAYER_HKND)
        if not any(hknd):
            return True
        return all(hknd) and self.tokens_per_block == other.tokens_per_block

    @property
    def heads_adjacent(self) -> bool:
        """True when consecutive heads of one (layer, kv) follow each other in memory (a head range is one run)."""
        return self.kind in (LayoutKind.BLOCK_MAJOR, LayoutKind.PER_LAYER_HND)

    @property
    def heads_inner(self) -> bool:
        """True when each head's tokens are contiguous (``[.., head, token, dim]``): head ranges read directly."""
        return self.kind is not LayoutKind.PER_LAYER_NHD

    @property
    def unit_bytes(self) -> int:
        """The direct-read unit: one head's tokens of a block when heads are inner, else a whole chunk."""
        per_head = self.tokens_per_block * self.head_dim * self.itemsize
        return per_head if self.heads_inner else self.chunk_bytes

    def unit_descriptors(self, coarse: bool = False) -> np.ndarray:
        """Strided NIXL rows, one per pool, enumerating every direct-read unit in memory order; ``coarse``
        units are whole segments (a block of all layers for BLOCK_MAJOR, a (layer, kv) chunk otherwise)."""
        unit = self.segment_bytes if coarse else self.unit_bytes
        rows = [(pool.address, unit, pool.device_id, unit, self.pool_bytes // unit) for pool in self.pools]
        return np.array(rows, dtype=np.uint64).reshape(-1, 5)

    def block_stride(self, coarse: bool) -> int:
        """How far a unit's descriptor index moves when its block id grows by one: every index of
        ``segment_indices``/``unit_indices`` is affine in its block id (``nixl_kv.gen.plan_cache`` relies on it)."""
        if coarse or self.kind is LayoutKind.PER_LAYER_NHD:
            return 1
        if self.kind is LayoutKind.BLOCK_MAJOR:
            return self.num_layers * self.kv_factor * self.num_heads
        if self.kind is LayoutKind.PER_LAYER_HKND:
            return self.num_heads * self.kv_factor
        return self.num_heads

    def unit_addresses(self, indices: np.ndarray, coarse: bool, split: int = 1) -> np.ndarray:
        """The addresses of descriptor entries of ``unit_descriptors(coarse)``, by index; with ``split``, of the
        units cut into that many equal parts (index ``unit * split + part``)."""
        unit = (self.segment_bytes if coarse else self.unit_bytes) // split
        per_pool = self.pool_bytes // unit
        index = np.asarray(indices, dtype=np.int64)
        bases = np.array([pool.address for pool in self.pools], dtype=np.int64)
        return bases[index // per_pool] + (index % per_pool) * unit

    def segment_indices(self, blocks: np.ndarray, layers: range) -> np.ndarray:
        """Coarse-unit indices of whole blocks (BLOCK_MAJOR: all layers) or of the given layers' chunks."""
        b = np.asarray(blocks, dtype=np.int64)
        if self.kind is LayoutKind.BLOCK_MAJOR:
            return b.astype(np.int32)
        if self.kind is LayoutKind.PER_LAYER_HKND:
            per_layer = np.arange(layers.start, layers.stop, dtype=np.int64)
            return (per_layer[:, None] * self.num_blocks + b[None, :]).reshape(-1).astype(np.int32)
        chunks = np.arange(layers.start * self.kv_factor, layers.stop * self.kv_factor, dtype=np.int64)
        return (chunks[:, None] * self.num_blocks + b[None, :]).reshape(-1).astype(np.int32)

    def unit_indices(self, blocks: np.ndarray, layers: range, heads: range | None, block_first: bool) -> np.ndarray:
        """Descriptor indices of the units of a box, in the logical order (block, layer, kv, head) when
        ``block_first`` else (layer, kv, block, head). ``layers`` and ``heads`` are local; ``heads`` is None for
        whole chunks (NHD). Both sides of a read use the same logical order, so entry i matches entry i."""
        grid = self._unit_grid(blocks, layers, heads, block_first)
        return np.ascontiguousarray(self._unit_index(grid), dtype=np.int32).reshape(-1)

    def part_addresses(
        self,
        blocks: np.ndarray,
        parts: Parts,
        layers: range,
        heads: range | None,
        block_first: bool,
    ) -> np.ndarray:
        """Addresses of the units of a box whose i-th block is only its token run ``parts.index[i]`` (a peer's
        blocks hold fewer tokens), in ``unit_indices``' order: a unit's run is one contiguous ``unit_bytes /
        split`` bytes (a head's tokens, or for NHD a chunk, of whole tokens)."""
        split = self.split_of(parts.tokens)
        grid = self._unit_grid(blocks, layers, heads, block_first)
        index = self._unit_index(grid) * split + np.asarray(parts.index, dtype=np.int64).reshape(grid["b"].shape)
        return self.unit_addresses(index.reshape(-1), False, split)

    def split_of(self, tokens: int) -> int:
        """How many runs of ``tokens`` tokens a block holds (``tokens`` must divide ``tokens_per_block``)."""
        if tokens < 1 or self.tokens_per_block % tokens:
            raise ValueError(f"runs of {tokens} tokens do not divide blocks of {self.tokens_per_block}")
        return self.tokens_per_block // tokens

    def _unit_grid(
        self, blocks: np.ndarray, layers: range, heads: range | None, block_first: bool
    ) -> dict[str, np.ndarray]:
        """The box's block, layer, kv and head indices as arrays broadcasting over the logical order."""
        b = np.asarray(blocks, dtype=np.int64)
        l_ = np.arange(layers.start, layers.stop, dtype=np.int64)
        k = np.arange(self.kv_factor, dtype=np.int64)
        h = np.arange(heads.start, heads.stop, dtype=np.int64) if heads is not None else np.zeros(1, np.int64)
        axes = ("b", "l", "k", "h") if block_first else ("l", "k", "b", "h")
        return {
            name: values.reshape([-1 if axis == name else 1 for axis in axes])
            for name, values in (("b", b), ("l", l_), ("k", k), ("h", h))
        }

    def _unit_index(self, grid: dict[str, np.ndarray]) -> np.ndarray:
        """The unit index of every point of a ``_unit_grid`` (int64, the grid's full shape)."""
        L, K, H, NB = self.num_layers, self.kv_factor, self.num_heads, self.num_blocks
        if self.kind is LayoutKind.BLOCK_MAJOR:
            return ((grid["b"] * L + grid["l"]) * K + grid["k"]) * H + grid["h"]
        if self.kind is LayoutKind.PER_LAYER_HND:
            return ((grid["l"] * K + grid["k"]) * NB + grid["b"]) * H + grid["h"]
        if self.kind is LayoutKind.PER_LAYER_HKND:
            return ((grid["l"] * NB + grid["b"]) * H + grid["h"]) * K + grid["k"]
        return (grid["l"] * K + grid["k"]) * NB + grid["b"] + grid["h"] * 0

    def chunk_addresses(self, blocks: np.ndarray, layers: range, block_first: bool) -> np.ndarray:
        """Addresses of a box's (block, layer, kv) chunks (all heads), ordered (block, layer, kv) when
        ``block_first`` else (layer, kv, block); both sides of a read list a box in the same order."""
        if self.kind is LayoutKind.PER_LAYER_HKND:
            raise ValueError("a per_layer_hknd chunk is not contiguous: address it by head units")
        b = np.asarray(blocks, dtype=np.int64)
        chunks = np.arange(layers.start * self.kv_factor, layers.stop * self.kv_factor, dtype=np.int64)
        if self.kind is LayoutKind.BLOCK_MAJOR:
            grid = b[:, None] * (self.num_layers * self.kv_factor) + chunks[None, :]
            addresses = self.pools[0].address + grid * self.chunk_bytes
        else:
            bases = np.array([pool.address for pool in self.pools], dtype=np.int64)
            addresses = bases[chunks][None, :] + b[:, None] * self.chunk_bytes
        return (addresses if block_first else addresses.T).reshape(-1)


@dataclass(frozen=True)
class RnnLayout:
    """One rank's Mamba state pools: ``[layer, slot, ...]`` in one region per pool kind (TensorRT-LLM's
    layout), or one region per layer holding ``[slot, ...]`` (vLLM's). Conv and SSM have their own dtypes.
    ``conv_slot_stride`` / ``ssm_slot_stride``: bytes from one slot to the next inside a per-layer region, where slots
    are not packed (vLLM's hybrid cache keeps a layer's conv and SSM state in one padded page per block); 0: packed."""

    num_layers: int
    num_slots: int
    conv_channels: int
    conv_width: int  # d_conv - 1
    conv_itemsize: int
    num_heads: int
    head_dim: int
    d_state: int
    ssm_itemsize: int
    conv_pools: tuple[MemoryRegion, ...]
    ssm_pools: tuple[MemoryRegion, ...]
    conv_slot_stride: int = 0
    ssm_slot_stride: int = 0

    @property
    def channel_bytes(self) -> int:
        return self.conv_width * self.conv_itemsize

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.d_state * self.ssm_itemsize

    @property
    def conv_slot_bytes(self) -> int:
        return self.conv_channels * self.channel_bytes

    @property
    def ssm_slot_bytes(self) -> int:
        return self.num_heads * self.head_bytes

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return self.conv_pools + self.ssm_pools

    def conv_address(self, layers: np.ndarray, slot: int) -> np.ndarray:
        """Where the slot's conv state of each (local) layer starts."""
        stride = self.conv_slot_stride or self.conv_slot_bytes
        return _addresses(self.conv_pools, self.num_slots * stride, stride, layers, slot)

    def ssm_address(self, layers: np.ndarray, slot: int) -> np.ndarray:
        stride = self.ssm_slot_stride or self.ssm_slot_bytes
        return _addresses(self.ssm_pools, self.num_slots * stride, stride, layers, slot)

    def problems(self) -> list[str]:
        found = []
        dims = (self.num_layers, self.num_slots, self.conv_channels, self.conv_width, self.conv_itemsize)
        if min(dims + (self.num_heads, self.head_dim, self.d_state, self.ssm_itemsize)) < 1:
            return ["every RNN state dimension must be at least 1"]
        for name, pools, slot_bytes, stride in (
            ("conv", self.conv_pools, self.conv_slot_bytes, self.conv_slot_stride),
            ("ssm", self.ssm_pools, self.ssm_slot_bytes, self.ssm_slot_stride),
        ):
            layer_bytes = self.num_slots * slot_bytes
            if stride:  # strided slots: per-layer regions only, each slot inside its stride
                if stride < slot_bytes or len(pools) != self.num_layers:
                    found.append(f"{name} slot stride {stride} needs {self.num_layers} pools and >= {slot_bytes} bytes")
                    continue
                need = (self.num_slots - 1) * stride + slot_bytes
            elif len(pools) == 1:
                need = self.num_layers * layer_bytes
            elif len(pools) == self.num_layers:
                need = layer_bytes
            else:
                found.append(f"{name} state needs 1 or {self.num_layers} pools, got {len(pools)}")
                continue
            found += [
                f"{name} pool {i} holds {p.nbytes} bytes, needs {need}" for i, p in enumerate(pools) if p.nbytes < need
            ]
        return found


def _addresses(
    pools: tuple[MemoryRegion, ...], layer_bytes: int, slot_bytes: int, layers: np.ndarray, slot: int
) -> np.ndarray:
    layers = np.asarray(layers, dtype=np.int64)
    if len(pools) == 1:
        return pools[0].address + layers * layer_bytes + slot * slot_bytes
    return np.array([pool.address for pool in pools], dtype=np.int64)[layers] + slot * slot_bytes
