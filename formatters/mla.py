"""The MLA formatter: one latent "head" per layer (kv factor 1), replicated over the TP ranks.

Replication is the standard topology's duplicated-head case (one kv head, TP ranks holding it): a gen rank
reads each PP slice from one TP duplicate, and the readers spread over the duplicates. Gen-side CP splits a
request's blocks contiguously over the gen CP ranks. What MLA does not support is refused before any byte moves.
"""

from __future__ import annotations

from formatters.standard import StandardFormatter
from nixl_kv.errors import IncompatibleStateError, NotSupportedError
from nixl_kv.state import AttentionType, CacheState


class MLAFormatter(StandardFormatter):
    attention_type = AttentionType.MLA

    def inquire_support(self, self_state: CacheState, peer_state: CacheState) -> None:
        super().inquire_support(self_state, peer_state)
        for side, state in (("gen", self_state), ("ctx", peer_state)):
            if state.kv_factor != 1 or set(state.model.num_kv_heads_per_layer) != {1}:
                raise IncompatibleStateError(f"{side}: an MLA cache has kv_factor 1 and one latent head per layer")
            if state.has_indexer_k_cache:
                raise NotSupportedError(f"{side}: the DSA indexer-K cache is not supported yet")
        if peer_state.parallel.cp != 1:
            raise NotSupportedError(f"MLA needs ctx CP 1 (ctx has cp={peer_state.parallel.cp}); gen CP is supported")
