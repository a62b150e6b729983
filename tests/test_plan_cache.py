"""Plan templates give exactly the plan the formatter gives, for any block ids, layouts and pairings."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nixl_kv.dtypes import DataType
from nixl_kv.errors import IncompatibleStateError
from nixl_kv.formatters.standard import StandardFormatter
from nixl_kv.gen.plan_cache import PlanCache
from nixl_kv.interfaces import PeerRead, RangeRead, ReadRequest
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion
from nixl_kv.state import CacheState, CommState, DataTransceiverState, ModelConfig, ParallelConfig, RankCommInfo
from nixl_kv.topology import cp_block_range, share

POOL_BLOCKS = 96
HEADS, LAYERS, TOKENS_PER_BLOCK = 4, 4, 4


def parallel(tp: int = 1, pp: int = 1, cp: int = 1) -> ParallelConfig:
    return ParallelConfig(tp=tp, pp=pp, cp=cp, attention_layers_per_pp_rank=(LAYERS // pp,) * pp)


def instance(config: ParallelConfig, name: str, kind: LayoutKind) -> DataTransceiverState:
    state = CacheState(ModelConfig((HEADS,) * LAYERS, 8, TOKENS_PER_BLOCK), config, DataType.UINT8)
    ranks = []
    for rank in range(config.world_size):
        held = share(config, rank, HEADS, POOL_BLOCKS)
        pools = 1 if kind is LayoutKind.BLOCK_MAJOR else 2 * len(held.layers)
        regions = tuple(MemoryRegion((1 + i) << 24, 1 << 24, 0, MemoryKind.DRAM) for i in range(pools))
        layout = KVLayout(kind, POOL_BLOCKS, len(held.layers), 2, len(held.heads), TOKENS_PER_BLOCK, 8, 1, regions)
        ranks.append(RankCommInfo(f"{name}{rank}", b"md", layout))
    return DataTransceiverState(name, state, CommState(tuple(ranks)))


def request(gen: DataTransceiverState, ctx: DataTransceiverState, num_tokens: int, seed: int) -> ReadRequest:
    rng = np.random.default_rng(seed)
    blocks = -(-num_tokens // TOKENS_PER_BLOCK)
    cp = ctx.cache.parallel.cp
    per_cp = tuple(
        tuple(int(b) for b in rng.permutation(POOL_BLOCKS)[: len(cp_block_range(blocks, cp, c))]) for c in range(cp)
    )
    local = rng.permutation(POOL_BLOCKS)[:blocks].astype(np.int64)
    return ReadRequest(gen, 0, gen.comm.ranks[0].layout, ctx, per_cp, local, num_tokens, stage_bytes=1 << 20)


def same_plan(got: list[PeerRead], want: list[PeerRead]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        for spec in dataclasses.fields(PeerRead):
            x, y = getattr(a, spec.name), getattr(b, spec.name)
            if isinstance(y, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y), spec.name
            else:
                assert x == y, spec.name


KINDS = [LayoutKind.BLOCK_MAJOR, LayoutKind.PER_LAYER_NHD, LayoutKind.PER_LAYER_HND]


@pytest.mark.parametrize("ctx_kind", KINDS)
@pytest.mark.parametrize("gen_kind", KINDS)
@pytest.mark.parametrize(
    "ctx_config,gen_config",
    [
        (parallel(), parallel()),
        (parallel(tp=2), parallel()),
        (parallel(), parallel(tp=2)),
        (parallel(pp=2), parallel(tp=4)),
        (parallel(cp=2), parallel()),
    ],
    ids=["tp1-tp1", "tp2-tp1", "tp1-tp2", "pp2-tp4", "cp2-tp1"],
)
def test_templates_give_the_formatters_plan_for_any_block_ids(ctx_kind, gen_kind, ctx_config, gen_config) -> None:
    formatter = StandardFormatter()
    calls: list[ReadRequest] = []

    def planner(read: ReadRequest) -> list[PeerRead]:
        calls.append(read)
        return formatter.plan(read)

    cache = PlanCache(planner)
    gen, ctx = instance(gen_config, "gen", gen_kind), instance(ctx_config, "ctx", ctx_kind)
    for seed, num_tokens in enumerate([37, 40, 37, 37, 9, 44]):
        read = request(gen, ctx, num_tokens, seed)
        same_plan(cache.plan(read, -(-num_tokens // TOKENS_PER_BLOCK)), formatter.plan(read))
    assert len(calls) == 3  # 10, 3 and 11 blocks: one template each; every other request only maps its ids


def test_block_ids_outside_either_pool_are_refused_as_the_formatter_refuses_them() -> None:
    cache = PlanCache(StandardFormatter().plan)
    gen, ctx = instance(parallel(), "gen", LayoutKind.BLOCK_MAJOR), instance(parallel(), "ctx", LayoutKind.BLOCK_MAJOR)
    good = request(gen, ctx, 16, 0)
    cache.plan(good, 4)
    with pytest.raises(IncompatibleStateError, match="ctx block id outside the pool of 96 blocks"):
        cache.plan(dataclasses.replace(good, peer_block_ids=((1, 2, 3, POOL_BLOCKS),)), 4)
    with pytest.raises(IncompatibleStateError, match="gen block id outside the pool of 96 blocks"):
        cache.plan(dataclasses.replace(good, local_block_ids=np.array([0, 1, -1, 2])), 4)


def test_plans_that_read_per_request_state_are_planned_from_scratch_every_time() -> None:
    rows = np.array([[1 << 24, 8, 0]], dtype=np.uint64)
    calls = []

    def planner(read: ReadRequest) -> list[PeerRead]:
        calls.append(read.local_block_ids.tolist())
        return [PeerRead(0, 1, 0, state=RangeRead("state", rows, rows))]

    cache = PlanCache(planner)
    gen, ctx = instance(parallel(), "gen", LayoutKind.BLOCK_MAJOR), instance(parallel(), "ctx", LayoutKind.BLOCK_MAJOR)
    first, second = request(gen, ctx, 16, 1), request(gen, ctx, 16, 2)
    cache.plan(first, 4)
    cache.plan(second, 4)
    # the positional probe once, then each request with its own ids
    assert calls == [[0, 1, 2, 3], first.local_block_ids.tolist(), second.local_block_ids.tolist()]
