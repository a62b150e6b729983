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

from nixl_kv.errors import IncompatibleStateError, NotSupportedError
from nixl_kv.formatters.standard import StandardFormatter
from nixl_kv.interfaces import LocalBox, RangeRead, ReadRequest
from nixl_kv.layout import LayoutKind
from nixl_kv.pool_checks import check_indexer_pools
from nixl_kv.ranges import coalesce
from nixl_kv.state import AttentionType, CacheState
from nixl_kv.topology import position


class MLAFormatter(StandardFormatter):
    attention_type = AttentionType.MLA

    def inquire_support(self, self_state: CacheState, peer_state: CacheState) -> None:
        super().inquire_support(self_state, peer_state)
        for side, state in (("gen", self_state), ("ctx", peer_state)):
            if state.kv_factor != 1 or set(state.model.num_kv_heads_per_layer) != {1}:
                raise IncompatibleStateError(f"{side}: an MLA cache has kv_factor 1 and one latent head per layer")
        if self_state.has_indexer_k_cache or peer_state.has_indexer_k_cache:
            indexer = [
                f"{name}: ours {getattr(self_state, name)!r}, peer {getattr(peer_state, name)!r}"
                for name in ("has_indexer_k_cache", "indexer_dim", "indexer_k_quant_block_size")
                if getattr(self_state, name) != getattr(peer_state, name)
            ]
            if indexer:
                raise IncompatibleStateError("ctx and gen indexer-K caches differ: " + "; ".join(indexer))
        if peer_state.parallel.cp != 1:
            raise NotSupportedError(f"MLA needs ctx CP 1 (ctx has cp={peer_state.parallel.cp}); gen CP is supported")

    def box_state(self, request: ReadRequest, peer_rank: int, local: LocalBox, remote: LocalBox) -> RangeRead | None:
        """The box's indexer-K chunks, (block, layer) by (block, layer), merged into runs. The local pools were
        checked against this rank's share when the transceiver started; the peer's are checked here."""
        state = request.self_state.cache
        if not state.has_indexer_k_cache:
            return None
        local_layout, rank = request.self_indexer, request.peer_state.comm.ranks[peer_rank]
        held = request.peer_state.cache.parallel.attention_layers_per_pp_rank
        stage = position(request.peer_state.cache.parallel, peer_rank).pp_rank
        check_indexer_pools(rank.indexer, state, held[stage], rank.layout.num_blocks, f"ctx rank {peer_rank}")
        block_first = local_layout.kind is rank.indexer.kind is LayoutKind.BLOCK_MAJOR
        local_at = local_layout.chunk_addresses(local.block_ids, local.layers, block_first)
        remote_at = rank.indexer.chunk_addresses(remote.block_ids, remote.layers, block_first)
        lengths = np.full(len(local_at), local_layout.chunk_bytes)
        return RangeRead(
            "indexer-K cache", *coalesce(local_at, remote_at, lengths, local_layout.pools, rank.indexer.pools)
        )
