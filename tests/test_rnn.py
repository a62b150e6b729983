"""Mamba state: resharding between TP/PP layouts for every conv section layout, and hybrid requests over NIXL."""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest

from nixl_kv import wire
from nixl_kv.cache import PagedKVCache
from nixl_kv.dtypes import DataType
from nixl_kv.errors import IncompatibleStateError, NotSupportedError
from nixl_kv.formatters.rnn import RnnFormatter, state_rows
from nixl_kv.formatters.standard import StandardFormatter
from nixl_kv.harness.fill import Slice, count_mismatches, expected, rnn_expected
from nixl_kv.layout import LayoutKind
from nixl_kv.params_seal import encode_params
from nixl_kv.progress import ContextProgress
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.rnn import conv_sections, rnn_pieces, rnn_readers, rnn_share
from nixl_kv.rnn_cache import RnnStatePools
from nixl_kv.state import CacheState, ContextPhaseParams, ConvSectionLayout, ModelConfig, ParallelConfig, RnnConfig
from nixl_kv.topology import holds_request
from nixl_kv.transceiver import CacheTransceiver


def rnn_config(layout: ConvSectionLayout, pp: int = 1, layers: int = 3, **changes: object) -> RnnConfig:
    base, extra = divmod(layers, pp)
    config = RnnConfig(
        num_heads=4, head_dim=8, d_state=4, d_conv=4, n_groups=2, hidden_size=32, conv_section_layout=layout,
        conv_dtype=DataType.FLOAT32, ssm_dtype=DataType.BFLOAT16,
        layers_per_pp_rank=tuple(base + (i < extra) for i in range(pp)),
    )  # fmt: skip
    return dataclasses.replace(config, **changes)


def pools_for(config: RnnConfig, parallel: ParallelConfig, rank: int, per_layer: bool) -> RnnStatePools:
    mine = rnn_share(config, parallel, rank)
    return RnnStatePools(
        len(mine.layers), 3, mine.num_channels, config.d_conv, config.conv_dtype, len(mine.heads), config.head_dim,
        config.d_state, config.ssm_dtype, per_layer=per_layer,
    )  # fmt: skip


def reshard(
    ctx: ParallelConfig, gen: ParallelConfig, layout: ConvSectionLayout, per_layer: bool, **changes: object
) -> int:
    """Fill every ctx rank's slot 2, copy what ``state_rows`` says into slot 0 of every gen rank holding the
    request (byte by byte, as the READ would), check every gen element and that each byte is read exactly once;
    returns the rows posted. ``per_layer``: ctx pools layer-major, gen pools one per layer (and the reverse)."""
    seed, posted = 11, 0
    ctx_config, gen_config = rnn_config(layout, ctx.pp, **changes), rnn_config(layout, gen.pp, **changes)
    ctx_pools = [pools_for(ctx_config, ctx, rank, per_layer=not per_layer) for rank in range(ctx.world_size)]
    for rank, pools in enumerate(ctx_pools):
        pools.write(2, *rnn_expected(seed, rnn_share(ctx_config, ctx, rank), ctx_config))
    for rank in range(gen.world_size):
        if not holds_request(gen, rank, 0):
            continue
        mine = rnn_share(gen_config, gen, rank)
        pools = pools_for(gen_config, gen, rank, per_layer)
        moved = 0
        for peer, piece in rnn_pieces(gen_config, gen, rank, ctx_config, ctx, 0):
            theirs = rnn_share(ctx_config, ctx, peer)
            local, remote = state_rows(piece, (pools.layout, mine, 0), (ctx_pools[peer].layout, theirs, 2))
            for (to, length, _), (source, _, _) in zip(local.tolist(), remote.tolist(), strict=True):
                ctypes.memmove(to, source, length)
            posted, moved = posted + len(local), moved + int(local[:, 1].sum())
        conv, ssm = pools.read(0)
        want_conv, want_ssm = rnn_expected(seed, mine, gen_config)
        assert np.array_equal(conv, want_conv), f"gen rank {rank}: conv state differs"
        assert np.array_equal(ssm, want_ssm), f"gen rank {rank}: SSM state differs"
        assert moved == pools.layout.num_layers * (pools.layout.conv_slot_bytes + pools.layout.ssm_slot_bytes)
    return posted


