"""Coalesced descriptors (issue 33): adjacent blocks on both sides are read as one descriptor, and the allocator
hands out adjacent blocks where a run of free blocks holds the request. Every element is checked."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from nixl_kv import runs
from nixl_kv.allocator import BlockAllocator
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion
from nixl_kv.requests import RequestState
from nixl_kv.runs import coalesced_rows, entry_runs
from tests.conftest import Pair, Shape, make_side

K = LayoutKind


def layout(kind: LayoutKind, num_blocks: int = 16, base: int = 1 << 30) -> KVLayout:
    pools = 1 if kind is K.BLOCK_MAJOR else 2 * 2
    # 2 layers, kv 2, 2 heads, 4 tokens, dim 8, 1 byte: 64-byte chunks, 32-byte units
    regions = tuple(MemoryRegion(base + i * (1 << 20), 1 << 20, 7 + i, MemoryKind.DRAM) for i in range(pools))
    return KVLayout(kind, num_blocks, 2, 2, 2, 4, 8, 1, regions)


def test_adjacent_blocks_on_both_sides_merge_and_any_break_splits_the_run() -> None:
    local, remote = layout(K.BLOCK_MAJOR), layout(K.BLOCK_MAJOR, base=1 << 34)
    seg = local.segment_bytes
    # local 3,4,5,6 | remote 8,9,10 then 12: the remote breaks the run after the third entry
    rows = coalesced_rows(local, np.array([3, 4, 5, 6]), remote, np.array([8, 9, 10, 12]), coarse=True)
    assert rows is not None
    want_local = [[(1 << 30) + 3 * seg, 3 * seg, 7], [(1 << 30) + 6 * seg, seg, 7]]
    want_remote = [[(1 << 34) + 8 * seg, 3 * seg, 7], [(1 << 34) + 12 * seg, seg, 7]]
    assert rows[0].tolist() == want_local and rows[1].tolist() == want_remote
    assert rows[0].dtype == rows[1].dtype == np.uint64
    # descending ids never merge; nothing saved: the prepared indices are kept
    assert coalesced_rows(local, np.array([5, 4]), remote, np.array([1, 0]), coarse=True) is None
    # saving one descriptor is not enough where more must be saved
    assert coalesced_rows(local, np.array([1, 2, 9]), remote, np.array([1, 2, 4]), True, min_saved=2) is None


def test_a_run_never_crosses_from_one_pool_into_the_next() -> None:
    """Per-layer pools: the last chunk of one (layer, kv) pool and the first of the next are consecutive entries of
    the prepared list, yet lie in different registrations; each row carries its pool's device."""
    nhd = layout(K.PER_LAYER_NHD)
    last = nhd.num_blocks - 1
    indices = np.array([last - 1, last, nhd.num_blocks, nhd.num_blocks + 1])  # pool 0's last two, pool 1's first two
    starts, counts = entry_runs(nhd, indices, nhd, indices, coarse=True)
    assert starts.tolist() == [0, 2] and counts.tolist() == [2, 2]
    rows = coalesced_rows(nhd, indices, nhd, indices, coarse=True)
    chunk = nhd.chunk_bytes
    assert rows is not None
    assert rows[0].tolist() == [[(1 << 30) + (last - 1) * chunk, 2 * chunk, 7], [(1 << 30) + (1 << 20), 2 * chunk, 8]]
    # head units of an HND pool: a block's heads, then the next block's, continue each other inside one pool
    hnd = layout(K.PER_LAYER_HND)
    units = hnd.unit_indices(np.array([2, 3]), range(0, 2), range(0, 2), block_first=False)
    starts, counts = entry_runs(hnd, units, hnd, units, coarse=False)
    assert counts.tolist() == [4, 4, 4, 4]  # one run per (layer, kv) pool: blocks 2 and 3, both heads


@pytest.mark.parametrize("kind", [K.BLOCK_MAJOR, K.PER_LAYER_NHD, K.PER_LAYER_HND])
def test_the_python_loop_for_few_entries_finds_the_runs_numpy_finds(kind: LayoutKind, monkeypatch) -> None:
    """Requests of a few blocks take a plain Python loop (``SMALL``); it must give the very rows of the numpy path."""
    local, remote = layout(kind), layout(kind, base=1 << 34)
    rng = np.random.default_rng(3)
    for coarse in (True, False):
        entries = len(local.pools) * local.pool_bytes // (local.segment_bytes if coarse else local.unit_bytes)
        for _ in range(40):  # runs of random lengths at random places, over pool boundaries too
            lengths = rng.integers(1, 5, size=rng.integers(1, 6))
            starts = rng.integers(0, entries, size=len(lengths))
            local_indices = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
            local_indices %= entries
            remote_indices = np.roll(local_indices, rng.integers(0, 2))
            args = (local, local_indices, remote, remote_indices, coarse, 0)
            small = runs.coalesced_rows(*args)
            monkeypatch.setattr(runs, "SMALL", -1)
            vectorised = runs.coalesced_rows(*args)
            monkeypatch.setattr(runs, "SMALL", 64)
            assert small is not None and vectorised is not None
            assert small[0].tolist() == vectorised[0].tolist() and small[1].tolist() == vectorised[1].tolist()


