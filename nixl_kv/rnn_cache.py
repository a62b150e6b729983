"""The reference Mamba state store: per layer and request slot, a conv state and an SSM state (DESIGN §4).

Pools are ``[layer, slot, channels, d_conv - 1]`` and ``[layer, slot, heads, head_dim, d_state]`` (one region
each, TensorRT-LLM's layout) or one ``[slot, ...]`` region per layer (``per_layer``, vLLM's). Slots are handed
out lowest first; ``PagedKVCache`` ties a request's slot to its blocks (pinned and freed together).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nixl_kv.allocator import BlockAllocator
from nixl_kv.dtypes import DataType
from nixl_kv.layout import MemoryKind, RnnLayout
from nixl_kv.memory import allocate, array_module, on_device, region_of


@dataclass
class RnnStatePools:
    num_layers: int
    num_slots: int
    conv_channels: int
    d_conv: int
    conv_dtype: DataType
    num_heads: int
    head_dim: int
    d_state: int
    ssm_dtype: DataType
    per_layer: bool = False
    memory: MemoryKind = MemoryKind.DRAM
    device_id: int = 0
    conv: list[Any] = field(init=False)
    ssm: list[Any] = field(init=False)
    layout: RnnLayout = field(init=False)
    slots: BlockAllocator = field(init=False)

    def __post_init__(self) -> None:
        conv_shape = (self.num_slots, self.conv_channels, self.d_conv - 1)
        ssm_shape = (self.num_slots, self.num_heads, self.head_dim, self.d_state)
        self.conv = self._pools(conv_shape, self.conv_dtype)
        self.ssm = self._pools(ssm_shape, self.ssm_dtype)
        self.slots = BlockAllocator(self.num_slots)
        self.layout = RnnLayout(
            num_layers=self.num_layers,
            num_slots=self.num_slots,
            conv_channels=self.conv_channels,
            conv_width=self.d_conv - 1,
            conv_itemsize=self.conv_dtype.itemsize,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            d_state=self.d_state,
            ssm_itemsize=self.ssm_dtype.itemsize,
            conv_pools=tuple(region_of(pool, self.memory, self.device_id) for pool in self.conv),
            ssm_pools=tuple(region_of(pool, self.memory, self.device_id) for pool in self.ssm),
        )

    def _pools(self, per_layer_shape: tuple[int, ...], dtype: DataType) -> list[Any]:
        shapes = [per_layer_shape] * self.num_layers if self.per_layer else [(self.num_layers, *per_layer_shape)]
        pools = [allocate(shape, dtype.storage, self.memory, self.device_id) for shape in shapes]
        for pool in pools:
            pool.fill(0)  # touch every page now
        return pools

    def read(self, slot: int) -> tuple[Any, Any]:
        """The slot's state as ``[layer, channels, d_conv - 1]`` and ``[layer, heads, head_dim, d_state]``."""
        xp = array_module(self.memory)
        with on_device(self.layout.conv_pools[0]):
            if self.per_layer:
                return xp.stack([pool[slot] for pool in self.conv]), xp.stack([pool[slot] for pool in self.ssm])
            return self.conv[0][:, slot].copy(), self.ssm[0][:, slot].copy()

    def write(self, slot: int, conv: Any, ssm: Any) -> None:
        """Synchronous, also on a GPU: a transfer may read the slot as soon as this returns."""
        with on_device(self.layout.conv_pools[0]):
            for pools, values in ((self.conv, conv), (self.ssm, ssm)):
                if self.per_layer:  # separate arrays: one copy each
                    for layer, pool in enumerate(pools):
                        pool[slot] = values[layer]
                else:
                    pools[0][:, slot] = values
