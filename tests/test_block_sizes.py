"""ctx and gen blocks of different sizes, one a whole multiple of the other: every element checked.

Token t of a request lives in ctx block t // T_ctx and gen block t // T_gen. Direct reads take each unit of the
smaller blocks (a head's tokens; a whole chunk for NHD) into its token run of the larger one, as explicit rows;
staged pieces are whole ctx blocks, packed by the ctx side, of which the gen side unpacks the runs it takes. The
ctx fill comes from global coordinates (DESIGN §7), so every gen element is checked whatever the two sizes.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from nixl_kv.cache import PagedKVCache
from nixl_kv.errors import IncompatibleStateError
from nixl_kv.formatters.mla import MLAFormatter
from nixl_kv.formatters.standard import StandardFormatter
from nixl_kv.gen.plan_cache import PlanCache
from nixl_kv.harness.fill import expected
from nixl_kv.interfaces import Box, PeerRead, ReadRequest
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion
from nixl_kv.progress import ContextProgress
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.state import AttentionType, CacheState, CommState, DataTransceiverState, ParallelConfig, RankCommInfo
from nixl_kv.views import gather, pool_views
from tests.conftest import Pair, Shape
from tests.test_plan_cache import same_plan

K = LayoutKind
SHAPE = Shape(layers=3, heads=4, head_dim=8, num_blocks=48)  # float16
TOKEN_BYTES = SHAPE.layers * 2 * SHAPE.heads * SHAPE.head_dim * SHAPE.dtype.itemsize
LENGTHS = (1, 31, 33, 100, 257)  # none a multiple of either block size
RATIOS = [(64, 32), (32, 64)]
RATIO_IDS = ["ctx64-gen32", "ctx32-gen64"]
DIRECT = {"direct_min_run_bytes": 0}
STAGED = {"direct_min_run_bytes": 1 << 40, "max_tokens_in_buffer": 128}  # several pieces per request
PAIRINGS = [
    (K.PER_LAYER_HKND, K.PER_LAYER_HKND),
    (K.PER_LAYER_HND, K.PER_LAYER_NHD),
    (K.BLOCK_MAJOR, K.PER_LAYER_HKND),
    (K.PER_LAYER_NHD, K.PER_LAYER_NHD),
    (K.BLOCK_MAJOR, K.BLOCK_MAJOR),
    (K.PER_LAYER_HKND, K.BLOCK_MAJOR),
    (K.PER_LAYER_NHD, K.PER_LAYER_HND),
    (K.BLOCK_MAJOR, K.PER_LAYER_NHD),
]


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[list[PeerRead]]:
    """Every plan the formatter makes (the plan cache's templates included): which path each read takes."""
    made: list[list[PeerRead]] = []
    plan = StandardFormatter.plan

    def recorded(self: StandardFormatter, request: ReadRequest) -> list[PeerRead]:
        made.append(plan(self, request))
        return made[-1]

    monkeypatch.setattr(StandardFormatter, "plan", recorded)
    return made


def _paths(plans: list[list[PeerRead]]) -> set[str]:
    """The paths of every read of the KV: explicit rows, descriptor indices, staged or gathered pieces."""
    named = {(True, False): "staged", (True, True): "gathered"}
    return {
        named.get((read.staged, read.gathered), "indices" if read.local_indices is not None else "rows")
        for plan in plans
        for read in plan
        if read.expected_readers
    }


def _expected_path(ctx_kind: LayoutKind, gen_kind: LayoutKind, config: dict) -> str:
    """Direct where both sides keep a head's tokens together (or both NHD) in the same order, else staged: gathered
    from block-major. HKND (K dim-major) is never read as it is across block sizes: its runs are not token runs."""
    hknd = K.PER_LAYER_HKND in (ctx_kind, gen_kind)
    if config is DIRECT and not hknd and (ctx_kind is K.PER_LAYER_NHD) == (gen_kind is K.PER_LAYER_NHD):
        return "rows"
    return "gathered" if ctx_kind is K.BLOCK_MAJOR else "staged"


def _pair(
    pair_factory,
    ctx_tokens: int,
    gen_tokens: int,
    ctx_kind: LayoutKind = K.BLOCK_MAJOR,
    gen_kind: LayoutKind = K.BLOCK_MAJOR,
    config: dict | None = None,
    shape: Shape = SHAPE,
) -> Pair:
    ctx_shape = dataclasses.replace(shape, tokens_per_block=ctx_tokens)
    gen_shape = dataclasses.replace(shape, tokens_per_block=gen_tokens)
    return pair_factory(ctx_shape, ctx_kind, gen_kind, config, config, gen_shape=gen_shape)


def _receive(pair: Pair, gen_id: int, ctx_request: TransferRequest, reused_blocks: int = 0) -> TransferRequest:
    request = pair.gen_request(gen_id, ctx_request)
    request.reused_blocks = reused_blocks
    pair.gen.transceiver.request_and_receive_sync(request)
    return request


def _moved_bytes(num_tokens: int, run: int, first_token: int = 0) -> int:
    """What a request moves: its tokens from ``first_token`` on, in whole runs of the smaller block size."""
    return (-(-num_tokens // run) * run - first_token) * TOKEN_BYTES


def _free_blocks_untouched(pair: Pair, gen_ids: list[int]) -> bool:
    """No byte landed in a gen block that no request holds (the pools start zeroed)."""
    cache = pair.gen.cache
    held = {int(block) for gen_id in gen_ids for block in cache.block_ids(gen_id)}
    free = np.array(sorted(set(range(cache.num_blocks)) - held))
    return not gather(cache.layout, cache.pools, free, range(cache.num_layers), range(cache.num_heads)).any()


@pytest.mark.parametrize(("ctx_tokens", "gen_tokens"), RATIOS, ids=RATIO_IDS)
@pytest.mark.parametrize(("ctx_kind", "gen_kind"), PAIRINGS, ids=[f"{c.name}-{g.name}".lower() for c, g in PAIRINGS])
@pytest.mark.parametrize("config", [DIRECT, STAGED], ids=["direct", "staged"])
def test_every_element_arrives_between_block_sizes(
    pair_factory, plans, ctx_tokens: int, gen_tokens: int, ctx_kind: LayoutKind, gen_kind: LayoutKind, config: dict
) -> None:
    pair = _pair(pair_factory, ctx_tokens, gen_tokens, ctx_kind, gen_kind, config)
    ctx_requests = [pair.prefill(rid, n) for rid, n in enumerate(LENGTHS)]
    for rid, (n, ctx_request) in enumerate(zip(LENGTHS, ctx_requests, strict=True)):
        received = _receive(pair, 100 + rid, ctx_request)
        assert received.state is RequestState.GENERATION_TRANS_COMPLETE, received.error
        assert pair.mismatches(100 + rid, rid, n) == 0
        assert received.transfer_bytes == _moved_bytes(n, min(ctx_tokens, gen_tokens))
    assert _paths(plans) == {_expected_path(ctx_kind, gen_kind, config)}
    assert _free_blocks_untouched(pair, [100 + rid for rid in range(len(LENGTHS))])
    statuses = pair.ctx.transceiver.check_context_transfer_status(None, mark_complete=True)
    assert statuses.completed_request_ids == set(range(len(LENGTHS)))
    assert pair.ctx.transceiver._staging.free_slots == pair.ctx.transceiver.config.num_staging_slots


@pytest.mark.parametrize(
    ("ctx_tokens", "gen_tokens", "reused"),
    [(64, 32, 1), (64, 32, 3), (32, 64, 1), (32, 64, 2)],
    ids=["ctx64-gen32-mid-ctx-block", "ctx64-gen32-3", "ctx32-gen64-1", "ctx32-gen64-2"],
)
@pytest.mark.parametrize("config", [DIRECT, STAGED], ids=["direct", "staged"])
def test_prefix_reuse_moves_only_the_tokens_the_gen_side_lacks(
    pair_factory, ctx_tokens: int, gen_tokens: int, reused: int, config: dict
) -> None:
    """The reused gen blocks hold other content on purpose: a ctx block that straddles the reuse boundary must
    not write its reused half."""
    pair = _pair(pair_factory, ctx_tokens, gen_tokens, K.PER_LAYER_HKND, K.PER_LAYER_HND, config)
    kept = reused * gen_tokens
    for rid, n in enumerate((100, 257)):
        ctx_request = pair.prefill(rid, n)
        pair.gen.cache.allocate(100 + rid, n)
        held = expected(999, SHAPE.where(n), SHAPE.dtype.itemsize)
        pair.gen.cache.write_tokens(100 + rid, held)
        request = TransferRequest(100 + rid, context_phase_params=ctx_request.context_phase_params)
        request.reused_blocks = reused
        pair.gen.transceiver.request_and_receive_sync(request)
        assert request.state is RequestState.GENERATION_TRANS_COMPLETE, request.error
        assert request.transfer_bytes == _moved_bytes(n, min(ctx_tokens, gen_tokens), kept)
        got, want = pair.gen.cache.read_tokens(100 + rid, n), expected(rid, SHAPE.where(n), SHAPE.dtype.itemsize)
        assert np.array_equal(got[..., :kept, :], held[..., :kept, :])  # the reused prefix was not touched
        assert np.array_equal(got[..., kept:, :], want[..., kept:, :])  # the rest arrived


@pytest.mark.parametrize(("ctx_tokens", "gen_tokens"), [(64, 32), (16, 32)], ids=["ctx64-gen32", "ctx16-gen32"])
def test_sliding_window_moves_only_the_gen_blocks_it_attends(pair_factory, ctx_tokens: int, gen_tokens: int) -> None:
    shape = dataclasses.replace(SHAPE, attention_window=32)
    pair = _pair(pair_factory, ctx_tokens, gen_tokens, K.BLOCK_MAJOR, K.PER_LAYER_HKND, DIRECT, shape)
    request = _receive(pair, 5, pair.prefill(1, 160))  # 5 gen blocks; the last 32 // 32 + 1 = 2 of them move
    assert request.state is RequestState.GENERATION_TRANS_COMPLETE, request.error
    assert request.transfer_bytes == 64 * TOKEN_BYTES
    got, want = pair.gen.cache.read_tokens(5, 160), expected(1, SHAPE.where(160), SHAPE.dtype.itemsize)
    assert not got[..., :96, :].any()  # outside the window: never moved
    assert np.array_equal(got[..., 96:, :], want[..., 96:, :])


@pytest.mark.parametrize(("ctx_tokens", "gen_tokens"), RATIOS, ids=RATIO_IDS)
def test_layer_wise_requests_are_staged_layer_range_by_layer_range(
    pair_factory, plans, ctx_tokens: int, gen_tokens: int
) -> None:
    """Rows would read every layer at once, before the ctx computed them: layer-wise requests stage instead."""
    pair = _pair(pair_factory, ctx_tokens, gen_tokens, K.PER_LAYER_HKND, K.PER_LAYER_HKND, DIRECT)
    lengths = (33, 257)
    ctx_requests = []
    for rid, n in enumerate(lengths):
        pair.ctx.cache.allocate(rid, n)
        pair.ctx.cache.write_tokens(rid, expected(rid, SHAPE.where(n), SHAPE.dtype.itemsize))
        ctx_requests.append(TransferRequest(rid, num_tokens=n))
    progress = ContextProgress(SHAPE.layers)
    pair.ctx.transceiver.respond_and_send_layer_wise(ctx_requests, progress)
    gen_requests = [pair.gen_request(100 + rid, request) for rid, request in enumerate(ctx_requests)]
    for request in gen_requests:
        pair.gen.transceiver.request_and_receive_async(request)
    progress.mark_layer_done(0)
    wanted = [expected(rid, SHAPE.where(n), SHAPE.dtype.itemsize) for rid, n in enumerate(lengths)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(
        np.array_equal(pair.gen.cache.read_tokens(100 + rid, n)[0], wanted[rid][0]) for rid, n in enumerate(lengths)
    ):
        time.sleep(0.005)
    got = [pair.gen.cache.read_tokens(100 + rid, n) for rid, n in enumerate(lengths)]
    assert all(np.array_equal(tokens[0], want[0]) for tokens, want in zip(got, wanted, strict=True))  # layer 0 is in
    assert not any(tokens[1:].any() for tokens in got)  # the layers not computed yet were not read
    for layer in range(1, SHAPE.layers):
        progress.mark_layer_done(layer)
    pair.gen.transceiver.check_gen_transfer_status(None)
    for rid, (n, request) in enumerate(zip(lengths, gen_requests, strict=True)):
        assert request.state is RequestState.GENERATION_TRANS_COMPLETE, request.error
        assert pair.mismatches(100 + rid, rid, n) == 0
    assert _paths(plans) == {"staged"}


def test_block_sizes_neither_of_which_divides_the_other_are_refused(pair_factory) -> None:
    pair = _pair(pair_factory, 48, 32)
    request = _receive(pair, 5, pair.prefill(1, 100))
    assert request.state is RequestState.TRANS_ERROR
    assert request.error == (
        "IncompatibleStateError: ctx and gen caches differ: tokens_per_block: ours 32, peer 48 "
        "(neither is a whole multiple of the other)"
    )
    assert not pair.gen.cache.read_tokens(5, 100).any()  # nothing was written


def _state(tokens: int, attention: AttentionType = AttentionType.DEFAULT, cp: int = 1) -> CacheState:
    mla = attention is AttentionType.MLA
    state = dataclasses.replace(SHAPE, tokens_per_block=tokens, heads=1 if mla else SHAPE.heads).state()
    parallel = ParallelConfig(cp=cp, attention_layers_per_pp_rank=(SHAPE.layers,))
    return dataclasses.replace(state, attention_type=attention, kv_factor=1 if mla else 2, parallel=parallel)


@pytest.mark.parametrize(
    ("formatter", "gen", "ctx", "why"),
    [
        (MLAFormatter(), _state(32, AttentionType.MLA), _state(64, AttentionType.MLA), "ours 32, peer 64 (the mla"),
        (StandardFormatter(), _state(64, cp=2), _state(32), "ours 64, peer 32 (different block sizes need cp=1"),
    ],
    ids=["mla", "cp"],
)
def test_mla_and_cp_keep_refusing_other_block_sizes(formatter, gen: CacheState, ctx: CacheState, why: str) -> None:
    with pytest.raises(IncompatibleStateError) as refused:
        formatter.inquire_support(gen, ctx)
    assert (
        str(refused.value)
        == {
            "mla": "ctx and gen caches differ: tokens_per_block: ours 32, peer 64 (the mla formatter needs equal block "
            "sizes)",
            "cp": "ctx and gen caches differ: tokens_per_block: ours 64, peer 32 (different block sizes need cp=1 on "
            "both sides; gen cp=2, ctx cp=1)",
        }["mla" if isinstance(formatter, MLAFormatter) else "cp"]
    )
    assert why in str(refused.value)


def _instance(name: str, tokens: int, kind: LayoutKind) -> DataTransceiverState:
    """A one-rank instance whose pools are only addresses (planning reads no byte)."""
    state = dataclasses.replace(SHAPE, tokens_per_block=tokens).state()
    pools = {K.BLOCK_MAJOR: 1, K.PER_LAYER_HKND: SHAPE.layers}.get(kind, 2 * SHAPE.layers)
    regions = tuple(MemoryRegion((1 + i) << 24, 1 << 24, 0, MemoryKind.DRAM) for i in range(pools))
    layout = KVLayout(kind, 16, SHAPE.layers, 2, SHAPE.heads, tokens, SHAPE.head_dim, 2, regions)
    return DataTransceiverState(name, state, CommState((RankCommInfo(f"{name}0", b"md", layout),)))


def test_plan_templates_tell_apart_requests_with_as_many_ctx_blocks() -> None:
    """20 and 40 tokens are one ctx block of 64 but one and two gen blocks of 32: a template made for one would
    give the other the wrong tokens, whatever the gen side allocated (here 4 blocks for each)."""
    gen, ctx = _instance("gen", 32, K.PER_LAYER_HND), _instance("ctx", 64, K.PER_LAYER_NHD)  # staged
    formatter = StandardFormatter()
    cache = PlanCache(formatter.plan)
    wanted = []
    for num_tokens in (20, 40, 20):
        layout, ids = gen.comm.ranks[0].layout, np.arange(4)
        request = ReadRequest(gen, 0, layout, ctx, ((5,),), ids, num_tokens, stage_bytes=1 << 20)
        wanted.append(formatter.plan(request))
        same_plan(cache.plan(request, 1), wanted[-1])  # the receiver passes the request's ctx blocks
    assert [read.pieces for read in wanted[0]] != [read.pieces for read in wanted[1]]


@pytest.mark.parametrize(("ctx_tokens", "gen_tokens"), RATIOS, ids=RATIO_IDS)
@pytest.mark.parametrize("gen_kind", [K.BLOCK_MAJOR, K.PER_LAYER_NHD, K.PER_LAYER_HND])
@pytest.mark.parametrize("segments", [False, True], ids=["packed", "segments"])
@pytest.mark.parametrize("memory", [MemoryKind.DRAM, MemoryKind.VRAM])
def test_unpacking_into_token_runs_writes_exactly_the_taken_tokens(
    ctx_tokens: int, gen_tokens: int, gen_kind: LayoutKind, segments: bool, memory: MemoryKind
) -> None:
    """A piece of whole ctx blocks whose first tokens the gen side holds already (96: inside a ctx block of 64;
    a gen block of 64 from its middle), unpacked by numpy or by the CUDA kernel (entry starts, skipped runs, whole
    peer segments), checked element by element."""
    xp = np if memory is MemoryKind.DRAM else pytest.importorskip("cupy")
    if memory is MemoryKind.VRAM and not xp.cuda.is_available():
        pytest.skip("no CUDA device")
    num_tokens, run = 257, min(ctx_tokens, gen_tokens)
    taken = range(96, -(-num_tokens // run) * run)
    ctx_shape, gen_shape = (dataclasses.replace(SHAPE, tokens_per_block=tokens) for tokens in (ctx_tokens, gen_tokens))
    ctx = ctx_shape.cache(K.BLOCK_MAJOR)
    ctx_ids = ctx.allocate(1, num_tokens)
    values = expected(1, SHAPE.where(num_tokens), SHAPE.dtype.itemsize)
    ctx.write_tokens(1, values)
    gen = PagedKVCache(
        num_blocks=SHAPE.num_blocks, num_layers=SHAPE.layers, num_heads=SHAPE.heads, tokens_per_block=gen_tokens,
        head_dim=SHAPE.head_dim, dtype=SHAPE.dtype, kind=gen_kind, memory=memory,
    )  # fmt: skip
    gen_ids = gen.allocate(1, num_tokens)
    formatter = StandardFormatter()
    blocks = range(taken.start // ctx_tokens, -(-taken.stop // ctx_tokens))
    box = Box(range(SHAPE.layers), range(SHAPE.heads), blocks, ctx_tokens, taken)  # as the gen side plans it
    theirs = formatter.localize(ctx_shape.state(), 0, box, len(ctx_ids), ctx_ids)
    data = np.zeros(formatter.box_bytes(ctx_shape.state(), box), dtype=np.uint8)
    if segments:
        data[:] = ctx.pools[0][theirs.block_ids].reshape(-1).view(np.uint8)  # what a gathered READ lands
    else:
        formatter.pack(ctx.layout, pool_views(ctx.layout), theirs, data)
    mine = formatter.localize(gen_shape.state(), 0, box, len(ctx_ids), gen_ids)  # the receiver passes ctx blocks
    formatter.unpack(gen.layout, pool_views(gen.layout), mine, xp.asarray(data), segments)
    got = gen.read_tokens(1, num_tokens)
    got = got if memory is MemoryKind.DRAM else xp.asnumpy(got)
    assert not got[..., : taken.start, :].any()  # held already: not written
    assert np.array_equal(got[..., taken.start :, :], values[..., taken.start :, :])


def _run_pair(ctx: str, gen: str, extra: tuple[str, ...] = ()) -> dict:
    command = [
        sys.executable, "-m", "nixl_kv.cli", "pair", f"--ctx={ctx}", f"--gen={gen}", "--layers", "4", "--kv-heads",
        "4", "--head-dim", "8", "--tokens-per-block", "32", "--dtype", "float32", "--requests",
        ",".join(map(str, LENGTHS)), "--rounds", "2", "--no-raw-read", "--json", *extra,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{ctx} -> {gen}: {result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["requests"] == summary["verified"] == 2 * len(LENGTHS), summary
    assert summary["mismatched_elements"] == 0 and summary["ctx_errors"] == {}, summary
    return summary


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("ctx", "gen", "extra", "moved_tokens"),
    [
        # rows; the gen holds 3 blocks (96 tokens): of 1, 31, 33 tokens nothing moves, of 100 and 257 32 and 192
        ("tp=2,tokens_per_block=64", "tp=1,layout=hknd", ("--reuse-prefix", "3"), 32 + 192),
        ("tp=2,tokens_per_block=32,layout=hnd", "tp=1,tokens_per_block=64,layout=nhd", (), 32 + 32 + 64 + 128 + 288),
    ],
    ids=["ctx64-tp2-gen32-tp1-reuse", "ctx32-tp2-gen64-tp1-staged"],
)
def test_tp2_ctx_to_tp1_gen_between_block_sizes(ctx: str, gen: str, extra: tuple[str, ...], moved_tokens: int) -> None:
    summary = _run_pair(ctx, gen, extra)
    assert summary["bytes"] == 2 * moved_tokens * 4 * 2 * 4 * 8 * 4  # rounds, tokens, layers, k/v, heads, dim, bytes
