"""Gathered reads: whole block-major ctx segments of a slice our layout cannot take directly, READ piece by piece
into a staging slot of ours (one run per consecutive ctx blocks) and unpacked here after each: the ctx never packs."""

from __future__ import annotations

import numpy as np

from nixl_kv.errors import TransferError
from nixl_kv.gen.pull import Pull
from nixl_kv.gen.reads import Reads
from nixl_kv.gen.side import GenSide, Incoming
from nixl_kv.memory import on_device
from nixl_kv.ranges import coalesce


def read_piece(side: GenSide, reads: Reads, incoming: Incoming, pull: Pull) -> int:
    """Post the READ of the pull's current piece into its slot; returns its bytes."""
    box = pull.read.pieces[pull.piece]
    ctx = incoming.ctx_state
    theirs = side.formatter.localize(
        ctx.cache, pull.read.peer_rank, box, incoming.num_blocks, np.asarray(pull.proof.peer_blocks)
    )
    layout, slot = pull.rank.layout, pull.slot.region
    segment = layout.segment_bytes
    nbytes = segment * len(theirs.block_ids)
    if nbytes > slot.nbytes:
        raise TransferError(f"a gathered piece of {nbytes} bytes does not fit a {slot.nbytes}-byte slot")
    remote_at = layout.pools[0].address + theirs.block_ids * segment
    local_at = slot.address + np.arange(len(theirs.block_ids), dtype=np.int64) * segment
    local_rows, remote_rows = coalesce(local_at, remote_at, np.full(len(local_at), segment), [slot], layout.pools)
    side.peers.connect(pull.rank)
    pull.handle = reads.to_peer(
        pull.rank,
        side.agent.read_ranges,
        pull.rank.agent_name,
        local_rows,
        slot.memory,
        remote_rows,
        layout.pools[0].memory,
        b"",
    )
    return nbytes


def unpack_piece(side: GenSide, blocks: np.ndarray, incoming: Incoming, pull: Pull) -> None:
    """The piece's whole ctx segments ``[block, layer, kv, head, token, dim]`` into our pools (one kernel on a
    GPU), done before the slot is reused; ``blocks``: the request's blocks here."""
    box, layout = pull.read.pieces[pull.piece], pull.rank.layout
    local = side.formatter.localize(side.self_state.cache, side.self_rank, box, incoming.num_blocks, blocks)
    data = pull.slot.array[: layout.segment_bytes * len(box.blocks)]
    with on_device(pull.slot.region):  # this thread's GPU is the slot's
        side.formatter.unpack(side.cache.layout, side.views, local, data, segments=True)
