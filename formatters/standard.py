"""The standard (MHA/GQA) cache formatter.

Direct mode: when both ranks hold the same layers and heads in layouts of the same shape, a block's segments
(see ``KVLayout``) map one to one, so a request is one READ of the request's segment indices on each side;
the agent merges indices that are contiguous on both sides into long runs.
"""

from __future__ import annotations

import numpy as np

from nixl_kv.errors import IncompatibleStateError, NotSupportedError
from nixl_kv.interfaces import Formatter, PeerRead, ReadRequest
from nixl_kv.state import AttentionType, CacheState


class StandardFormatter(Formatter):
    def inquire_support(self, self_state: CacheState, peer_state: CacheState) -> None:
        differences = [
            f"{name}: ours {mine!r}, peer {theirs!r}"
            for name, mine, theirs in (
                ("attention type", self_state.attention_type, peer_state.attention_type),
                ("dtype", self_state.dtype, peer_state.dtype),
                ("kv_factor", self_state.kv_factor, peer_state.kv_factor),
                (
                    "kv heads per layer",
                    self_state.model.num_kv_heads_per_layer,
                    peer_state.model.num_kv_heads_per_layer,
                ),
                ("head_dim", self_state.model.head_dim, peer_state.model.head_dim),
                ("tokens_per_block", self_state.model.tokens_per_block, peer_state.model.tokens_per_block),
            )
            if mine != theirs
        ]
        if differences:
            raise IncompatibleStateError("ctx and gen caches differ: " + "; ".join(differences))
        if self_state.attention_type is not AttentionType.DEFAULT:
            raise IncompatibleStateError(
                f"the standard formatter does not move {self_state.attention_type.value} caches"
            )
        for side, state in (("gen", self_state), ("ctx", peer_state)):
            if state.parallel.world_size != 1 or state.parallel.enable_attention_dp:
                raise NotSupportedError(
                    f"{side} instance has tp={state.parallel.tp} pp={state.parallel.pp} cp={state.parallel.cp} "
                    f"dp={int(state.parallel.enable_attention_dp)}: multi-rank instances are not supported yet"
                )

    def plan(self, request: ReadRequest) -> list[PeerRead]:
        peer_layout = request.peer_state.comm.ranks[0].layout
        local_layout = request.self_layout
        if not local_layout.same_shape(peer_layout):
            raise NotSupportedError(
                f"ctx pool layout {peer_layout.kind.value} and gen pool layout {local_layout.kind.value} differ in "
                "shape: layout conversion is not supported yet"
            )
        tokens_per_block = local_layout.tokens_per_block
        needed = -(-request.num_tokens // tokens_per_block)
        remote_blocks = np.asarray(request.peer_block_ids[0], dtype=np.int64)
        local_blocks = np.asarray(request.local_block_ids, dtype=np.int64)
        if len(remote_blocks) != needed:
            raise IncompatibleStateError(
                f"ctx sent {len(remote_blocks)} block ids for {request.num_tokens} tokens, expected {needed}"
            )
        if len(local_blocks) < needed:
            raise IncompatibleStateError(
                f"gen request holds {len(local_blocks)} blocks, {request.num_tokens} tokens need {needed}"
            )
        _check_range("ctx block id", remote_blocks, peer_layout.num_blocks)
        _check_range("gen block id", local_blocks[:needed], local_layout.num_blocks)
        return [
            PeerRead(
                peer_rank=0,
                local_indices=local_layout.segment_indices(local_blocks[:needed]),
                remote_indices=peer_layout.segment_indices(remote_blocks),
                nbytes=needed * local_layout.block_bytes,
                expected_readers=1,
            )
        ]


def _check_range(what: str, blocks: np.ndarray, num_blocks: int) -> None:
    if len(blocks) and (blocks.min() < 0 or blocks.max() >= num_blocks):
        raise IncompatibleStateError(f"{what} outside the pool of {num_blocks} blocks")
