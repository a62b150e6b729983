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
from nixl_kv.ranges import coalesce
from nixl_kv.rnn import RnnShare, check_split, overlap, rnn_share, shares_state
from nixl_kv.state import CacheState, RnnConfig
from nixl_kv.topology import holds_request, position

COMPARED = ("num_heads", "head_dim", "d_state", "d_conv", "n_groups", "hidden_size", "conv_section_layout")


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
            for name in (*COMPARED, "conv_dtype", "ssm_dtype", "num_layers")
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
        if request.self_rnn is None or request.local_rnn_slot is None:
            raise IncompatibleStateError("this gen rank holds no RNN state slot for the request")
        if request.peer_rnn_slot is None:
            raise IncompatibleStateError("the ctx params carry no RNN state slot")
        mine = rnn_share(gen.rnn, gen.parallel, request.self_rank)
        _check_layout(request.self_rnn, mine, gen.rnn, request.local_rnn_slot, "gen")
        found = {}
        for peer in range(ctx.parallel.world_size):
            if not holds_request(ctx.parallel, peer, request.peer_dp_rank):
                continue
            theirs = rnn_share(ctx.rnn, ctx.parallel, peer)
            if not shares_state(mine, theirs):
                continue
            layout = request.peer_state.comm.ranks[peer].rnn
            if layout is None:
                raise IncompatibleStateError(f"ctx rank {peer} describes no RNN state pools")
            _check_layout(layout, theirs, ctx.rnn, request.peer_rnn_slot, f"ctx rank {peer}")
            local_rows, remote_rows = state_rows(
                request.self_rnn, mine, request.local_rnn_slot, layout, theirs, request.peer_rnn_slot
            )
            found[peer] = RangeRead("rnn state", local_rows, remote_rows)
        return found

    def readers(self, request: ReadRequest, peer_rank: int) -> frozenset[int]:
        gen, ctx = request.self_state.cache, request.peer_state.cache
        if gen.rnn is None or ctx.rnn is None:
            return frozenset()
        theirs = rnn_share(ctx.rnn, ctx.parallel, peer_rank)
        gen_dp_rank = position(gen.parallel, request.self_rank).tp_rank
        return frozenset(
            rank
            for rank in range(gen.parallel.world_size)
            if holds_request(gen.parallel, rank, gen_dp_rank)
            and shares_state(rnn_share(gen.rnn, gen.parallel, rank), theirs)
        )


def _check_layout(layout: RnnLayout, held: RnnShare, config: RnnConfig, slot: int, who: str) -> None:
    """The pools must hold exactly the rank's share, in the config's dtypes, and the slot must exist."""
    want = {
        "num_layers": len(held.layers),
        "conv_channels": held.num_channels,
        "conv_width": config.d_conv - 1,
        "conv_itemsize": config.conv_dtype.itemsize,
        "num_heads": len(held.heads),
        "head_dim": config.head_dim,
        "d_state": config.d_state,
        "ssm_itemsize": config.ssm_dtype.itemsize,
    }
    wrong = [
        f"{name} {getattr(layout, name)} (expected {value})"
        for name, value in want.items()
        if getattr(layout, name) != value
    ]
    wrong += layout.problems()
    if not 0 <= slot < layout.num_slots:
        wrong.append(f"slot {slot} outside its {layout.num_slots} slots")
    if wrong:
        raise IncompatibleStateError(f"{who}: RNN state pools do not match its share: {'; '.join(wrong)}")


def state_rows(
    local: RnnLayout, mine: RnnShare, local_slot: int, remote: RnnLayout, theirs: RnnShare, remote_slot: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the common conv channels (per section) and SSM heads of every common layer, merged into runs.
    Vectorised over layers: one array operation per section, whatever the layer count."""
    layers = overlap(mine.layers, theirs.layers)
    at_gen = np.arange(layers.start - mine.layers.start, layers.stop - mine.layers.start, dtype=np.int64)
    at_ctx = np.arange(layers.start - theirs.layers.start, layers.stop - theirs.layers.start, dtype=np.int64)
    gen_conv, ctx_conv = local.conv_address(at_gen, local_slot), remote.conv_address(at_ctx, remote_slot)
    parts = []  # (local addresses per layer, remote addresses per layer, bytes)
    for section, (ours, peers) in enumerate(zip(mine.channels, theirs.channels, strict=True)):
        common = overlap(ours, peers)
        if len(common):
            parts.append(
                (
                    gen_conv + (mine.channel_offset(section) + common.start - ours.start) * local.channel_bytes,
                    ctx_conv + (theirs.channel_offset(section) + common.start - peers.start) * remote.channel_bytes,
                    len(common) * local.channel_bytes,
                )
            )
    heads = overlap(mine.heads, theirs.heads)
    if len(heads):
        parts.append(
            (
                local.ssm_address(at_gen, local_slot) + (heads.start - mine.heads.start) * local.head_bytes,
                remote.ssm_address(at_ctx, remote_slot) + (heads.start - theirs.heads.start) * remote.head_bytes,
                len(heads) * local.head_bytes,
            )
        )
    if not parts or not len(layers):
        return coalesce(np.zeros(0), np.zeros(0), np.zeros(0), 0, 0)
    local_at = np.stack([part[0] for part in parts], axis=1).reshape(-1)  # layer by layer, parts in order
    remote_at = np.stack([part[1] for part in parts], axis=1).reshape(-1)
    lengths = np.tile(np.array([part[2] for part in parts], dtype=np.int64), len(layers))
    return coalesce(local_at, remote_at, lengths, local.regions[0].device_id, remote.regions[0].device_id)
