"""Who holds what and who reads from whom, with exact expected rank lists."""

from __future__ import annotations

import dataclasses

import pytest

from nixl_kv.errors import NotSupportedError
from nixl_kv.state import ParallelConfig
from nixl_kv.topology import (
    Position,
    cp_block_range,
    head_range,
    layer_range,
    peer_slices,
    position,
    rank_of,
    reader_ranks,
    share,
)


def parallel(tp: int = 1, pp: int = 1, cp: int = 1, layers: int = 8, dp: bool = False, split=None) -> ParallelConfig:
    base, extra = divmod(layers, pp)
    counts = tuple(split or (base + (1 if i < extra else 0) for i in range(pp)))
    return ParallelConfig(
        tp=tp, pp=pp, cp=cp, enable_attention_dp=dp, dp_size=tp if dp else 1, attention_layers_per_pp_rank=counts
    )


def test_rank_order_is_tp_fastest_then_cp_then_pp() -> None:
    config = parallel(tp=2, cp=3, pp=2)
    assert position(config, 0) == Position(0, 0, 0)
    assert position(config, 1) == Position(1, 0, 0)
    assert position(config, 2) == Position(0, 1, 0)
    assert position(config, 6) == Position(0, 0, 1)
    assert position(config, 11) == Position(1, 2, 1)
    assert all(rank_of(config, position(config, r)) == r for r in range(12))


def test_uneven_pp_split_and_cp_remainder_to_the_lowest_ranks() -> None:
    config = parallel(pp=4, layers=10, split=(3, 3, 2, 2))
    assert [layer_range(config, p) for p in range(4)] == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert [cp_block_range(10, 3, r) for r in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]
    assert [cp_block_range(1, 2, r) for r in range(2)] == [range(0, 1), range(1, 1)]


