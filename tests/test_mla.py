"""The MLA formatter in one process: a replicated latent cache (kv factor 1) and what it refuses."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nixl_kv.cache import PagedKVCache
from nixl_kv.dtypes import DataType
from nixl_kv.errors import IncompatibleStateError, NotSupportedError
from nixl_kv.formatters.mla import MLAFormatter
from nixl_kv.formatters.standard import StandardFormatter
from nixl_kv.harness.fill import Slice, count_mismatches, expected, indexer_expected
from nixl_kv.layout import LayoutKind
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.state import AttentionType, CacheState, ModelConfig, ParallelConfig
from nixl_kv.transceiver import CacheTransceiver

LAYERS, TOKENS_PER_BLOCK, LATENT = 3, 16, 32


def mla_state(**changes: object) -> CacheState:
    state = CacheState(
        ModelConfig((1,) * LAYERS, LATENT, TOKENS_PER_BLOCK),
        ParallelConfig(attention_layers_per_pp_rank=(LAYERS,)),
        DataType.BFLOAT16,
        attention_type=AttentionType.MLA,
        kv_factor=1,
    )
    return dataclasses.replace(state, **changes)


def mla_cache() -> PagedKVCache:
    return PagedKVCache(
        num_blocks=32, num_layers=LAYERS, num_heads=1, tokens_per_block=TOKENS_PER_BLOCK, head_dim=LATENT,
        dtype=DataType.BFLOAT16, kv_factor=1,
    )  # fmt: skip


def test_latent_cache_arrives_exactly() -> None:
    caches = [mla_cache(), mla_cache()]
    ctx, gen = (CacheTransceiver(cache, mla_state()) for cache in caches)
    try:
        where = Slice(0, LAYERS, 0, 1, 1, LATENT, 0, 50)
        caches[0].allocate(1, 50)
        caches[0].write_tokens(1, expected(1, where, 2))
        request = TransferRequest(1, num_tokens=50)
        ctx.respond_and_send_async(request)
        caches[1].allocate(7, 50)
        received = TransferRequest(7, context_phase_params=request.context_phase_params)
        gen.request_and_receive_sync(received)
        assert received.state is RequestState.GENERATION_TRANS_COMPLETE, received.error
        assert count_mismatches(caches[1].read_tokens(7, 50), 1, where) == 0
        assert received.transfer_bytes == 4 * TOKENS_PER_BLOCK * LAYERS * LATENT * 2
    finally:
        ctx.close()
        gen.close()


def test_what_mla_refuses() -> None:
    formatter = MLAFormatter()
    with pytest.raises(IncompatibleStateError, match="has_indexer_k_cache: ours False, peer True"):
        formatter.inquire_support(mla_state(), mla_state(has_indexer_k_cache=True, indexer_dim=64))
    with_indexer = mla_state(has_indexer_k_cache=True, indexer_dim=128)
    with pytest.raises(IncompatibleStateError, match="indexer_dim: ours 128, peer 256"):
        formatter.inquire_support(with_indexer, mla_state(has_indexer_k_cache=True, indexer_dim=256))
    ctx_cp2 = mla_state(parallel=ParallelConfig(cp=2, attention_layers_per_pp_rank=(LAYERS,)))
    with pytest.raises(NotSupportedError, match="MLA needs ctx CP 1"):
        formatter.inquire_support(mla_state(), ctx_cp2)
    standard = dataclasses.replace(mla_state(), attention_type=AttentionType.DEFAULT, kv_factor=2)
    with pytest.raises(IncompatibleStateError, match="attention type: ours 'mla', peer 'default'"):
        formatter.inquire_support(mla_state(), standard)


INDEXER_DIM = 128  # 128 bytes of quantized key + one 4-byte scale per 128-element quant block per token


def indexer_side(kind: LayoutKind) -> tuple[PagedKVCache, CacheTransceiver]:
    cache = PagedKVCache(
        num_blocks=32, num_layers=LAYERS, num_heads=1, tokens_per_block=TOKENS_PER_BLOCK, head_dim=LATENT,
        dtype=DataType.BFLOAT16, kv_factor=1, kind=kind, indexer_bytes_per_token=INDEXER_DIM + 4,
    )  # fmt: skip
    return cache, CacheTransceiver(cache, mla_state(has_indexer_k_cache=True, indexer_dim=INDEXER_DIM))


@pytest.mark.parametrize(
    ("ctx_kind", "gen_kind"),
    [(LayoutKind.BLOCK_MAJOR, LayoutKind.BLOCK_MAJOR), (LayoutKind.BLOCK_MAJOR, LayoutKind.PER_LAYER_NHD)],
)
def test_indexer_k_cache_moves_with_the_latent_cache(ctx_kind: LayoutKind, gen_kind: LayoutKind) -> None:
    (ctx_cache, ctx), (gen_cache, gen) = indexer_side(ctx_kind), indexer_side(gen_kind)
    try:
        where = Slice(0, LAYERS, 0, 1, 1, LATENT, 0, 50)
        gen_cache.allocate(100, 40)  # the gen blocks differ from the ctx blocks
        ctx_cache.allocate(1, 50)
        ctx_cache.write_tokens(1, expected(1, where, 2))
        ctx_cache.write_indexer(1, indexer_expected(1, range(LAYERS), range(50), INDEXER_DIM + 4))
        request = TransferRequest(1, num_tokens=50)
        ctx.respond_and_send_async(request)
        gen_cache.allocate(7, 50)
        received = TransferRequest(7, context_phase_params=request.context_phase_params)
        gen.request_and_receive_sync(received)
        assert received.state is RequestState.GENERATION_TRANS_COMPLETE, received.error
        assert count_mismatches(gen_cache.read_tokens(7, 50), 1, where) == 0
        want = indexer_expected(1, range(LAYERS), range(50), INDEXER_DIM + 4)
        assert np.array_equal(gen_cache.read_indexer(7, 50), want)
        assert not np.array_equal(gen_cache.read_indexer(7, 50), indexer_expected(2, range(LAYERS), range(50), 132))
        blocks = 4
        kv, indexer = blocks * TOKENS_PER_BLOCK * LAYERS * LATENT * 2, blocks * TOKENS_PER_BLOCK * LAYERS * 132
        assert received.transfer_bytes == request.transfer_bytes == kv + indexer
    finally:
        ctx.close()
        gen.close()


def test_indexer_pools_must_match_the_state() -> None:
    with pytest.raises(IncompatibleStateError, match="the cache state has an indexer-K cache; the cache keeps no"):
        CacheTransceiver(mla_cache(), mla_state(has_indexer_k_cache=True, indexer_dim=INDEXER_DIM))
    state = mla_state(has_indexer_k_cache=True, indexer_dim=INDEXER_DIM)
    assert state.indexer_bytes_per_token == 132
    with pytest.raises(NotSupportedError, match="the indexer-K cache belongs to MLA"):
        StandardFormatter().inquire_support(
            dataclasses.replace(state, attention_type=AttentionType.DEFAULT, kv_factor=2),
            dataclasses.replace(state, attention_type=AttentionType.DEFAULT, kv_factor=2),
        )
