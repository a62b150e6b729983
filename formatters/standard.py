"""The standard (MHA/GQA) cache formatter, for any pairing of TP, PP, CP and attention DP.

For each ctx peer (``topology.peer_slices``) the gen rank takes the overlap of the two shares. Direct mode
reads it straight from the ctx pool into the gen pool: both layouts enumerate *units* (a head's tokens of a
block where heads are inner, a whole (layer, kv) chunk for NHD), both sides list the box's units in the same
logical order, and NIXL merges entries contiguous on both sides into long runs. Where the runs would be
shorter than ``direct_min_run_bytes`` (CacheTransceiverConfig), or where the two layouts order heads and
tokens differently, staged mode packs the box on the ctx side into a staging slot, reads it as one run and
unpacks it.

ctx and gen blocks may hold different numbers of tokens when one is a whole multiple of the other: slices then
count blocks of the smaller size (``topology.BlockGrid``). A direct read takes each unit of the smaller blocks into
its token run of the larger one (a head's tokens of a block are one run of the larger block's head slab; an NHD
chunk, of its chunk), as explicit rows: no prepared descriptor list has such entries. A staged piece is whole ctx
blocks (the ctx packs knowing only its own size), of which the gen unpacks the token runs it takes
(``layout.Parts``): not those it already holds (prefix reuse), nor those past its last block. Layer-wise requests
stage: rows would read every layer at once.
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
from nixl_kv.layout import KVLayout, LayoutKind, Parts
from nixl_kv.pool_checks import check_block_range
from nixl_kv.ranges import coalesce
from nixl_kv.state import AttentionType, CacheState
from nixl_kv.topology import (
    BlockGrid,
    PeerSlice,
    Share,
    head_duplication,
    holds_request,
    overlap,
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
                ("attention_window", self_state.model.attention_window, peer_state.model.attention_window),
            )
            if mine != theirs
        ]
        differences += self._block_size_difference(self_state, peer_state)
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

    def _block_size_difference(self, self_state: CacheState, peer_state: CacheState) -> list[str]:
        """Blocks of different sizes meet when one size is a whole multiple of the other (the standard formatter
        reads token runs of the larger blocks); none else, nor MLA's (its indexer-K cache follows whole blocks),
        nor under CP (its shares split blocks, which would then split differently on the two sides)."""
        mine, theirs = self_state.model.tokens_per_block, peer_state.model.tokens_per_block
        if mine == theirs:
            return []
        named = f"tokens_per_block: ours {mine}, peer {theirs}"
        if max(mine, theirs) % min(mine, theirs):
            return [f"{named} (neither is a whole multiple of the other)"]
        if self.attention_type is not AttentionType.DEFAULT:
            return [f"{named} (the {self.attention_type.value} formatter needs equal block sizes)"]
        if self_state.parallel.cp > 1 or peer_state.parallel.cp > 1:
            cps = f"gen cp={self_state.parallel.cp}, ctx cp={peer_state.parallel.cp}"
            return [f"{named} (different block sizes need cp=1 on both sides; {cps})"]
        return []

    # --- planning (gen side) ---------------------------------------------------------------------------
    def plan(self, request: ReadRequest) -> list[PeerRead]:
        gen, ctx = request.self_state.cache, request.peer_state.cache
        heads, grid = _heads(gen), BlockGrid.of(gen.model.tokens_per_block, ctx.model.tokens_per_block)
        num_blocks = -(-request.num_tokens // gen.model.tokens_per_block)
        grid_blocks = grid.blocks(request.num_tokens)  # slices count grid blocks (the sides' own when sizes match)
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
        first = self.first_needed_block(gen, num_blocks, request.first_block) * grid.gen_split
        slices = peer_slices(
            gen.parallel, request.self_rank, ctx.parallel, heads, grid_blocks, request.peer_dp_rank, first
        )
        if request.only_peer is not None:
            slices = tuple(piece for piece in slices if piece.peer_rank == request.only_peer)
        if request.layers is not None:
            slices = tuple(_restrict(piece, request.layers) for piece in slices)
            slices = tuple(piece for piece in slices if len(piece.layers))

        def readers(peer_rank: int) -> frozenset[int]:
            """Every gen rank that reads any part of the request from ``peer_rank``."""
            kv = reader_ranks(
                ctx.parallel, peer_rank, gen.parallel, heads, grid_blocks, request.peer_dp_rank, gen_dp_rank, first
            )
            return frozenset(kv).union(*(planner.readers(request, peer_rank) for planner in self.state_planners))

        layer_step = request.only_peer is not None or request.layers is not None  # layer-wise: the KV part only
        reads, state = {}, {}
        ctx_blocks = -(-request.num_tokens // ctx.model.tokens_per_block)
        for piece in slices:
            theirs = share(ctx.parallel, piece.peer_rank, heads, ctx_blocks)
            box = _grid_box(piece, grid)
            local = _to_local(box, mine, local_blocks, grid.gen_split)
            remote = _to_local(box, theirs, self._peer_blocks(request, piece.peer_rank, theirs), grid.ctx_split)
            read = self._peer_read(request, piece, mine, theirs, local, remote, grid)
            reads[piece.peer_rank] = read
            if read.state is not None:  # the KV itself as rows: the state read after it joins them
                state.setdefault(piece.peer_rank, []).append(read.state)
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
        grid: BlockGrid,
    ) -> PeerRead:
        """The KV part, ``local`` and ``remote`` being the slice in each side's terms; ``expected_readers`` is
        filled in by ``plan`` once every part is known."""
        local_layout = request.self_layout
        remote_layout = request.peer_state.comm.ranks[piece.peer_rank].layout
        box = _grid_box(piece, grid)
        nbytes = self.box_bytes(request.self_state.cache, box)
        coarse = _whole_segments(local_layout, remote_layout, piece, mine, theirs)  # consecutive blocks merge
        run = _direct_run_bytes(local_layout, remote_layout, piece, mine, theirs)
        direct = local_layout.same_interior(remote_layout) and (coarse or 0 < run >= request.direct_min_run_bytes)
        if direct and grid.uniform:
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
        if direct and not request.layerwise:  # runs of the larger blocks: no prepared list has such entries
            rows = RangeRead("kv", *_direct_rows(local_layout, remote_layout, local, remote))
            return PeerRead(piece.peer_rank, 0, 0, layers=piece.layers, state=rows)
        pieces = self._pieces(request, _ctx_blocks(box, grid))
        # whole ctx segments (ctx TP >= gen TP and ctx PP >= gen PP, or only the gen layout differs): gathered
        whole = remote_layout.kind is LayoutKind.BLOCK_MAJOR and (piece.layers, piece.heads) == (
            theirs.layers,
            theirs.heads,
        )
        return PeerRead(piece.peer_rank, 0, nbytes, layers=piece.layers, pieces=pieces, gathered=whole)

    def _pieces(self, request: ReadRequest, box: Box) -> tuple[Box, ...]:
        one = dataclasses.replace(box, blocks=range(1), tokens=None)
        per_block = self.box_bytes(request.self_state.cache, one)
        per_piece = request.stage_bytes // per_block
        if per_piece < 1:
            raise BufferExhaustedError(
                f"one block of the slice ({per_block} bytes) does not fit a {request.stage_bytes}-byte staging slot; "
                "raise max_tokens_in_buffer"
            )
        starts = range(box.blocks.start, box.blocks.stop, per_piece)
        return tuple(_sub_box(box, range(s, min(s + per_piece, box.blocks.stop))) for s in starts)

    # --- staging (both sides) ------------------------------------------------------------------------------
    def localize(self, state: CacheState, rank: int, box: Box, num_blocks: int, block_ids: np.ndarray) -> LocalBox:
        held = share(state.parallel, rank, _heads(state), num_blocks)
        inside = all(
            outer.start <= inner.start and inner.stop <= outer.stop and len(inner)
            for inner, outer in ((box.layers, held.layers), (box.heads, held.heads), (box.blocks, held.blocks))
        )
        if not inside:
            raise IncompatibleStateError(f"box {box} is not inside rank {rank}'s share {held}")
        if box.tokens_per_block in (0, state.model.tokens_per_block):  # our own blocks (the holder packs them whole)
            return _to_local(box, held, block_ids)
        return _landing(box, held, block_ids, state.model.tokens_per_block)

    def box_bytes(self, state: CacheState, box: Box) -> int:
        per_token = len(box.layers) * state.kv_factor * len(box.heads) * state.model.head_dim * state.dtype.itemsize
        return per_token * len(box.blocks) * (box.tokens_per_block or state.model.tokens_per_block)

    def pack(self, layout: KVLayout, views: list[Any], box: LocalBox, out: Any) -> int:
        return copy_box(layout, views, box.block_ids, box.layers, box.heads, out, to_pools=False)

    def unpack(self, layout: KVLayout, views: list[Any], box: LocalBox, data: Any, segments: bool = False) -> None:
        copy_box(
            layout, views, box.block_ids, box.layers, box.heads, data, to_pools=True, segments=segments, parts=box.parts
        )


def _heads(state: CacheState) -> int:
    return state.model.num_kv_heads_per_layer[0]


def _restrict(piece: PeerSlice, layers: range) -> PeerSlice:
    overlap = range(max(piece.layers.start, layers.start), min(piece.layers.stop, layers.stop))
    return PeerSlice(piece.peer_rank, overlap, piece.heads, piece.blocks)


def _shift(values: range, start: int) -> range:
    return range(values.start - start, values.stop - start)


def _grid_box(piece: PeerSlice, grid: BlockGrid) -> Box:
    """A slice as a box of grid blocks (``tokens_per_block`` 0 where they are both sides' own blocks)."""
    return Box(piece.layers, piece.heads, piece.blocks, 0 if grid.uniform else grid.tokens)


def _to_local(box: Box, held: Share, block_ids: np.ndarray, split: int = 1) -> LocalBox:
    """A global box in the terms of the rank whose share is ``held`` and whose block ids are ``block_ids``; with
    ``split``, the box counts grid blocks, ``split`` to each of the rank's blocks (``BlockGrid``)."""
    layers, heads = _shift(box.layers, held.layers.start), _shift(box.heads, held.heads.start)
    ids = np.asarray(block_ids, dtype=np.int64)
    if split == 1:
        return LocalBox(ids[box.blocks.start - held.blocks.start : box.blocks.stop - held.blocks.start], layers, heads)
    grid = np.arange(box.blocks.start, box.blocks.stop, dtype=np.int64)
    return LocalBox(ids[grid // split - held.blocks.start], layers, heads, Parts(box.tokens_per_block, grid % split))


def _ctx_blocks(box: Box, grid: BlockGrid) -> Box:
    """A box of grid blocks as the whole ctx blocks holding it (what the ctx packs), with the tokens the gen takes."""
    if grid.uniform:
        return box
    split, tokens = grid.ctx_split, grid.tokens
    blocks = range(box.blocks.start // split, -(-box.blocks.stop // split))
    taken = range(box.blocks.start * tokens, box.blocks.stop * tokens)
    return Box(box.layers, box.heads, blocks, split * tokens, taken)


def _sub_box(box: Box, blocks: range) -> Box:
    """Some of a box's blocks, with the tokens of theirs the reader takes."""
    if box.tokens is None:
        return dataclasses.replace(box, blocks=blocks)
    span = range(blocks.start * box.tokens_per_block, blocks.stop * box.tokens_per_block)
    return dataclasses.replace(box, blocks=blocks, tokens=overlap(box.tokens, span))


def _landing(box: Box, held: Share, block_ids: np.ndarray, tokens_per_block: int) -> LocalBox:
    """A piece of whole peer blocks of another size in the terms of the reader whose blocks hold
    ``tokens_per_block``: the token runs of it that the reader takes (``box.tokens``), each into its block."""
    run = min(box.tokens_per_block, tokens_per_block)
    packed = range(box.blocks.start * box.tokens_per_block, box.blocks.stop * box.tokens_per_block)
    taken = packed if box.tokens is None else box.tokens
    ids = np.asarray(block_ids, dtype=np.int64)
    if taken.start < packed.start or taken.stop > packed.stop or taken.start % run or taken.stop % run:
        raise IncompatibleStateError(f"box {box} takes tokens outside its blocks or not in runs of {run}")
    grid = np.arange(taken.start // run, taken.stop // run, dtype=np.int64)
    split = tokens_per_block // run
    if len(grid) and grid[-1] // split >= len(ids):
        raise IncompatibleStateError(f"box {box} reaches past the {len(ids)} blocks this rank holds for the request")
    skip = taken.start // run - packed.start // run
    parts = Parts(run, grid % split, skip, len(packed) // run, box.tokens_per_block)
    layers, heads = _shift(box.layers, held.layers.start), _shift(box.heads, held.heads.start)
    return LocalBox(ids[grid // split], layers, heads, parts)


def _direct_rows(local: KVLayout, remote: KVLayout, mine: LocalBox, theirs: LocalBox) -> tuple[np.ndarray, np.ndarray]:
    """Explicit (address, length, device) rows of a direct read between blocks of different sizes: one unit of the
    smaller blocks to a token run of a unit of the larger, both sides in the same order, merged into runs."""
    block_first = local.kind is remote.kind is LayoutKind.BLOCK_MAJOR
    local_at, remote_at = _unit_addresses(local, mine, block_first), _unit_addresses(remote, theirs, block_first)
    lengths = np.full(len(local_at), min(local.unit_bytes, remote.unit_bytes))
    return coalesce(local_at, remote_at, lengths, local.pools, remote.pools)


def _unit_addresses(layout: KVLayout, box: LocalBox, block_first: bool) -> np.ndarray:
    heads = box.heads if layout.heads_inner else None
    if box.parts is None:
        return layout.unit_addresses(layout.unit_indices(box.block_ids, box.layers, heads, block_first), False)
    return layout.part_addresses(box.block_ids, box.parts, box.layers, heads, block_first)


def _direct_indices(layout: KVLayout, box: LocalBox, coarse: bool, block_first: bool) -> np.ndarray:
    """Descriptor indices of a direct read: whole segments, or units (head slabs; whole chunks for NHD)."""
    if coarse:
        return layout.segment_indices(box.block_ids, box.layers)
    heads = box.heads if layout.heads_inner else None
    return layout.unit_indices(box.block_ids, box.layers, heads, block_first)


def _whole_segments(local: KVLayout, remote: KVLayout, piece: PeerSlice, mine: Share, theirs: Share) -> bool:
    """True when the slice is made of whole segments on both sides: one descriptor per block (or chunk)."""
    if local.kind is not remote.kind or local.tokens_per_block != remote.tokens_per_block:
        return False
    if not len(piece.heads) == len(mine.heads) == len(theirs.heads):
        return False
    if local.kind is LayoutKind.BLOCK_MAJOR:
        return len(piece.layers) == len(mine.layers) == len(theirs.layers)
    return True


def _direct_run_bytes(local: KVLayout, remote: KVLayout, piece: PeerSlice, mine: Share, theirs: Share) -> int:
    """The shortest contiguous run a direct read of this slice would post (0 when it cannot be direct)."""
    if local.heads_inner != remote.heads_inner:
        return 0
    all_heads = len(piece.heads) == len(mine.heads) == len(theirs.heads)
    if local.tokens_per_block != remote.tokens_per_block:  # a unit of the smaller blocks: heads never merge
        smaller = min(local, remote, key=lambda layout: layout.tokens_per_block)
        return smaller.unit_bytes if smaller.heads_inner or all_heads else 0
    if not local.heads_inner:
        return local.chunk_bytes if all_heads else 0
    if not (local.heads_adjacent and remote.heads_adjacent):  # HKND: K and V of a head lie between heads
        return local.unit_bytes
    return local.chunk_bytes if all_heads else len(piece.heads) * local.unit_bytes
