"""The RNN formatter: a request's Mamba conv and SSM state, resharded between any TP and PP layouts.

Each gen rank reads, from every ctx rank whose share overlaps its own, the common Mamba layers and, per layer,
the common conv channels of each section and the common SSM heads: contiguous runs on both sides (a channel's
``d_conv - 1`` values and a head's ``[head_dim, d_state]`` are contiguous), read directly from the ctx slot into
the gen slot. The state is small (kilobytes per layer), so it is never staged.
"""

from __future__ import annotations

import numpy as np

from nixl_kv.errors import IncompatibleStateError, NotSupportedError
from nixl_kv.interfaces import RangeRead, ReadRequest, StatePlanner
from nixl_kv.layout import RnnLayout
from nixl_kv.pool_checks import check_rnn_pools, check_slot
from nixl_kv.ranges import coalesce
from nixl_kv.rnn import RnnPiece, RnnShare, check_split, rnn_pieces, rnn_readers, rnn_share
from nixl_kv.state import CacheState
from nixl_kv.topology import position

COMPARED = (
    "num_heads", "head_dim", "d_state", "d_conv", "n_groups", "hidden_size", "conv_section_layout", "conv_dtype",
    "ssm_dtype", "num_layers",
)  # fmt: skip


class RnnFormatter(StatePlanner):
    def inquire_support(self, self_state: CacheState, peer_state: CacheState) -> None:
        mine, theirs = self_state.rnn, peer_state.rnn
        if mine is None and theirs is None:
            return
        if mine is None or theirs is None:
            has = {True: "has", False: "has no"}
            raise IncompatibleStateError(
                f"gen {has[mine is not None]} RNN state, ctx {has[theirs is not None]}: hybrid and pure attention "
                "models cannot exchange caches"
            )
        differences = [
            f"{name}: ours {getattr(mine, name)!r}, peer {getattr(theirs, name)!r}"
            for name in COMPARED
            if getattr(mine, name) != getattr(theirs, name)
        ]
        if differences:
            raise IncompatibleStateError("ctx and gen RNN states differ: " + "; ".join(differences))
        for side, state in (("gen", self_state), ("ctx", peer_state)):
            try:
                check_split(state.rnn, state.parallel)
            except NotSupportedError as exc:
                raise NotSupportedError(f"{side}: {exc}") from None

    def reads(self, request: ReadRequest) -> dict[int, RangeRead]:
        gen, ctx = request.self_state.cache, request.peer_state.cache
        if gen.rnn is None or ctx.rnn is None:
            return {}
        if request.self_rnn is None or request.self_rnn_slot is None:
            raise IncompatibleStateError("this gen rank holds no RNN state slot for the request")
        if request.peer_rnn_slot is None:
            raise IncompatibleStateError("the ctx params carry no RNN state slot")
        mine = rnn_share(gen.rnn, gen.parallel, request.self_rank)
        check_slot(request.self_rnn, request.self_rnn_slot, "gen")  # the pools were checked at start
        found = {}
        for peer, piece in rnn_pieces(
            gen.rnn, gen.parallel, request.self_rank, ctx.rnn, ctx.parallel, request.peer_dp_rank
        ):
            theirs = rnn_share(ctx.rnn, ctx.parallel, peer)
            layout = request.peer_state.comm.ranks[peer].rnn
            if layout is None:
                raise IncompatibleStateError(f"ctx rank {peer} describes no RNN state pools")
            check_rnn_pools(layout, theirs, ctx.rnn, f"ctx rank {peer}", request.peer_rnn_slot)
            local_rows, remote_rows = state_rows(
                piece, (request.self_rnn, mine, request.self_rnn_slot), (layout, theirs, request.peer_rnn_slot)
            )
            found[peer] = RangeRead("rnn state", local_rows, remote_rows)
        return found

    def readers(self, request: ReadRequest, peer_rank: int) -> frozenset[int]:
        gen, ctx = request.self_state.cache, request.peer_state.cache
        if gen.rnn is None or ctx.rnn is None:
            return frozenset()
        gen_dp_rank = position(gen.parallel, request.self_rank).tp_rank
        return rnn_readers(gen.rnn, gen.parallel, gen_dp_rank, ctx.rnn, ctx.parallel, request.peer_dp_rank, peer_rank)


Holder = tuple[RnnLayout, RnnShare, int]  # a rank's pools, its share, the request's slot there


def state_rows(piece: RnnPiece, local: Holder, remote: Holder) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the piece's conv channels (per section) and SSM heads of every layer, merged into runs.
    Vectorised over layers: one array operation per section, whatever the layer count."""
    (gen, mine, gen_slot), (ctx, theirs, ctx_slot) = local, remote
    layers = piece.layers
    at_gen = np.arange(layers.start - mine.layers.start, layers.stop - mine.layers.start, dtype=np.int64)
    at_ctx = np.arange(layers.start - theirs.layers.start, layers.stop - theirs.layers.start, dtype=np.int64)
    gen_conv, ctx_conv = gen.conv_address(at_gen, gen_slot), ctx.conv_address(at_ctx, ctx_slot)
    parts = []  # (local addresses per layer, remote addresses per layer, bytes)
    for section, common in enumerate(piece.channels):
        if len(common):
            parts.append(
                (
                    gen_conv
                    + (mine.channel_offset(section) + common.start - mine.channels[section].start) * gen.channel_bytes,
                    ctx_conv
                    + (theirs.channel_offset(section) + common.start - theirs.channels[section].start)
                    * ctx.channel_bytes,
                    len(common) * gen.channel_bytes,
                )
            )
    if len(piece.heads):
        parts.append(
            (
                gen.ssm_address(at_gen, gen_slot) + (piece.heads.start - mine.heads.start) * gen.head_bytes,
                ctx.ssm_address(at_ctx, ctx_slot) + (piece.heads.start - theirs.heads.start) * ctx.head_bytes,
                len(piece.heads) * gen.head_bytes,
            )
        )
    local_at = np.stack([part[0] for part in parts], axis=1).reshape(-1)  # layer by layer, parts in order
    remote_at = np.stack([part[1] for part in parts], axis=1).reshape(-1)
    lengths = np.tile(np.array([part[2] for part in parts], dtype=np.int64), len(layers))
    return coalesce(local_at, remote_at, lengths, gen.regions, ctx.regions)