PARALLEL = {
    "tp1": ParallelConfig(attention_layers_per_pp_rank=(2,)),
    "tp2": ParallelConfig(tp=2, attention_layers_per_pp_rank=(2,)),
    "tp4": ParallelConfig(tp=4, attention_layers_per_pp_rank=(2,)),
    "tp2dp": ParallelConfig(tp=2, enable_attention_dp=True, dp_size=2, attention_layers_per_pp_rank=(2,)),
    "pp2": ParallelConfig(pp=2, attention_layers_per_pp_rank=(1, 1)),
    "tp2pp2": ParallelConfig(tp=2, pp=2, attention_layers_per_pp_rank=(1, 1)),
}


@pytest.mark.parametrize("layout", list(ConvSectionLayout))
@pytest.mark.parametrize(
    ("ctx", "gen"),
    [("tp1", "tp2"), ("tp2", "tp1"), ("pp2", "tp1"), ("tp1", "pp2"), ("tp2pp2", "tp2"), ("tp2", "tp2pp2"),
     ("tp2dp", "tp2"), ("tp2", "tp2dp")],
)  # fmt: skip
def test_state_reshards_exactly(ctx: str, gen: str, layout: ConvSectionLayout) -> None:
    for per_layer in (False, True):
        reshard(PARALLEL[ctx], PARALLEL[gen], layout, per_layer)


@pytest.mark.parametrize("layout", [ConvSectionLayout.XBC, ConvSectionLayout.QKV])
@pytest.mark.parametrize(
    ("ctx", "gen"), [("tp1", "tp2"), ("tp2", "tp1"), ("tp4", "tp2"), ("tp2", "tp4"), ("tp4", "tp1")]
)
@pytest.mark.parametrize("n_groups", [1, 2])
def test_replicated_groups_are_read_once(ctx: str, gen: str, layout: ConvSectionLayout, n_groups: int) -> None:
    """Fewer groups than TP ranks: each rank keeps its heads' group whole; a reader takes it from one holder."""
    reshard(PARALLEL[ctx], PARALLEL[gen], layout, False, n_groups=n_groups)


def test_sections_split_one_by_one() -> None:
    """XBC over TP2: rank 1 holds the second half of x, then its group of B and of C (not channels 24..47); with
    one group, both ranks hold all of B and C; NONE splits the channels contiguously."""
    config = rnn_config(ConvSectionLayout.XBC)
    assert conv_sections(config) == (32, 8, 8)
    assert rnn_share(config, PARALLEL["tp2"], 1).channels == (range(16, 32), range(4, 8), range(4, 8))
    one_group = dataclasses.replace(config, n_groups=1)
    assert rnn_share(one_group, PARALLEL["tp2"], 1).channels == (range(16, 32), range(0, 4), range(0, 4))
    none = rnn_config(ConvSectionLayout.NONE)
    assert rnn_share(none, PARALLEL["tp2"], 1).channels == (range(24, 48),)
    assert conv_sections(rnn_config(ConvSectionLayout.QKV)) == (8, 8, 32)
    assert conv_sections(rnn_config(ConvSectionLayout.NONE)) == (48,)


def test_equal_layouts_read_one_run_per_layer_and_kind() -> None:
    """Same TP on both sides: a layer's conv sections are contiguous on both, so they merge into one run."""
    assert reshard(PARALLEL["tp1"], PARALLEL["tp1"], ConvSectionLayout.XBC, False) == 3 * 2


