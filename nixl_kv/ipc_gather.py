"""Same host: copy a peer's KV straight out of its pools through CUDA IPC mappings, one kernel launch per batch.

Why (issue 33): through UCX's cuda_ipc transport every descriptor of a READ costs about 10 µs, whatever its size, so
fragmented requests (vLLM's per-layer pools: one descriptor per layer, K/V and run of blocks) move at a fraction of
the copy engine's rate. A peer on the same host can instead export its pools once (``export_pools``: a CUDA IPC
handle per pool), the reader maps them once per peer (``PeerPools``) and one kernel copies every row of a request,
or of a batch of requests, with no per-row operation (``gather_rows``). It works between two processes on one GPU
and between GPUs with peer access (the mapping is opened with lazy peer access enabled).

Rows are what a direct read posts as explicit rows (``nixl_kv.runs.coalesced_rows``, ``RangeRead``): Nx3
(address, length, device), the remote ones in the peer's addresses. The kernel's completion event takes the place
of the READ's completion in the hold proof: the bytes count only if the peer still held the blocks when the event
completed, which the caller proves as it proves a READ (its board after the copy).

The host-side work (``tile_table``, ``translate``) is numpy, so it is tested on machines without a GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from nixl_kv.errors import IncompatibleStateError
from nixl_kv.layout import MemoryKind, MemoryRegion
from nixl_kv.memory import array_module

TILE_BYTES = 1 << 18  # bytes one CUDA block copies: a 4 MiB row is 16 blocks, a 64 KiB chunk one
THREADS = 512
VECTOR_BYTES = 16
LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess

_SOURCE = r"""
extern "C" __global__ void copy_tiles(const unsigned long long* tiles, int vector)
{
    /* one tile a CUDA block: (destination, source, bytes) */
    const unsigned long long* tile = tiles + 3 * (unsigned long long)blockIdx.x;
    unsigned long long n = tile[2];
    if (vector) {
        uint4* dst = (uint4*)tile[0];
        const uint4* src = (const uint4*)tile[1];
        for (unsigned long long i = threadIdx.x; i < n / 16; i += blockDim.x) dst[i] = src[i];
    } else {
        unsigned char* dst = (unsigned char*)tile[0];
        const unsigned char* src = (const unsigned char*)tile[1];
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    }
}
"""


@dataclass(frozen=True)
class PoolHandle:
    """One exported pool: the IPC handle of the allocation holding it and where the pool starts in it."""

    handle: bytes  # cudaIpcMemHandle_t, 64 bytes
    offset: int  # the pool's start minus the allocation's
    region: MemoryRegion  # the pool, in the exporter's addresses

    def to_wire(self) -> tuple[bytes, int, int, int, int]:
        return (self.handle, self.offset, self.region.address, self.region.nbytes, self.region.device_id)

    @classmethod
    def from_wire(cls, fields: tuple[bytes, int, int, int, int]) -> PoolHandle:
        handle, offset, address, nbytes, device = fields
        if not isinstance(handle, bytes) or len(handle) != 64 or min(offset, address, nbytes, device) < 0:
            raise IncompatibleStateError("a CUDA IPC pool handle must be 64 bytes with non-negative fields")
        return cls(handle, offset, MemoryRegion(address, nbytes, device, MemoryKind.VRAM))


def export_pools(regions: tuple[MemoryRegion, ...]) -> tuple[PoolHandle, ...]:
    """The exporter: an IPC handle per VRAM pool (once, at start-up; the pools must outlive every peer's mapping)."""
    cupy = array_module(MemoryKind.VRAM)
    handles = []
    for region in regions:
        if region.memory is not MemoryKind.VRAM:
            raise IncompatibleStateError("only VRAM pools can be exported through CUDA IPC")
        with cupy.cuda.Device(region.device_id):
            base = _allocation_base(region.address)
            handles.append(
                PoolHandle(bytes(cupy.cuda.runtime.ipcGetMemHandle(region.address)), region.address - base, region)
            )
    return tuple(handles)


def _allocation_base(address: int) -> int:
    """The start of the CUDA allocation holding ``address`` (an IPC handle maps the whole allocation)."""
    driver = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if status != 0:
        raise IncompatibleStateError(f"cuMemGetAddressRange failed ({status}) for address {address:#x}")
    return base.value


class PeerPools:
    """A peer's exported pools mapped into this process on ``device_id`` (opened once per peer; ``close`` unmaps)."""

    def __init__(self, handles: tuple[PoolHandle, ...], device_id: int) -> None:
        cupy = array_module(MemoryKind.VRAM)
        self.device_id = device_id
        self._opened: list[int] = []
        with cupy.cuda.Device(device_id):
            try:
                for pool in handles:
                    self._opened.append(cupy.cuda.runtime.ipcOpenMemHandle(pool.handle, LAZY_ENABLE_PEER_ACCESS))
            except Exception:
                self.close()
                raise
        self.regions = tuple(pool.region for pool in handles)
        self.mapped = np.array([base + pool.offset for base, pool in zip(self._opened, handles, strict=True)], np.int64)

    def translate(self, remote_rows: np.ndarray) -> np.ndarray:
        return translate(remote_rows, self.regions, self.mapped)

    def close(self) -> None:
        cupy = array_module(MemoryKind.VRAM)
        with cupy.cuda.Device(self.device_id):
            while self._opened:
                cupy.cuda.runtime.ipcCloseMemHandle(self._opened.pop())


def translate(remote_rows: np.ndarray, regions: tuple[MemoryRegion, ...], mapped: np.ndarray) -> np.ndarray:
    """The rows' addresses in this process's mapping of the peer's pools (``mapped[i]``: where pool i starts here).
    A row that does not lie inside one exported pool is an IncompatibleStateError (never a wild copy)."""
    rows = np.asarray(remote_rows, dtype=np.int64).reshape(-1, 3)
    starts = np.array([r.address for r in regions], dtype=np.int64)
    ends = starts + np.array([r.nbytes for r in regions], dtype=np.int64)
    order = np.argsort(starts)
    slot = np.searchsorted(starts[order], rows[:, 0], side="right") - 1
    pool = order[np.maximum(slot, 0)]
    inside = (slot >= 0) & (rows[:, 0] + rows[:, 1] <= ends[pool]) & (rows[:, 1] >= 0)
    if not inside.all():
        raise IncompatibleStateError("a row falls outside the peer's exported pools")
    return mapped[pool] + (rows[:, 0] - starts[pool])


def tile_table(destinations: np.ndarray, sources: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, bool]:
    """(destination, source, bytes) per tile of at most TILE_BYTES, every row cut into tiles, flat uint64; and
    whether every tile may move 16-byte vectors (all addresses and lengths aligned)."""
    dst, src = np.asarray(destinations, dtype=np.int64), np.asarray(sources, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    tiles = -(-lengths // TILE_BYTES)
    row = np.repeat(np.arange(len(lengths)), tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    offset = (np.arange(len(row)) - first) * TILE_BYTES
    table = np.empty((len(row), 3), dtype=np.uint64)
    table[:, 0] = dst[row] + offset
    table[:, 1] = src[row] + offset
    table[:, 2] = np.minimum(lengths[row] - offset, TILE_BYTES)
    vector = not ((dst | src | lengths) % VECTOR_BYTES).any()
    return table.reshape(-1), vector


@cache
def _kernel() -> Any:
    return array_module(MemoryKind.VRAM).RawKernel(_SOURCE, "copy_tiles")


def gather_rows(local_rows: np.ndarray, remote_rows: np.ndarray, peer: PeerPools, stream: Any = None) -> Any:
    """Copy each remote row into its local row with one kernel launch on ``stream`` (the current one if None);
    returns the event recorded after it (its completion is the copy's). Rows of different lengths are refused."""
    return gather_sources(local_rows, remote_rows, peer.translate(remote_rows), peer.device_id, stream)


def gather_sources(
    local_rows: np.ndarray, remote_rows: np.ndarray, sources: np.ndarray, device_id: int, stream: Any = None
) -> Any:
    """``gather_rows`` with the remote rows' addresses already translated into this process (``sources``)."""
    cupy = array_module(MemoryKind.VRAM)
    local = np.asarray(local_rows, dtype=np.int64).reshape(-1, 3)
    remote = np.asarray(remote_rows, dtype=np.int64).reshape(-1, 3)
    if local.shape != remote.shape or not np.array_equal(local[:, 1], remote[:, 1]):
        raise IncompatibleStateError("local and remote rows must pair up with equal lengths")
    table, vector = tile_table(local[:, 0], sources, local[:, 1])
    with cupy.cuda.Device(device_id):
        stream = stream or cupy.cuda.get_current_stream()
        with stream:
            tiles = cupy.asarray(table)
            if len(table):
                _kernel()((len(table) // 3,), (THREADS,), (tiles, np.int32(vector)))
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record(stream)
    return event
