"""Pack and unpack kernels: a box of a rank's pools to and from a flat staging buffer.

The packed order is ``[layer, kv, head, block, token, dim]`` (what ``views.gather`` returns), whatever the pool
layout, so two ranks with different layouts exchange boxes. On VRAM one CUDA kernel launch per box and
direction (cupy RawKernel, one thread per element, every element width); on DRAM numpy gather/scatter.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind
from nixl_kv.memory import array_module, on_device
from nixl_kv.views import gather, scatter

_SOURCE = r"""
extern "C" __global__ void copy_box(
    const unsigned long long* pools, const long long* blocks, ELEM* packed, long long total,
    int layer_start, int kv_factor, int head_start, int num_heads, int num_blocks, int tokens, int dim,
    long long s_block, long long s_layer, long long s_kv, long long s_head, long long s_token,
    int per_layer_pools, int to_pools)
{
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i;
        int d = r % dim; r /= dim;
        int t = r % tokens; r /= tokens;
        int b = r % num_blocks; r /= num_blocks;
        int h = r % num_heads + head_start; r /= num_heads;
        int k = r % kv_factor;
        int l = r / kv_factor + layer_start;
        long long offset = blocks[b] * s_block + h * s_head + t * s_token + d;
        ELEM* pool;
        if (per_layer_pools) {
            pool = (ELEM*)pools[l * kv_factor + k];
        } else {
            pool = (ELEM*)pools[0];
            offset += l * s_layer + k * s_kv;
        }
        if (to_pools) pool[offset] = packed[i]; else packed[i] = pool[offset];
    }
}
"""
_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


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
    return H * T * D, 0, 0, T * D, D


def copy_box(
    layout: KVLayout, views: list[Any], blocks: Any, layers: range, heads: range, flat: Any, to_pools: bool
) -> int:
    """Pack the box into ``flat`` (bytes) or, with ``to_pools``, unpack it from there; returns the bytes moved.
    The work is finished when this returns (a peer may read the packed bytes at once)."""
    count = len(layers) * layout.kv_factor * len(heads) * len(blocks) * layout.tokens_per_block * layout.head_dim
    nbytes = count * layout.itemsize
    with on_device(layout.pools[0]):
        if layout.pools[0].memory is MemoryKind.DRAM:
            if to_pools:
                scatter(layout, views, blocks, layers, heads, flat[:nbytes].view(views[0].dtype))
            else:
                flat[:nbytes] = gather(layout, views, blocks, layers, heads).reshape(-1).view(np.uint8)
            return nbytes
        cupy = array_module(MemoryKind.VRAM)
        pools = cupy.asarray([pool.address for pool in layout.pools], dtype=cupy.uint64)
        block_ids = cupy.asarray(np.asarray(blocks, dtype=np.int64))
        packed = flat[:nbytes].view(views[0].dtype)
        threads = 256
        grid = max(1, min((count + threads - 1) // threads, 65535 * 8))
        args = (
            pools, block_ids, packed, np.int64(count), np.int32(layers.start), np.int32(layout.kv_factor),
            np.int32(heads.start), np.int32(len(heads)), np.int32(len(blocks)), np.int32(layout.tokens_per_block),
            np.int32(layout.head_dim), *(np.int64(s) for s in _element_strides(layout)),
            np.int32(layout.kind is not LayoutKind.BLOCK_MAJOR), np.int32(to_pools),
        )  # fmt: skip
        _kernel(layout.itemsize)((grid,), (threads,), args)
    return nbytes