def test_allocator_gives_the_smallest_run_that_holds_the_request() -> None:
    allocator = BlockAllocator(32)
    a, b, c, d = (allocator.allocate(n) for n in (4, 6, 3, 8))
    assert a.tolist() == [0, 1, 2, 3] and d.tolist() == list(range(13, 21))
    allocator.free(a)  # free runs: 0-3 (4), 10-12 (3), 21-31 (11)
    allocator.free(c)
    assert allocator.allocate(3).tolist() == [10, 11, 12]  # the exact fit, not the lowest ids
    assert allocator.allocate(5).tolist() == [21, 22, 23, 24, 25]  # 0-3 is too short: the next smallest run
    # no run of 8 is left (0-3 and 26-31): the lowest free ids, as many runs as the free space forces
    assert allocator.allocate(8).tolist() == [0, 1, 2, 3, 26, 27, 28, 29]
    assert allocator.free_blocks == 2 and allocator.allocate(0).tolist() == []
    assert b.tolist() == list(range(4, 10))


SHAPE = Shape(layers=3, heads=2, head_dim=8, tokens_per_block=16, num_blocks=64)


@pytest.fixture(scope="module", params=[K.BLOCK_MAJOR, K.PER_LAYER_NHD], ids=["block_major", "nhd"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """One ctx/gen pair of each layout for the module; closed (and checked for leaks) at its end."""
    ctx, gen = (make_side(SHAPE, request.param, direct_min_run_bytes=0) for _ in range(2))
    pair = Pair(SHAPE, ctx, gen)
    pair.meet()
    yield pair
    for side in (ctx, gen):
        side.transceiver.close()
        assert side.transceiver._agent.live_handles == {"transfers": 0, "prepared": 0, "remotes": 0, "registrations": 0}


def _receive_all(pair: Pair, gen_ids: list[int], ctx_ids: list[int], lengths: list[int]) -> None:
    requests = [pair.gen_request(g, pair.prefill(c, n)) for g, c, n in zip(gen_ids, ctx_ids, lengths, strict=True)]
    for request in requests:
        pair.gen.transceiver.request_and_receive_async(request)
    done: set[int] = set()
    deadline = time.monotonic() + 20
    while len(done) < len(requests) and time.monotonic() < deadline:
        done |= pair.gen.transceiver.check_gen_transfer_status(at_least=1).completed_request_ids
    for request, c, n in zip(requests, ctx_ids, lengths, strict=True):
        assert request.state is RequestState.GENERATION_TRANS_COMPLETE, request.error
        assert pair.mismatches(request.request_id, c, n) == 0
    pair.ctx.transceiver.check_context_transfer_status(None)
    for g, c in zip(gen_ids, ctx_ids, strict=True):
        pair.gen.cache.free(g)
        pair.ctx.cache.free(c)


def test_adjacent_blocks_are_read_as_one_descriptor_byte_exact(pair: Pair) -> None:
    paths = pair.gen.transceiver.metrics.paths
    before = paths().get("coalesced", 0)
    # 20, 19 and 17 blocks, each one run on both sides (on DRAM rows pay from 8 descriptors saved: ``MIN_SAVED``)
    _receive_all(pair, [100, 101, 102], [0, 1, 2], [320, 300, 257])
    assert paths().get("coalesced", 0) - before == 3


def test_fragmented_blocks_split_where_either_side_breaks_byte_exact(pair: Pair) -> None:
    """The gen's free space is fragmented into runs of 2, so no gen run holds the requests: the allocator falls back
    to the lowest free ids, and each read's runs break where the gen's (or the ctx's) blocks do."""
    fillers = list(range(500, 500 + SHAPE.num_blocks // 2))  # the whole pool, in runs of 2
    for rid in fillers:
        pair.gen.cache.allocate(rid, 2 * SHAPE.tokens_per_block)
    for rid in fillers[::2]:
        pair.gen.cache.free(rid)  # runs of 2 free blocks between runs of 2 held ones
    paths = pair.gen.transceiver.metrics.paths
    before = paths()
    try:
        _receive_all(pair, [200, 201], [10, 11], [5 * 16 + 3, 6 * 16])
    finally:
        for rid in fillers[1::2]:
            pair.gen.cache.free(rid)
    assert pair.gen.cache.free_blocks == SHAPE.num_blocks
    # block-major: 6 entries in 3 runs save too few on DRAM; NHD: 36 entries (6 pools x 6 blocks) in 18 runs
    path = "prepared" if pair.gen.cache.kind is K.BLOCK_MAJOR else "coalesced"
    assert paths()[path] - before.get(path, 0) == 2
