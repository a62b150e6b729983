"""The MLA formatter: one latent "head" per layer (kv factor 1), replicated over the TP ranks.

Replication is the standard topology's duplicated-head case (one kv head, TP ranks holding it): a gen rank
reads each PP slice from one TP duplicate, and the readers spread over the duplicates. Gen-side CP splits a
request's blocks contiguously over the gen CP ranks. The DSA indexer-K cache (uint8, ``indexer_dim`` bytes of
quantized key plus a 4-byte scale per quant block, per token and layer) lives in its own pools with the same
block ids; it follows the latent cache box by box, read directly as (block, layer) chunks merged into runs.
What MLA does not support is refused before any byte moves.
"""

from __future__ import annotations

import numpy as np

from formatters.standard import StandardFormatter, _to_local
from nixl_kv.errors import IncompatibleStateError, NotSupportedError
from nixl_kv.interfaces import Box, RangeRead, ReadRequest
from nixl_kv.layout import LayoutKind
from nixl_kv.pool_checks import check_indexer_pools
from nixl_kv.ranges import coalesce
from nixl_kv.state import AttentionType, CacheState
from nixl_kv.topology import PeerSlice, Share


class MLAFormatter(StandardFormatter):
    attention_type = AttentionType.MLA

    def inquire_support(self, self_state: CacheState, peer_state: CacheState) -> None:
        super().inquire_support(self_state, peer_state)
        for side, state in (("gen", self_state), ("ctx", peer_state)):
            if state.kv_factor != 1 or set(state.model.num_kv_heads_per_layer) != {1}:
                raise IncompatibleStateError(f"{side}: an MLA cache has kv_factor 1 and one latent head per layer")
        indexer = [
            f"{name}: ours {getattr(self_state, name)!r}, peer {getattr(peer_state, name)!r}"
            for name in ("has_indexer_k_cache", "indexer_dim", "indexer_k_quant_block_size")
            if self_state.has_indexer_k_cache | peer_state.has_indexer_k_cache
            and getattr(self_state, name) != getattr(peer_state, name)
        ]
        if indexer:
            raise IncompatibleStateError("ctx and gen indexer-K caches differ: " + "; ".join(indexer))
        if peer_state.parallel.cp != 1:
            raise NotSupportedError(f"MLA needs ctx CP 1 (ctx has cp={peer_state.parallel.cp}); gen CP is supported")

    def box_extras(
        self, request: ReadRequest, piece: PeerSlice, mine: Share, theirs: Share, local_blocks: np.ndarray
    ) -> list[RangeRead]:
        gen = request.self_state.cache
        if not gen.has_indexer_k_cache:
            return []
        remote_layout = request.peer_state.comm.ranks[piece.peer_rank].indexer
        local_layout = request.self_indexer
        remote_blocks = self._peer_blocks(request, piece.peer_rank, theirs)
        check_indexer_pools(local_layout, gen, len(mine.layers), request.self_layout.num_blocks, "gen")
        ctx_kv = request.peer_state.comm.ranks[piece.peer_rank].layout
        who = f"ctx rank {piece.peer_rank}"
        check_indexer_pools(remote_layout, gen, len(theirs.layers), ctx_kv.num_blocks, who)
        box = Box(piece.layers, piece.heads, piece.blocks)
        local, remote = _to_local(box, mine, local_blocks), _to_local(box, theirs, remote_blocks)
        block_first = local_layout.kind is remote_layout.kind is LayoutKind.BLOCK_MAJOR
        local_at = local_layout.chunk_addresses(local.block_ids, local.layers, block_first)
        remote_at = remote_layout.chunk_addresses(remote.block_ids, remote.layers, block_first)
        rows = coalesce(
            local_at,
            remote_at,
            np.full(len(local_at), local_layout.chunk_bytes),
            local_layout.pools,
            remote_layout.pools,
        )
        return [RangeRead("indexer-K cache", *rows)]
