"""Allocating pool memory on DRAM (numpy) or VRAM (cupy, imported only when asked for)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np

from nixl_kv.layout import MemoryKind, MemoryRegion


def array_module(memory: MemoryKind) -> ModuleType:
    """numpy for DRAM, cupy for VRAM."""
    if memory is MemoryKind.DRAM:
        return np
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError("VRAM pools need cupy: install nixl-kv[gpu-cu12] or nixl-kv[gpu-cu13]") from exc
    return cupy


def allocate(shape: tuple[int, ...], dtype: np.dtype, memory: MemoryKind, device_id: int = 0) -> Any:
    """A zeroed array on the requested memory."""
    xp = array_module(memory)
    if memory is MemoryKind.VRAM:
        with xp.cuda.Device(device_id):
            return xp.zeros(shape, dtype=dtype)
    return np.zeros(shape, dtype=dtype)


def region_of(array: Any, memory: MemoryKind, device_id: int = 0) -> MemoryRegion:
    """The memory region an array occupies (it must be contiguous)."""
    address = array.data.ptr if memory is MemoryKind.VRAM else array.ctypes.data
    return MemoryRegion(address=int(address), nbytes=int(array.nbytes), device_id=device_id, memory=memory)


@contextmanager
def on_device(region: MemoryRegion) -> Iterator[None]:
    """Run array work on the region's GPU (cupy's current device is per thread) and wait for it to finish
    before returning, so that a peer told the bytes are ready reads finished bytes."""
    if region.memory is not MemoryKind.VRAM:
        yield
        return
    cupy = array_module(MemoryKind.VRAM)
    with cupy.cuda.Device(region.device_id):
        yield
        cupy.cuda.get_current_stream().synchronize()
