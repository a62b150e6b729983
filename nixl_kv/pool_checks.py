"""Do a rank's KV, indexer-K and Mamba state pools hold exactly what its share of the cache state says?

Checked for the local pools when a transceiver starts (a misconfigured server fails at once, not per request)
and for a peer's pools before any byte is read from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nixl_kv.errors import IncompatibleStateError
from nixl_kv.layout import KVLayout, RnnLayout
from nixl_kv.rnn import RnnShare
from nixl_kv.state import CacheState, RnnConfig
from nixl_kv.topology import head_range, layer_range, position


def _mismatches(layout: Any, want: dict[str, int]) -> list[str]:
    wrong = [
        f"{name} {getattr(layout, name)} (expected {value})"
        for name, value in want.items()
        if getattr(layout, name) != value
    ]
    return wrong + layout.problems()


def kv_pool_problems(layout: KVLayout, state: CacheState, rank: int) -> list[str]:
    """How the rank's KV pools differ from its share of ``state`` (empty when they match). A layout that disagrees
    would be addressed by one geometry and filled by another: wrong bytes, or a NIXL error naming nothing."""
    where = position(state.parallel, rank)
    heads = state.model.num_kv_heads_per_layer
    return _mismatches(
        layout,
        {
            "num_layers": len(layer_range(state.parallel, where.pp_rank)),
            "kv_factor": state.kv_factor,
            "num_heads": len(head_range(state.parallel, heads[0], where.tp_rank)) if heads else 0,
            "tokens_per_block": state.model.tokens_per_block,
            "head_dim": state.model.head_dim,
            "itemsize": state.dtype.itemsize,
        },
    )


def check_kv_pools(layout: KVLayout, state: CacheState, rank: int, who: str) -> None:
    wrong = kv_pool_problems(layout, state, rank)
    if wrong:
        raise IncompatibleStateError(f"{who}: KV pools do not match its share of the cache state: {'; '.join(wrong)}")


def check_indexer_pools(layout: KVLayout | None, state: CacheState, num_layers: int, num_blocks: int, who: str) -> None:
    """One uint8 "head" per layer of ``indexer_bytes_per_token`` per token, as many blocks as the KV pools (the
    indexer-K cache shares their block ids)."""
    if layout is None:
        raise IncompatibleStateError(f"{who} keeps no indexer-K cache pools")
    wrong = _mismatches(
        layout,
        {
            "num_layers": num_layers,
            "kv_factor": 1,
            "num_heads": 1,
            "tokens_per_block": state.model.tokens_per_block,
            "head_dim": state.indexer_bytes_per_token,
            "itemsize": 1,
            "num_blocks": num_blocks,
        },
    )
    if wrong:
        raise IncompatibleStateError(f"{who}: indexer-K pools do not match: {'; '.join(wrong)}")


def check_rnn_pools(layout: RnnLayout, held: RnnShare, config: RnnConfig, who: str, slot: int | None = None) -> None:
    """Exactly the rank's share of the state, in the config's dtypes; ``slot``, when given, must exist."""
    wrong = _mismatches(
        layout,
        {
            "num_layers": len(held.layers),
            "conv_channels": held.num_channels,
            "conv_width": config.d_conv - 1,
            "conv_itemsize": config.conv_dtype.itemsize,
            "num_heads": len(held.heads),
            "head_dim": config.head_dim,
            "d_state": config.d_state,
            "ssm_itemsize": config.ssm_dtype.itemsize,
        },
    )
    if wrong:
        raise IncompatibleStateError(f"{who}: RNN state pools do not match its share: {'; '.join(wrong)}")
    if slot is not None:
        check_slot(layout, slot, who)


def check_slot(layout: RnnLayout, slot: int, who: str) -> None:
    if not 0 <= slot < layout.num_slots:
        raise IncompatibleStateError(f"{who}: RNN state slot {slot} outside its {layout.num_slots} slots")


def check_block_range(what: str, blocks: Any, num_blocks: int) -> None:
    """Block ids a plan reads or writes must lie inside the pool (a READ outside it would name other memory).
    ``blocks`` is an array, or a sequence of ints (the wire's tuples: Python's min and max are faster there)."""
    if not len(blocks):
        return
    low, high = (blocks.min(), blocks.max()) if isinstance(blocks, np.ndarray) else (min(blocks), max(blocks))
    if low < 0 or high >= num_blocks:
        raise IncompatibleStateError(f"{what} outside the pool of {num_blocks} blocks")