# --- what the RNN formatter refuses -----------------------------------------------------------------------
def hybrid_state(rnn: RnnConfig | None, parallel: ParallelConfig | None = None) -> CacheState:
    return CacheState(
        ModelConfig((2, 2), 8, 16), parallel or ParallelConfig(attention_layers_per_pp_rank=(2,)), DataType.FLOAT16,
        rnn=rnn,
    )  # fmt: skip


def test_what_rnn_refuses() -> None:
    formatter = StandardFormatter()
    xbc = rnn_config(ConvSectionLayout.XBC, layers=2)
    with pytest.raises(IncompatibleStateError, match="gen has RNN state, ctx has no"):
        formatter.inquire_support(hybrid_state(xbc), hybrid_state(None))
    with pytest.raises(IncompatibleStateError, match="conv_section_layout: ours <ConvSectionLayout.XBC"):
        formatter.inquire_support(hybrid_state(xbc), hybrid_state(rnn_config(ConvSectionLayout.QKV, layers=2)))
    with pytest.raises(IncompatibleStateError, match="ssm_dtype"):
        formatter.inquire_support(hybrid_state(xbc), hybrid_state(dataclasses.replace(xbc, ssm_dtype=DataType.FLOAT32)))
    tp8 = ParallelConfig(tp=8, attention_layers_per_pp_rank=(2,))
    with pytest.raises(NotSupportedError, match="ctx: 4 Mamba heads do not split evenly over TP 8"):
        RnnFormatter().inquire_support(hybrid_state(xbc), hybrid_state(xbc, tp8))
    three_groups = dataclasses.replace(xbc, num_heads=6, n_groups=3)
    tp2 = ParallelConfig(tp=2, attention_layers_per_pp_rank=(2,))
    with pytest.raises(NotSupportedError, match="gen: 3 groups neither split over nor replicate evenly on TP 2"):
        RnnFormatter().inquire_support(hybrid_state(three_groups, tp2), hybrid_state(three_groups))
    none = dataclasses.replace(xbc, conv_section_layout=ConvSectionLayout.NONE, head_dim=1, n_groups=1, d_state=1)
    tp4 = ParallelConfig(tp=4, attention_layers_per_pp_rank=(2,))
    with pytest.raises(NotSupportedError, match=r"6 conv channels \(layout none\) do not split over TP 4"):
        RnnFormatter().inquire_support(hybrid_state(none, tp4), hybrid_state(none))
    pp2 = ParallelConfig(pp=2, attention_layers_per_pp_rank=(1, 1))
    empty_stage = dataclasses.replace(xbc, layers_per_pp_rank=(2, 0))
    with pytest.raises(NotSupportedError, match=r"every PP stage needs a Mamba layer \(layers per PP rank: \(2, 0\)\)"):
        RnnFormatter().inquire_support(hybrid_state(xbc), hybrid_state(empty_stage, pp2))
    cp2 = ParallelConfig(cp=2, attention_layers_per_pp_rank=(2,))
    with pytest.raises(NotSupportedError, match="gen: RNN state with CP is not supported"):
        RnnFormatter().inquire_support(hybrid_state(xbc, cp2), hybrid_state(xbc))


# --- hybrid requests over real NIXL (loopback) --------------------------------------------------------------
LAYERS, HEADS, TPB, DIM = 2, 2, 16, 8


def hybrid_side(config: RnnConfig, kind: LayoutKind) -> tuple[PagedKVCache, CacheTransceiver]:
    parallel = ParallelConfig(attention_layers_per_pp_rank=(LAYERS,))
    cache = PagedKVCache(
        num_blocks=16, num_layers=LAYERS, num_heads=HEADS, tokens_per_block=TPB, head_dim=DIM, dtype=DataType.FLOAT16,
        kind=kind, rnn=pools_for(config, parallel, 0, per_layer=kind is not LayoutKind.BLOCK_MAJOR),
    )  # fmt: skip
    state = dataclasses.replace(hybrid_state(config, parallel), model=ModelConfig((HEADS,) * LAYERS, DIM, TPB))
    return cache, CacheTransceiver(cache, state)


