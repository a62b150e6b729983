"""Pack and unpack kernels: a box of a rank's pools to and from a flat staging buffer.

The packed order is ``[layer, kv, head, block, token, dim]`` (what ``views.gather`` returns), whatever the pool
layout, so two ranks with different layouts exchange boxes. Unpacking also takes whole block-major segments,
``[block, layer, kv, head, token, dim]`` (``segments=True``: what a gathered READ lands), without a transpose
first. A box from a peer whose blocks hold another number of tokens unpacks into token runs of our blocks
(``layout.Parts``): the kernel takes each entry's start (block and run) and skips the runs that are not ours. On
VRAM one CUDA kernel launch per box and direction (cupy RawKernel); each thread moves 16 bytes where a
head's row of ``dim`` elements is a multiple of 16 bytes (every model here), else one element. On DRAM numpy
gather/scatter.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from nixl_kv.errors import NotSupportedError
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, Parts
from nixl_kv.memory import array_module, on_device
from nixl_kv.views import gather, scatter

_SOURCE = r"""
extern "C" __global__ void copy_box(
    const unsigned long long* pools, const long long* bases, ELEM* packed, long long total,
    int layer_start, int kv_factor, int head_start, int num_heads, int num_blocks, int tokens, int dim,
    long long s_layer, long long s_kv, long long s_head, long long s_token,
    int per_layer_pools, int to_pools, int num_layers, int segments, long long packed_runs, long long skip)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i;
        int d = r % dim; r /= dim;
        int t = r % tokens; r /= tokens;
        int b, h, k, l;
        long long p = i;  /* where the element lies in ``packed`` */
        if (segments) {  /* [block, layer, kv, head, token, dim] */
            h = r % num_heads + head_start; r /= num_heads;
            k = r % kv_factor; r /= kv_factor;
            l = r % num_layers + layer_start;
            b = r / num_layers;
        } else {  /* [layer, kv, head, run, token, dim]: the box's runs are runs skip.. of packed_runs */
            b = r % num_blocks; r /= num_blocks;
            p = ((r * packed_runs + skip + b) * tokens + t) * dim + d;
            h = r % num_heads + head_start; r /= num_heads;
            k = r % kv_factor;
            l = r / kv_factor + layer_start;
        }
        long long offset = bases[b] + h * s_head + t * s_token + d;
        ELEM* pool;
        if (per_layer_pools) {
            pool = (ELEM*)pools[l * kv_factor + k];
        } else {
            pool = (ELEM*)pools[0];
            offset += l * s_layer + k * s_kv;
        }
        if (to_pools) pool[offset] = packed[p]; else packed[p] = pool[offset];
    }
}
"""
_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long", 16: "uint4"}
VECTOR_BYTES = 16


@cache
def _kernel(itemsize: int) -> Any:
    cupy = array_module(MemoryKind.VRAM)
    return cupy.RawKernel(_SOURCE.replace("ELEM", _TYPES[itemsize]), "copy_box")


def _element_strides(layout: KVLayout) -> tuple[int, int, int, int, int]:
    """(block, layer, kv, head, token) strides in elements within a pool."""
    L, K, H, T, D = layout.num_layers, layout.kv_factor, layout.num_heads, layout.tokens_per_block, layout.head_dim
    if layout.kind is LayoutKind.BLOCK_MAJOR:
        return L * K * H * T * D, K * H * T * D, H * T * D, T * D, D
    if layout.kind is LayoutKind.PER_LAYER_NHD:
        return T * H * D, 0, 0, D, H * D
    if layout.kind is LayoutKind.PER_LAYER_HKND:  # vLLM's CPU layout: no VRAM pools are ever laid out so
        raise NotSupportedError("per_layer_hknd pools are DRAM only (vLLM's CPU backend)")
    return H * T * D, 0, 0, T * D, D


def copy_box(
    layout: KVLayout,
    views: list[Any],
    blocks: Any,
    layers: range,
    heads: range,
    flat: Any,
    to_pools: bool,
    segments: bool = False,
    parts: Parts | None = None,
) -> int:
    """Pack the box into ``flat`` (bytes) or, with ``to_pools``, unpack it from there; returns the bytes moved.
    ``segments``: ``flat`` holds the box as whole block-major segments (unpacking only). ``parts``: the box lands
    in token runs of the blocks, from data of whole peer blocks of another size (unpacking only; ``layout.Parts``).
    The work is finished when this returns (a peer may read the packed bytes at once)."""
    if not to_pools and (segments or parts is not None):
        raise ValueError("packing writes whole blocks in the packed order only")
    tokens = layout.tokens_per_block if parts is None else parts.tokens
    count = len(layers) * layout.kv_factor * len(heads) * len(blocks) * tokens * layout.head_dim
    with on_device(layout.pools[0]):
        if layout.pools[0].memory is MemoryKind.DRAM:
            _copy_box_numpy(layout, views, blocks, layers, heads, flat, to_pools, segments, parts)
        else:
            _copy_box_cuda(layout, blocks, layers, heads, flat, to_pools, segments, parts)
    return count * layout.itemsize


def _copy_box_cuda(
    layout: KVLayout,
    blocks: Any,
    layers: range,
    heads: range,
    flat: Any,
    to_pools: bool,
    segments: bool,
    parts: Parts | None,
) -> None:
    """One kernel launch; runs of whole peer segments are put in the packed order first (one device copy)."""
    cupy = array_module(MemoryKind.VRAM)
    if parts is not None and segments:
        flat, segments = _packed_order(layout, flat, layers, heads, parts.peer_blocks, parts.peer_tokens), False
    tokens = layout.tokens_per_block if parts is None else parts.tokens
    pools = _pool_table(tuple(pool.address for pool in layout.pools), layout.pools[0].device_id)
    unit = _unit_bytes(layout, flat.data.ptr)
    per_unit = unit // layout.itemsize  # elements one thread moves (strides are whole rows: they divide)
    s_block, *strides = _element_strides(layout)
    bases = np.asarray(blocks, dtype=np.int64) * s_block
    if parts is not None:
        bases += np.asarray(parts.index, dtype=np.int64) * (tokens * strides[-1])
    units = len(layers) * layout.kv_factor * len(heads) * len(blocks) * tokens * layout.head_dim // per_unit
    threads = 256
    grid = max(1, min((units + threads - 1) // threads, 65535 * 8))
    args = (
        pools, cupy.asarray(bases // per_unit), flat, np.int64(units), np.int32(layers.start),
        np.int32(layout.kv_factor), np.int32(heads.start), np.int32(len(heads)), np.int32(len(blocks)),
        np.int32(tokens), np.int32(layout.head_dim // per_unit), *(np.int64(s // per_unit) for s in strides),
        np.int32(layout.kind is not LayoutKind.BLOCK_MAJOR), np.int32(to_pools), np.int32(len(layers)),
        np.int32(segments), np.int64(len(blocks) if parts is None else parts.runs),
        np.int64(0 if parts is None else parts.skip),
    )  # fmt: skip
    _kernel(unit)((grid,), (threads,), args)


@cache
def _pool_table(addresses: tuple[int, ...], device_id: int) -> Any:
    """The pools' addresses on the device, uploaded once per pool set (not per box)."""
    cupy = array_module(MemoryKind.VRAM)
    return cupy.asarray(addresses, dtype=cupy.uint64)


