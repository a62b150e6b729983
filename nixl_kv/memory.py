"""Allocating pool memory on DRAM (numpy) or VRAM (cupy, imported only when asked for)."""

from __future__ import annotations

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


def to_host(array: Any) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()