def record_reads(transceiver: CacheTransceiver) -> list[str]:
    """The READs of cache data the transceiver's agent posts from now on: "prepared" (indexed lists) or "ranges"
    (explicit rows). The hold checks (READs of the ctx rank's hold board into a landing window) are not data."""
    posted: list[str] = []
    agent, windows = transceiver._agent, transceiver._receiver._side.windows

    def read(local, *args):  # noqa: ANN001, ANN202
        if local is not windows:
            posted.append("prepared")
        return type(agent).read(agent, local, *args)

    agent.read = read
    agent.read_ranges = lambda *args: posted.append("ranges") or type(agent).read_ranges(agent, *args)
    return posted


@pytest.fixture
def hybrid_pair() -> tuple:
    config = rnn_config(ConvSectionLayout.XBC, layers=3)
    ctx, gen = hybrid_side(config, LayoutKind.BLOCK_MAJOR), hybrid_side(config, LayoutKind.PER_LAYER_NHD)
    yield config, ctx, gen
    for _, transceiver in (ctx, gen):
        transceiver.close()
        assert transceiver._agent.live_handles == {"transfers": 0, "prepared": 0, "remotes": 0, "registrations": 0}


def move_hybrid(
    config: RnnConfig, ctx_side: tuple, gen_side: tuple, ctx_id: int, gen_id: int, num_tokens: int
) -> tuple:
    """Fill and respond a hybrid request on the ctx side and pull it on the gen side; returns both requests and
    the READs the gen side posted. The gen request's KV and state are checked element by element."""
    (ctx_cache, ctx), (gen_cache, gen) = ctx_side, gen_side
    where = Slice(0, LAYERS, 0, HEADS, 2, DIM, 0, num_tokens)
    held = rnn_share(config, ParallelConfig(attention_layers_per_pp_rank=(LAYERS,)), 0)
    ctx_cache.allocate(ctx_id, num_tokens)
    ctx_cache.write_tokens(ctx_id, expected(ctx_id, where, 2))
    ctx_cache.rnn.write(ctx_cache.rnn_slot(ctx_id), *rnn_expected(ctx_id, held, config))
    request = TransferRequest(ctx_id, num_tokens=num_tokens)
    ctx.respond_and_send_async(request)
    gen_cache.allocate(gen_id, num_tokens)
    received = TransferRequest(gen_id, context_phase_params=request.context_phase_params)
    posted = record_reads(gen)
    gen.request_and_receive_sync(received)
    assert received.state is RequestState.GENERATION_TRANS_COMPLETE, received.error
    assert count_mismatches(gen_cache.read_tokens(gen_id, num_tokens), ctx_id, where) == 0
    conv, ssm = gen_cache.rnn.read(gen_cache.rnn_slot(gen_id))
    want_conv, want_ssm = rnn_expected(ctx_id, held, config)
    assert np.array_equal(conv, want_conv) and np.array_equal(ssm, want_ssm)
    return request, received, posted


def test_hybrid_request_moves_kv_and_state_in_one_transfer(hybrid_pair: tuple) -> None:
    config, ctx_side, gen_side = hybrid_pair
    ctx_side[0].allocate(99, 1)  # takes slot 0: the request's slot on the ctx side is 1, on the gen side 0
    request, received, posted = move_hybrid(config, ctx_side, gen_side, 5, 8, 40)
    assert posted == ["ranges", "ranges"]  # block-major -> NHD: the KV staged (one piece), then the state
    assert (ctx_side[0].rnn_slot(5), gen_side[0].rnn_slot(8)) == (1, 0)
    kv_bytes = 3 * TPB * LAYERS * 2 * HEADS * DIM * 2
    state_bytes = 3 * (48 * 3 * 4 + 4 * 8 * 4 * 2)
    assert received.transfer_bytes == request.transfer_bytes == kv_bytes + state_bytes  # read == held on ctx
    ctx_side[1].check_context_transfer_status(None, mark_complete=True)
    assert request.state is RequestState.CONTEXT_COMPLETE