def _unit_bytes(layout: KVLayout, flat_address: int) -> int:
    """16-byte vectors where a row of ``dim`` elements, the buffer and every pool start allow them, else one
    element."""
    row = layout.head_dim * layout.itemsize
    starts = [flat_address, *(pool.address for pool in layout.pools)]
    aligned = all(address % VECTOR_BYTES == 0 for address in starts)
    return VECTOR_BYTES if row % VECTOR_BYTES == 0 and aligned else layout.itemsize


def _copy_box_numpy(
    layout: KVLayout,
    views: list[Any],
    blocks: Any,
    layers: range,
    heads: range,
    flat: Any,
    to_pools: bool,
    segments: bool,
    parts: Parts | None,
) -> None:
    if not to_pools:
        data = gather(layout, views, blocks, layers, heads).reshape(-1).view(np.uint8)
        flat[: len(data)] = data
        return
    if segments:
        flat = _packed_order(layout, flat, layers, heads, *_peer_blocks(layout, blocks, parts))
    if parts is None:
        count = len(blocks) * layout.tokens_per_block
        scatter(layout, views, blocks, layers, heads, _typed(layout, flat, layers, heads, count))
        return
    runs = _typed(layout, flat, layers, heads, parts.runs * parts.tokens)
    shape = (len(layers), layout.kv_factor, len(heads), parts.runs, parts.tokens, layout.head_dim)
    kept = runs.reshape(shape)[:, :, :, parts.skip : parts.skip + len(blocks)]
    scatter(layout, views, blocks, layers, heads, kept, parts)


def _peer_blocks(layout: KVLayout, blocks: Any, parts: Parts | None) -> tuple[int, int]:
    """How many whole blocks the data holds, and their tokens: ours, or with ``parts`` the peer's."""
    return (len(blocks), layout.tokens_per_block) if parts is None else (parts.peer_blocks, parts.peer_tokens)


def _typed(layout: KVLayout, flat: Any, layers: range, heads: range, tokens: int) -> Any:
    """The first ``tokens`` tokens per (layer, kv, head) of packed bytes, as elements (flat)."""
    count = len(layers) * layout.kv_factor * len(heads) * tokens * layout.head_dim
    return flat[: count * layout.itemsize].view(np.dtype(f"u{layout.itemsize}"))


def _packed_order(layout: KVLayout, flat: Any, layers: range, heads: range, blocks: int, tokens: int) -> Any:
    """Whole block-major segments ``[block, layer, kv, head, token, dim]`` of ``tokens`` tokens, as new bytes in
    the packed order ``[layer, kv, head, block, token, dim]``."""
    xp = array_module(layout.pools[0].memory)
    shape = (blocks, len(layers), layout.kv_factor, len(heads), tokens, layout.head_dim)
    values = _typed(layout, flat, layers, heads, blocks * tokens).reshape(shape)
    return xp.ascontiguousarray(values.transpose(1, 2, 3, 0, 4, 5)).reshape(-1).view(np.uint8)
