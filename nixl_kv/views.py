"""Array views of a rank's pools, built from the layout's addresses, and box gather/scatter over them.

A *box* is the product of a layer range, all kv, a head range, a list of blocks and all their tokens. Gather
returns it as ``[layer, kv, head, token, dim]`` (tokens of the blocks in list order); scatter writes such an
array back. One vectorised operation per pool: no Python loop per block, token or element.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion, Parts
from nixl_kv.memory import array_module


def pool_views(layout: KVLayout) -> list[Any]:
    """One array per pool: ``[block, layer, kv, head, token, dim]`` for BLOCK_MAJOR, ``[block, token, head,
    dim]`` (NHD), ``[block, head, token, dim]`` (HND) or ``[block, head, kv, token * dim]`` (HKND, a pool per layer,
    K dim-major: ``_hknd_chunk``) for the per-layer kinds. The memory is not owned."""
    L, K, H, T, D = layout.num_layers, layout.kv_factor, layout.num_heads, layout.tokens_per_block, layout.head_dim
    if layout.kind is LayoutKind.BLOCK_MAJOR:
        shape = (layout.num_blocks, L, K, H, T, D)
    elif layout.kind is LayoutKind.PER_LAYER_NHD:
        shape = (layout.num_blocks, T, H, D)
    elif layout.kind is LayoutKind.PER_LAYER_HKND:
        shape = (layout.num_blocks, H, K, T, D)
    else:
        shape = (layout.num_blocks, H, T, D)
    dtype = np.dtype(f"u{layout.itemsize}")
    return [_wrap(pool, shape, dtype) for pool in layout.pools]


def _wrap(region: MemoryRegion, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if region.memory is MemoryKind.VRAM:
        cupy = array_module(MemoryKind.VRAM)
        memory = cupy.cuda.UnownedMemory(region.address, nbytes, None, region.device_id)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))
    buffer = (ctypes.c_uint8 * nbytes).from_address(region.address)
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def gather(layout: KVLayout, views: list[Any], blocks: Any, layers: range, heads: range) -> Any:
    """The box as a new ``[layer, kv, head, token, dim]`` array (layers and heads are local indices)."""
    xp = array_module(layout.pools[0].memory)
    index = xp.asarray(blocks)
    n, T = len(blocks), layout.tokens_per_block
    hs = slice(heads.start, heads.stop)
    if layout.kind is LayoutKind.BLOCK_MAJOR:
        data = views[0][index, layers.start : layers.stop, :, hs]  # [n, l, K, h, T, D]
        data = data.transpose(1, 2, 3, 0, 4, 5)
        return xp.ascontiguousarray(data).reshape(len(layers), layout.kv_factor, len(heads), n * T, layout.head_dim)
    out = xp.empty((len(layers), layout.kv_factor, len(heads), n * T, layout.head_dim), dtype=views[0].dtype)
    for i, layer in enumerate(layers):
        for kv in range(layout.kv_factor):
            chunk = _chunk(layout, views, layer, kv)
            if layout.kind is LayoutKind.PER_LAYER_NHD:
                part = chunk[index, :, hs].transpose(2, 0, 1, 3)  # [n, T, h, D] -> [h, n, T, D]
            else:
                part = chunk[index, hs].transpose(1, 0, 2, 3)  # [n, h, T, D] -> [h, n, T, D]
            out[i, kv] = part.reshape(len(heads), n * T, layout.head_dim)
    return out


def _chunk(layout: KVLayout, views: list[Any], layer: int, kv: int) -> Any:
    """The (layer, kv) pool as ``[block, token, head, dim]`` (NHD) or ``[block, head, token, dim]`` (a strided view
    of the layer's pool for HKND)."""
    if layout.kind is LayoutKind.PER_LAYER_HKND:
        return _hknd_chunk(views[layer], kv, 1)[:, :, 0]
    return views[layer * layout.kv_factor + kv]


def _split_chunk(layout: KVLayout, views: list[Any], layer: int, kv: int, split: int) -> Any:
    """``_chunk`` with its token axis cut into ``[split, tokens / split]``."""
    if layout.kind is LayoutKind.PER_LAYER_HKND:
        return _hknd_chunk(views[layer], kv, split)
    axis = 1 if layout.kind is LayoutKind.PER_LAYER_NHD else 2
    return _split_tokens(views[layer * layout.kv_factor + kv], axis, split)


def _hknd_chunk(pool: Any, kv: int, split: int) -> Any:
    """K or V of an HKND layer pool as ``[block, head, split, tokens / split, dim]``, a view. vLLM's CPU attention
    keeps a block's K dim-major (``[dim, token]``: its kernel reads one dim of every token at once) and its V
    token-major (``[token, dim]``)."""
    NB, H, K, T, D = pool.shape
    if kv == 0:
        return pool.reshape(NB, H, K, D, split, T // split)[:, :, 0].transpose(0, 1, 3, 4, 2)
    return pool.reshape(NB, H, K, split, T // split, D)[:, :, kv]


def _split_tokens(pool: Any, axis: int, split: int) -> Any:
    """A pool with its token axis cut into ``[split, tokens / split]``: cut before any slicing, the pool is
    contiguous, so this is a view (writes through it land in the pool), never a copy."""
    shape = pool.shape[:axis] + (split, pool.shape[axis] // split) + pool.shape[axis + 1 :]
    return pool.reshape(shape)


def scatter(
    layout: KVLayout,
    views: list[Any],
    blocks: Any,
    layers: range,
    heads: range,
    values: Any,
    parts: Parts | None = None,
) -> None:
    """Write a ``[layer, kv, head, token, dim]`` box into the pools: whole blocks of tokens, or with ``parts`` the
    run ``parts.index[i]`` of ``parts.tokens`` tokens of each block ``blocks[i]`` (``values`` then holds those runs)."""
    xp = array_module(layout.pools[0].memory)
    n, D = len(blocks), layout.head_dim
    T = layout.tokens_per_block if parts is None else parts.tokens
    split = layout.split_of(T)
    index = (xp.asarray(blocks), xp.zeros(n, dtype=np.int64) if parts is None else xp.asarray(parts.index))
    hs = slice(heads.start, heads.stop)
    boxed = values.reshape(len(layers), layout.kv_factor, len(heads), n, T, D)
    if layout.kind is LayoutKind.BLOCK_MAJOR:  # the two index arrays lead the result: [n, layer, kv, head, T, D]
        pool = _split_tokens(views[0], 4, split)
        pool[index[0], layers.start : layers.stop, :, hs, index[1]] = boxed.transpose(3, 0, 1, 2, 4, 5)
        return
    for i, layer in enumerate(layers):
        for kv in range(layout.kv_factor):
            chunk = _split_chunk(layout, views, layer, kv, split)
            if layout.kind is LayoutKind.PER_LAYER_NHD:
                chunk[index[0], index[1], :, hs] = boxed[i, kv].transpose(1, 2, 0, 3)  # [n, T, h, D]
            else:
                chunk[index[0], hs, index[1]] = boxed[i, kv].transpose(1, 0, 2, 3)  # [n, h, T, D]