def test_slot_is_held_while_pinned(hybrid_pair: tuple) -> None:
    """Freeing a request whose transfer still pins it keeps its Mamba slot until the transfer ends."""
    _, (ctx_cache, _), _ = hybrid_pair
    ctx_cache.allocate(1, 10)
    ctx_cache.pin(1)
    ctx_cache.free(1)
    assert ctx_cache.rnn.slots.free_blocks == 2
    ctx_cache.unpin(1)
    assert ctx_cache.rnn.slots.free_blocks == 3


def test_hybrid_refuses_layerwise_and_missing_pools(hybrid_pair: tuple) -> None:
    config, (ctx_cache, ctx), _ = hybrid_pair
    ctx_cache.allocate(1, 10)
    with pytest.raises(NotSupportedError, match="layer-wise transfer of RNN state"):
        ctx.respond_and_send_layer_wise([TransferRequest(1, num_tokens=10)], ContextProgress(LAYERS))
    plain = PagedKVCache(
        num_blocks=4, num_layers=LAYERS, num_heads=HEADS, tokens_per_block=TPB, head_dim=DIM, dtype=DataType.FLOAT16
    )
    with pytest.raises(IncompatibleStateError, match="the cache state has RNN state; the cache keeps no pools"):
        CacheTransceiver(plain, hybrid_state(config))


def test_hybrid_pairs_with_every_section_layout() -> None:
    """One terminal state per request, whatever the section layout (conv channels differ per layout); the direct
    KV and the state come in one READ."""
    for layout in ConvSectionLayout:
        config = rnn_config(layout, layers=2)
        ctx_side, gen_side = hybrid_side(config, LayoutKind.BLOCK_MAJOR), hybrid_side(config, LayoutKind.BLOCK_MAJOR)
        try:
            _, _, posted = move_hybrid(config, ctx_side, gen_side, 3, 4, 20)
            assert posted == ["ranges"], layout  # the direct KV and the state in one READ: one round trip
        finally:
            ctx_side[1].close()
            gen_side[1].close()


def respond(cache: PagedKVCache, transceiver: CacheTransceiver) -> tuple[TransferRequest, ContextPhaseParams]:
    """Request 1 (20 tokens) responded on the ctx side, and its params decoded (to be altered)."""
    cache.allocate(1, 20)
    request = TransferRequest(1, num_tokens=20)
    transceiver.respond_and_send_async(request)
    return request, wire.decode(request.context_phase_params, ContextPhaseParams)


def test_a_slot_outside_the_ctx_pools_is_refused_before_any_read(hybrid_pair: tuple) -> None:
    """Params naming a slot the ctx pools do not have (forged, or from a mismatched build) fail the request."""
    _, (ctx_cache, ctx), (gen_cache, gen) = hybrid_pair
    request, params = respond(ctx_cache, ctx)
    forged = encode_params(dataclasses.replace(params, rnn_slot=99))
    gen_cache.allocate(2, 20)
    received = TransferRequest(2, context_phase_params=forged)
    gen.request_and_receive_sync(received)
    assert received.state is RequestState.TRANS_ERROR
    assert "ctx rank 0: RNN state slot 99 outside its 3 slots" in received.error
    missing = encode_params(dataclasses.replace(params, rnn_slot=None))
    gen_cache.allocate(3, 20)
    received = TransferRequest(3, context_phase_params=missing)
    gen.request_and_receive_sync(received)
    assert "the ctx params carry no RNN state slot" in received.error
    ctx.cancel_request(request)


