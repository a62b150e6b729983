"""An instance's ranks as vLLM's tensor-parallel group: the collectives ``CacheTransceiver`` needs, over vLLM's
CPU (gloo) process group, so a TP instance's workers agree as one nixl_kv instance (``nixl_kv.comm``)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from nixl_kv.comm import CacheTransceiverComm, SingleProcessComm
from nixl_kv.errors import NotSupportedError


class TensorParallelComm:
    def __init__(self) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        self._group = group.cpu_group
        self._ranks: list[int] = list(group.ranks)  # global ranks, by rank in the group
        self.rank: int = group.rank_in_group
        self.size: int = group.world_size

    def allgather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered

    def bcast(self, value: Any, root: int = 0) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=self._ranks[root], group=self._group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def split(self, color: int, key: int) -> CacheTransceiverComm:
        """The groups a TP-only instance needs are the whole group or one rank each; others are refused."""
        colors = self.allgather(color)
        members = colors.count(color)
        if members == self.size:
            return self
        if members == 1:
            return SingleProcessComm()
        raise NotSupportedError(f"a sub-group of {members} of {self.size} tensor-parallel ranks is not supported")
