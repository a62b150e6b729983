"""Who holds what and who reads from whom, with exact expected rank lists."""

from __future__ import annotations

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
