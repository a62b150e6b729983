"""The standard (MHA/GQA) cache formatter, for any pairing of TP, PP, CP and attention DP.

For each ctx peer (``topology.peer_slices``) the gen rank takes the overlap of the two shares. Direct mode
reads it straight from the ctx pool into the gen pool: both layouts enumerate *units* (a head's tokens of a
block where heads are inner, a whole (layer, kv) chunk for NHD), both sides list the box's units in the same
logical order, and NIXL merges entries contiguous on both sides into long runs. Where the runs would be
shorter than ``direct_min_run_bytes`` (CacheTransceiverConfig), or where the two layouts order heads and
tokens differently, staged mode packs the box on the ctx side into a staging slot, reads it as one run and
unpacks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from nixl_kv.errors import BufferExhaustedError, IncompatibleStateError, NotSupportedError
from nixl_kv.formatters.kernels import copy_box
from nixl_kv.formatters.rnn import RnnFormatter
from nixl_kv.interfaces import Box, Formatter, LocalBox, PeerRead, RangeRead, ReadRequest, StatePlanner
from nixl_kv.layout import KVLayout, LayoutKind
from nixl_kv.pool_checks import check_block_range
from nixl_kv.state import AttentionType, CacheState
from nixl_kv.topology import (
    PeerSlice,
    Share,
    head_duplication,
    holds_request,
    peer_slices,
    position,
    reader_ranks,
    share,
)


class StandardFormatter(Formatter):
    attention_type = AttentionType.DEFAULT

    def __init__(self) -> None:
        self._rnn = RnnFormatter()

    def inquire_support(self, self_state: CacheState, peer_state: CacheState) -> None:
        differences = [
            f"{name}: ours {mine!r}, peer {theirs!r}"
            for name, mine, theirs in (
                ("attention type", self_state.attention_type.value, peer_state.attention_type.value),
                ("dtype", self_state.dtype.value, peer_state.dtype.value),
                ("kv_factor", self_state.kv_factor, peer_state.kv_factor),
                ("layers", self_state.model.num_layers, peer_state.model.num_layers),
                ("kv heads per layer", _heads(self_state), _heads(peer_state)),
                ("head_dim", self_state.model.head_dim, peer_state.model.head_dim),
                ("tokens_per_block", self_state.model.tokens_per_block, peer_state.model.tokens_per_block),
                ("attention_window", self_state.model.attention_window, peer_state.model.attention_window),
            )
            if mine != theirs
        ]
        if differences:
            raise IncompatibleStateError("ctx and gen caches differ: " + "; ".join(differences))
        if self_state.attention_type is not self.attention_type:
            raise IncompatibleStateError(
                f"the {self.attention_type.value} formatter does not move {self_state.attention_type.value} caches"
            )
        for side, state in (("gen", self_state), ("ctx", peer_state)):
            if len(set(state.model.num_kv_heads_per_layer)) != 1:
                raise NotSupportedError(f"{side}: layers with different kv head counts are not supported")
            head_duplication(state.parallel, _heads(state))  # raises when heads do not split over TP
        if self.attention_type is AttentionType.DEFAULT and (
            self_state.has_indexer_k_cache or peer_state.has_indexer_k_cache
        ):
            raise NotSupportedError("the indexer-K cache belongs to MLA (DSA) models; this cache is not MLA")
        for planner in self.state_planners:
            planner.inquire_support(self_state, peer_state)

    # --- planning (gen side) ---------------------------------------------------------------------------
    def plan(self, request: ReadRequest) -> list[PeerRead]:
        gen, ctx = request.self_state.cache, request.peer_state.cache
        heads, tokens_per_block = _heads(gen), gen.model.tokens_per_block
        num_blocks = -(-request.num_tokens // tokens_per_block)
        if len(request.peer_block_ids) != ctx.parallel.cp:
            raise IncompatibleStateError(
                f"params carry block ids for {len(request.peer_block_ids)} ctx CP ranks, ctx has cp={ctx.parallel.cp}"
            )
        mine = share(gen.parallel, request.self_rank, heads, num_blocks)
        local_blocks = np.asarray(request.local_block_ids, dtype=np.int64)
        if len(local_blocks) < len(mine.blocks):
            raise IncompatibleStateError(
                f"gen rank holds {len(local_blocks)} blocks for the request, its share needs {len(mine.blocks)}"
            )
        check_block_range("gen block id", local_blocks[: len(mine.blocks)], request.self_layout.num_blocks)
        gen_dp_rank = position(gen.parallel, request.self_rank).tp_rank
        first = self.first_needed_block(gen, num_blocks, request.first_block)
        slices = peer_slices(
            gen.parallel, request.self_rank, ctx.parallel, heads, num_blocks, request.peer_dp_rank, first
        )
        if request.only_peer is not None:
            slices = tuple(piece for piece in slices if piece.peer_rank == request.only_peer)
        if request.layers is not None:
            slices = tuple(_restrict(piece, request.layers) for piece in slices)
            slices = tuple(piece for piece in slices if len(piece.layers))

        def readers(peer_rank: int) -> frozenset[int]:
            """Every gen rank that reads any part of the request from ``peer_rank``."""
            kv = reader_ranks(
                ctx.parallel, peer_rank, gen.parallel, heads, num_blocks, request.peer_dp_rank, gen_dp_rank, first
            )
            return frozenset(kv).union(*(planner.readers(request, peer_rank) for planner in self.state_planners))

        layer_step = request.only_peer is not None or request.layers is not None  # layer-wise: the KV part only
        reads, state = {}, {}
        for piece in slices:
            theirs = share(ctx.parallel, piece.peer_rank, heads, num_blocks)
            box = Box(piece.layers, piece.heads, piece.blocks)
            local = _to_local(box, mine, local_blocks)
            remote = _to_local(box, theirs, self._peer_blocks(request, piece.peer_rank, theirs))
            reads[piece.peer_rank] = self._peer_read(request, piece, mine, theirs, local, remote)
            box_state = None if layer_step else self.box_state(request, piece.peer_rank, local, remote)
            if box_state is not None:
                state.setdefault(piece.peer_rank, []).append(box_state)
        for planner in () if layer_step else self.state_planners:
            for peer, part in planner.reads(request).items():
                state.setdefault(peer, []).append(part)
        for peer, parts in state.items():
            reads[peer] = dataclasses.replace(reads.get(peer, PeerRead(peer, 0, 0)), state=RangeRead.joined(parts))
        plan = [dataclasses.replace(read, expected_readers=len(readers(peer))) for peer, read in reads.items()]
        return plan if layer_step else plan + self._unneeded(request, gen_dp_rank, readers)

    @property
    def state_planners(self) -> tuple[StatePlanner, ...]:
        """Per-request state moved beside the paged KV (the Mamba state of hybrid models)."""
        return (self._rnn,)

    def box_state(self, request: ReadRequest, peer_rank: int, local: LocalBox, remote: LocalBox) -> RangeRead | None:
        """The read of paged state that follows the KV box by box (MLA: the indexer-K cache); none here."""
        return None

    @staticmethod
    def first_needed_block(state: CacheState, num_blocks: int, reused_blocks: int) -> int:
        """Blocks before this are not moved: the gen side holds them (prefix reuse) or they fall outside the
        sliding window (only the last ``window / tokens_per_block + 1`` blocks are attended)."""
        window = state.model.attention_window
        outside = max(0, num_blocks - (window // state.model.tokens_per_block + 1)) if window else 0
        return min(num_blocks, max(reused_blocks, outside))

    @staticmethod
    def _unneeded(request: ReadRequest, gen_dp_rank: int, readers: Callable[[int], frozenset[int]]) -> list[PeerRead]:
        """On the first gen rank of the request: the ctx ranks holding part of it that no gen rank reads."""
        gen, ctx = request.self_state.cache.parallel, request.peer_state.cache.parallel
        first_rank = next(rank for rank in range(gen.world_size) if holds_request(gen, rank, gen_dp_rank))
        if request.self_rank != first_rank:
            return []
        return [
            PeerRead(peer_rank=rank, expected_readers=0, nbytes=0)
            for rank in range(ctx.world_size)
            if holds_request(ctx, rank, request.peer_dp_rank) and not readers(rank)
        ]

    def _peer_blocks(self, request: ReadRequest, peer_rank: int, theirs: Share) -> np.ndarray:
        cp_rank = position(request.peer_state.cache.parallel, peer_rank).cp_rank
        ids = np.asarray(request.peer_block_ids[cp_rank], dtype=np.int64)
        if len(ids) != len(theirs.blocks):
            raise IncompatibleStateError(
                f"ctx CP rank {cp_rank} sent {len(ids)} block ids, its share of the request is {len(theirs.blocks)}"
            )
        check_block_range("ctx block id", ids, request.peer_state.comm.ranks[peer_rank].layout.num_blocks)
        return ids

    def _peer_read(
        self,
        request: ReadRequest,
        piece: PeerSlice,
        mine: Share,
        theirs: Share,
        local: LocalBox,
        remote: LocalBox,
    ) -> PeerRead:
        """The KV part, ``local`` and ``remote`` being the slice in each side's terms; ``expected_readers`` is
        filled in by ``plan`` once every part is known."""
        local_layout = request.self_layout
        remote_layout = request.peer_state.comm.ranks[piece.peer_rank].layout
        box = Box(piece.layers, piece.heads, piece.blocks)
        nbytes = self.box_bytes(request.self_state.cache, box)
        coarse = _whole_segments(local_layout, remote_layout, piece, mine, theirs)  # consecutive blocks merge
        run = _direct_run_bytes(local_layout, remote_layout, piece, mine, theirs)
        if coarse or (run and run >= request.direct_min_run_bytes):
            block_first = local_layout.kind is remote_layout.kind is LayoutKind.BLOCK_MAJOR
            return PeerRead(
                peer_rank=piece.peer_rank,
                expected_readers=0,
                nbytes=nbytes,
                layers=piece.layers,
                local_indices=_direct_indices(local_layout, local, coarse, block_first),
                remote_indices=_direct_indices(remote_layout, remote, coarse, block_first),
                coarse=coarse,
            )
        pieces = self._pieces(request, box)
        # whole ctx segments (ctx TP >= gen TP and ctx PP >= gen PP, or only the gen layout differs): gathered
        whole = remote_layout.kind is LayoutKind.BLOCK_MAJOR and (piece.layers, piece.heads) == (
            theirs.layers,
            theirs.heads,
        )
        return PeerRead(piece.peer_rank, 0, nbytes, layers=piece.layers, pieces=pieces, gathered=whole)

    def _pieces(self, request: ReadRequest, box: Box) -> tuple[Box, ...]:
        per_block = self.box_bytes(request.self_state.cache, Box(box.layers, box.heads, range(1)))
        per_piece = request.stage_bytes // per_block
        if per_piece < 1:
            raise BufferExhaustedError(
                f"one block of the slice ({per_block} bytes) does not fit a {request.stage_bytes}-byte staging slot; "
                "raise max_tokens_in_buffer"
            )
        starts = range(box.blocks.start, box.blocks.stop, per_piece)
        return tuple(Box(box.layers, box.heads, range(s, min(s + per_piece, box.blocks.stop))) for s in starts)

    # --- staging (both sides) ------------------------------------------------------------------------------
    def localize(self, state: CacheState, rank: int, box: Box, num_blocks: int, block_ids: np.ndarray) -> LocalBox:
        held = share(state.parallel, rank, _heads(state), num_blocks)
        inside = all(
            outer.start <= inner.start and inner.stop <= outer.stop and len(inner)
            for inner, outer in ((box.layers, held.layers), (box.heads, held.heads), (box.blocks, held.blocks))
        )
        if not inside:
            raise IncompatibleStateError(f"box {box} is not inside rank {rank}'s share {held}")
        return _to_local(box, held, block_ids)

    def box_bytes(self, state: CacheState, box: Box) -> int:
        per_token = len(box.layers) * state.kv_factor * len(box.heads) * state.model.head_dim * state.dtype.itemsize
        return per_token * len(box.blocks) * state.model.tokens_per_block

    def pack(self, layout: KVLayout, views: list[Any], box: LocalBox, out: Any) -> int:
        return copy_box(layout, views, box.block_ids, box.layers, box.heads, out, to_pools=False)

    def unpack(self, layout: KVLayout, views: list[Any], box: LocalBox, data: Any, segments: bool = False) -> None:
        copy_box(layout, views, box.block_ids, box.layers, box.heads, data, to_pools=True, segments=segments)


def _heads(state: CacheState) -> int:
    return state.model.num_kv_heads_per_layer[0]


def _restrict(piece: PeerSlice, layers: range) -> PeerSlice:
    overlap = range(max(piece.layers.start, layers.start), min(piece.layers.stop, layers.stop))
    return PeerSlice(piece.peer_rank, overlap, piece.heads, piece.blocks)


def _shift(values: range, start: int) -> range:
    return range(values.start - start, values.stop - start)


def _to_local(box: Box, held: Share, block_ids: np.ndarray) -> LocalBox:
    """A global box in the terms of the rank whose share is ``held`` and whose block ids are ``block_ids``."""
    start, stop = box.blocks.start - held.blocks.start, box.blocks.stop - held.blocks.start
    ids = np.asarray(block_ids, dtype=np.int64)[start:stop]
    return LocalBox(ids, _shift(box.layers, held.layers.start), _shift(box.heads, held.heads.start))


def _direct_indices(layout: KVLayout, box: LocalBox, coarse: bool, block_first: bool) -> np.ndarray:
    """Descriptor indices of a direct read: whole segments, or units (head slabs; whole chunks for NHD)."""
    if coarse:
        return layout.segment_indices(box.block_ids, box.layers)
    heads = box.heads if layout.heads_inner else None
    return layout.unit_indices(box.block_ids, box.layers, heads, block_first)


def _whole_segments(local: KVLayout, remote: KVLayout, piece: PeerSlice, mine: Share, theirs: Share) -> bool:
    """True when the slice is made of whole segments on both sides: one descriptor per block (or chunk)."""
    if local.kind is not remote.kind or not len(piece.heads) == len(mine.heads) == len(theirs.heads):
        return False
    if local.kind is LayoutKind.BLOCK_MAJOR:
        return len(piece.layers) == len(mine.layers) == len(theirs.layers)
    return True


def _direct_run_bytes(local: KVLayout, remote: KVLayout, piece: PeerSlice, mine: Share, theirs: Share) -> int:
    """The shortest contiguous run a direct read of this slice would post (0 when it cannot be direct)."""
    if local.heads_inner != remote.heads_inner:
        return 0
    all_heads = len(piece.heads) == len(mine.heads) == len(theirs.heads)
    if not local.heads_inner:
        return local.chunk_bytes if all_heads else 0
    if not (local.heads_adjacent and remote.heads_adjacent):  # HKND: K and V of a head lie between heads
        return local.unit_bytes
    return local.chunk_bytes if all_heads else len(piece.heads) * local.unit_bytes