def test_pools_that_do_not_hold_the_share_fail_at_start() -> None:
    config = rnn_config(ConvSectionLayout.XBC, layers=2)
    wrong = RnnStatePools(2, 3, 40, config.d_conv, config.conv_dtype, 4, 8, 4, config.ssm_dtype)  # 48 channels due
    cache = PagedKVCache(
        num_blocks=4, num_layers=LAYERS, num_heads=HEADS, tokens_per_block=TPB, head_dim=DIM, dtype=DataType.FLOAT16,
        rnn=wrong,
    )  # fmt: skip
    state = dataclasses.replace(hybrid_state(config), model=ModelConfig((HEADS,) * LAYERS, DIM, TPB))
    with pytest.raises(
        IncompatibleStateError,
        match=r"this rank: RNN state pools do not match its share: conv_channels 40 \(expected 48\)",
    ):
        CacheTransceiver(cache, state)


def test_gen_refuses_layerwise_params_with_rnn_state(hybrid_pair: tuple) -> None:
    """Even if a ctx side sends them (the state would be read before prefill finished it)."""
    _, (ctx_cache, ctx), (gen_cache, gen) = hybrid_pair
    request, params = respond(ctx_cache, ctx)
    gen_cache.allocate(2, 20)
    received = TransferRequest(2, context_phase_params=encode_params(dataclasses.replace(params, layerwise=True)))
    gen.request_and_receive_sync(received)
    assert received.state is RequestState.TRANS_ERROR
    assert "layer-wise transfer of RNN state is not supported" in received.error
    ctx.cancel_request(request)


def test_a_request_without_a_slot_is_not_left_pinned(hybrid_pair: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot is looked up before the blocks are pinned: a cache manager whose lookup fails leaves nothing
    pinned (the blocks come back as soon as the server frees the request)."""
    _, (ctx_cache, ctx), _ = hybrid_pair
    ctx_cache.allocate(5, 20)

    def no_slot(request_id: int) -> int:
        raise KeyError(f"request {request_id} has no slot in this server")

    monkeypatch.setattr(ctx_cache, "rnn_slot", no_slot)
    with pytest.raises(KeyError, match="request 5 has no slot"):
        ctx.respond_and_send_async(TransferRequest(5, num_tokens=20))
    ctx_cache.free(5)
    assert ctx_cache.free_blocks == 16 and ctx_cache.rnn.slots.free_blocks == 3


@pytest.mark.parametrize(
    ("ctx", "gen"), [("tp1", "tp4"), ("tp4", "tp1"), ("tp2pp2", "tp4"), ("tp2dp", "tp4"), ("tp4", "tp2dp")]
)
@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_readers_are_exactly_the_gen_ranks_that_read(ctx: str, gen: str, n_groups: int) -> None:
    """What the ctx side is told to expect must be who comes: no reader missing, none counted that never reads."""
    config = rnn_config(ConvSectionLayout.XBC, n_groups=n_groups)
    ctx_par, gen_par = PARALLEL[ctx], PARALLEL[gen]
    ctx_config = rnn_config(ConvSectionLayout.XBC, ctx_par.pp, n_groups=n_groups)
    gen_config = rnn_config(ConvSectionLayout.XBC, gen_par.pp, n_groups=n_groups)
    assert config.num_heads % n_groups == 0
    for gen_dp in range(gen_par.dp_size):
        for peer in range(ctx_par.world_size):
            reading = {
                rank
                for rank in range(gen_par.world_size)
                if holds_request(gen_par, rank, gen_dp)
                and peer in dict(rnn_pieces(gen_config, gen_par, rank, ctx_config, ctx_par, 0))
            }
            assert rnn_readers(gen_config, gen_par, gen_dp, ctx_config, ctx_par, 0, peer) == reading
            if holds_request(ctx_par, peer, 0) and ctx_par.world_size <= gen_par.world_size:
                assert reading, f"ctx rank {peer} holds state nobody reads"