def test_heads_split_duplicate_and_attention_dp() -> None:
    assert [head_range(parallel(tp=4), 8, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [head_range(parallel(tp=4), 2, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert head_range(parallel(tp=4, dp=True), 8, 3) == range(0, 8)
    with pytest.raises(NotSupportedError, match="3 kv heads do not split evenly over TP 2"):
        head_range(parallel(tp=2), 3, 0)
    with pytest.raises(NotSupportedError, match="TP 6 is not a multiple of 4 kv heads"):
        head_range(parallel(tp=6), 4, 0)


def test_ctx_tp2_to_gen_tp4_pp2_readers_and_slices() -> None:
    ctx, gen = parallel(tp=2), parallel(tp=4, pp=2)
    assert reader_ranks(ctx, 0, gen, 8, 4, 0, 0) == (0, 4, 1, 5)
    assert reader_ranks(ctx, 1, gen, 8, 4, 0, 0) == (2, 6, 3, 7)
    (only,) = peer_slices(gen, 5, ctx, 8, 4, 0)
    assert (only.peer_rank, only.layers, only.heads, only.blocks) == (0, range(4, 8), range(2, 4), range(0, 4))


def test_ctx_tp4_to_gen_pp4_reads_every_head_from_its_own_rank() -> None:
    slices = peer_slices(parallel(pp=4), 1, parallel(tp=4), 4, 3, 0)
    assert [(s.peer_rank, s.layers, s.heads) for s in slices] == [(r, range(2, 4), range(r, r + 1)) for r in range(4)]


def test_duplicated_ctx_heads_are_read_from_one_duplicate_spread_over_readers() -> None:
    ctx, gen = parallel(tp=8), parallel(tp=4)  # 2 kv heads: ctx holds each 4 times, gen each twice
    assert [[s.peer_rank for s in peer_slices(gen, g, ctx, 2, 3, 0)] for g in range(4)] == [[0], [1], [6], [7]]
    assert [len(reader_ranks(ctx, c, gen, 2, 3, 0, 0)) for c in range(8)] == [1, 1, 0, 0, 0, 0, 1, 1]


def test_attention_dp_request_lives_on_its_dp_rank() -> None:
    ctx, gen = parallel(tp=2, dp=True), parallel(tp=2)
    for g in range(2):
        (only,) = peer_slices(gen, g, ctx, 4, 3, holder_dp_rank=1)
        assert only.peer_rank == 1 and only.heads == range(2 * g, 2 * g + 2)
    assert reader_ranks(ctx, 1, gen, 4, 3, 1, 0) == (0, 1)
    assert reader_ranks(ctx, 0, gen, 4, 3, 1, 0) == ()
    # gen under attention DP: only the gen ranks of the request's DP rank read
    gen_dp = parallel(tp=2, pp=2, dp=True)
    assert reader_ranks(parallel(tp=2), 0, gen_dp, 4, 3, 0, 1) == (1, 3)


def test_cp_on_both_sides_maps_block_ranges() -> None:
    ctx, gen = parallel(cp=2), parallel(cp=3)
    got = [[(s.peer_rank, s.blocks) for s in peer_slices(gen, g, ctx, 4, 10, 0)] for g in range(3)]
    assert got == [[(0, range(0, 4))], [(0, range(4, 5)), (1, range(5, 7))], [(1, range(7, 10))]]
    assert share(ctx, 1, 4, 1).blocks == range(1, 1)  # a one-block request leaves ctx CP rank 1 empty
    assert reader_ranks(ctx, 1, gen, 4, 1, 0, 0) == ()


def _plan(gen: ParallelConfig, gen_rank: int, ctx: ParallelConfig, num_tokens: int, first_block: int, dp: int = 0):
    """The standard formatter's plan for one gen rank, on made-up layouts (no agents needed)."""
    import numpy as np

    from nixl_kv.dtypes import DataType
    from nixl_kv.formatters.standard import StandardFormatter
    from nixl_kv.interfaces import ReadRequest
    from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion
    from nixl_kv.state import CacheState, CommState, DataTransceiverState, ModelConfig, RankCommInfo

    def instance(parallel: ParallelConfig, name: str) -> DataTransceiverState:
        state = CacheState(ModelConfig((4,) * 8, 4, 4), parallel, DataType.UINT8)
        ranks = []
        for rank in range(parallel.world_size):
            held = share(parallel, rank, 4, 64)
            layout = KVLayout(LayoutKind.BLOCK_MAJOR, 64, len(held.layers), 2, len(held.heads), 4, 4, 1,
                              (MemoryRegion(1 << 20, 1 << 20, 0, MemoryKind.DRAM),))  # fmt: skip
            ranks.append(RankCommInfo(f"{name}{rank}", b"md", layout))
        return DataTransceiverState(name, state, CommState(tuple(ranks)))

    gen_state, ctx_state = instance(gen, "gen"), instance(ctx, "ctx")
    blocks = -(-num_tokens // 4)
    per_cp = tuple(tuple(range(len(cp_block_range(blocks, ctx.cp, c)))) for c in range(ctx.cp))
    layout = gen_state.comm.ranks[gen_rank].layout
    request = ReadRequest(gen_state, gen_rank, layout, ctx_state, per_cp, np.arange(64), num_tokens)
    request = dataclasses.replace(request, peer_dp_rank=dp, first_block=first_block, stage_bytes=1 << 20)
    return StandardFormatter().plan(request)


def test_ctx_ranks_left_without_readers_by_prefix_reuse_are_told_so_and_read_ones_are_not() -> None:
    # 4 blocks over ctx CP 2: rank 0 holds blocks 0-1, rank 1 blocks 2-3; the gen side reuses the first 2
    plan = _plan(parallel(), 0, parallel(cp=2), num_tokens=16, first_block=2)
    assert [(p.peer_rank, p.expected_readers) for p in plan] == [(1, 1), (0, 0)]
    # gen under attention DP, request on DP rank 1 (gen rank 1 is its first rank), ctx CP 2: both ctx ranks read
    plan = _plan(parallel(tp=2, dp=True), 1, parallel(cp=2), num_tokens=16, first_block=0)
    assert sorted((p.peer_rank, p.expected_readers) for p in plan) == [(0, 1), (1, 1)]
