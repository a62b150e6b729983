"""Plan templates: a request planned like an earlier one but for its block ids only maps those ids to indices.

Why: planning a request from scratch (pairing checks, topology, the formatter's boxes) cost about 130 µs of
Python per request on the 2-core machine, more than the READ of a 128-token request. For a given ctx instance,
request length, prefix reuse and ctx DP rank, every plan is the same but for the block ids, and a direct read's
descriptor indices are affine in the block id (``KVLayout.block_stride``). So the first such request is
planned once with *positions* for block ids (0, 1, 2, ...); later ones turn their ids into indices with one
gather: ``index = template + (ids[position] - position) * stride``.

Plans that read per-request state (Mamba state, the indexer-K cache) depend on more than block ids; they are
planned from scratch every time (their key is remembered as such). So are direct reads between ctx and gen blocks
of different sizes: their entries are token runs of the larger blocks, read as explicit rows (``RangeRead``), which
no prepared descriptor list holds. The key counts the request's blocks on both sides: with different block sizes,
requests with as many ctx blocks may need different numbers of gen blocks.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nixl_kv.errors import NixlKvError
from nixl_kv.interfaces import PeerRead, ReadRequest
from nixl_kv.layout import KVLayout
from nixl_kv.pool_checks import check_block_range
from nixl_kv.state import DataTransceiverState
from nixl_kv.topology import position

MAX_TEMPLATES = 1024

Planner = Callable[[ReadRequest], list[PeerRead]]


@dataclass(frozen=True)
class _Indices:
    """One side's descriptor indices of a direct read: ``index = base + block_id[position] * stride``."""

    base: np.ndarray  # int32: the index with block id 0 (never negative, below 2**31 as every index)
    positions: np.ndarray  # the block position each entry belongs to
    stride: int

    @classmethod
    def of(cls, indices: np.ndarray, layout: KVLayout, coarse: bool) -> _Indices:
        """From indices planned with block id = block position."""
        stride = layout.block_stride(coarse)
        template = np.asarray(indices, dtype=np.int64)
        positions = (template // stride) % layout.num_blocks
        return cls((template - positions * stride).astype(np.int32), positions, stride)

    def with_ids(self, block_ids: np.ndarray) -> np.ndarray:
        """``block_ids`` int32, already checked to lie inside the pool."""
        indices = block_ids[self.positions]
        indices *= self.stride
        indices += self.base
        return indices


@dataclass(frozen=True)
class _ReadTemplate:
    read: PeerRead
    cp_rank: int  # whose block ids the ctx side of this read uses
    local: _Indices | None = None
    remote: _Indices | None = None

    def instantiate(self, local_ids: np.ndarray, peer_ids: list[np.ndarray]) -> PeerRead:
        if self.local is None or self.remote is None:
            return self.read  # staged, gathered or no-readers: no block id in the plan itself
        read = self.read  # built field by field: dataclasses.replace costs more than the rest of this
        return PeerRead(
            read.peer_rank,
            read.expected_readers,
            read.nbytes,
            read.layers,
            self.local.with_ids(local_ids),
            self.remote.with_ids(peer_ids[self.cp_rank]),
            read.coarse,
            read.pieces,
            read.gathered,
            read.state,
        )


@dataclass(frozen=True)
class _Template:
    peer_state: DataTransceiverState  # the key holds its id(): the template keeps it alive and checks it
    reads: tuple[_ReadTemplate, ...] | None  # None: requests of this key are planned from scratch
    pool_blocks: tuple[tuple[int, int], ...] = ()  # (ctx CP rank, smallest pool of the ranks read with its ids)


class PlanCache:
    """Plan templates by (ctx instance state, blocks, reused blocks, ctx DP rank, id counts, state slot).

    Requests are planned on their callers' threads: two may build the same template at once (both are right;
    the last is kept); the table itself changes under a lock."""

    def __init__(self, planner: Planner, max_templates: int = MAX_TEMPLATES) -> None:
        self._planner = planner
        self._max = max_templates
        self._templates: OrderedDict[tuple, _Template] = OrderedDict()
        self._lock = threading.Lock()

    def plan(self, request: ReadRequest, num_blocks: int) -> list[PeerRead]:
        if request.layers is not None or request.only_peer is not None:  # layer-wise steps: planned as asked
            return self._planner(request)
        key = plan_key(
            request.peer_state,
            num_blocks,
            -(-request.num_tokens // request.self_layout.tokens_per_block),
            request.layerwise,
            request.first_block,
            request.peer_dp_rank,
            len(request.local_block_ids),
            request.peer_block_ids,
            request.self_rnn_slot is None,
            request.peer_rnn_slot is None,
        )
        found = self.cached(
            key, request.peer_state, request.local_block_ids, request.peer_block_ids, request.self_layout.num_blocks
        )
        if found is not None:
            return found
        template = self._templates.get(key)
        if template is None or template.peer_state is not request.peer_state:
            template = self._build(request)
            with self._lock:
                self._templates[key] = template
                while len(self._templates) > self._max:
                    self._templates.popitem(last=False)
        if template.reads is None:
            return self._planner(request)
        return _instantiate(template, request.local_block_ids, request.peer_block_ids, request.self_layout.num_blocks)

    def cached(
        self,
        key: tuple,
        peer_state: DataTransceiverState,
        local_block_ids: np.ndarray,
        peer_block_ids: tuple[tuple[int, ...], ...],
        self_pool_blocks: int,
    ) -> list[PeerRead] | None:
        """The plan from the template kept for ``key`` (``plan_key``), None where none is kept or its requests are
        planned from scratch. Why: a request that fits a template needs no ``ReadRequest`` at all."""
        template = self._templates.get(key)
        if template is None or template.peer_state is not peer_state or template.reads is None:
            return None
        with self._lock:
            if key in self._templates:
                self._templates.move_to_end(key)  # least recently used goes first
        return _instantiate(template, local_block_ids, peer_block_ids, self_pool_blocks)

    def _build(self, request: ReadRequest) -> _Template:
        """Plan with positions for block ids; a plan that is more than indices of block ids is not a template."""
        positional = dataclasses.replace(
            request,
            peer_block_ids=tuple(tuple(range(len(ids))) for ids in request.peer_block_ids),
            local_block_ids=np.arange(len(request.local_block_ids), dtype=np.int64),
        )
        try:
            plan = self._planner(positional)
        except NixlKvError:
            return _Template(request.peer_state, None)  # the request's own ids decide (and name) the error
        if any(read.state is not None for read in plan):
            return _Template(request.peer_state, None)
        ranks, parallel = request.peer_state.comm.ranks, request.peer_state.cache.parallel
        reads, pool_blocks = [], {}
        for read in plan:
            peer = ranks[read.peer_rank].layout
            entry = _ReadTemplate(read, position(parallel, read.peer_rank).cp_rank)
            if read.expected_readers and read.has_kv:  # its block ids are read: they must lie in that pool
                pool_blocks[entry.cp_rank] = min(peer.num_blocks, pool_blocks.get(entry.cp_rank, peer.num_blocks))
            if read.local_indices is not None and read.remote_indices is not None:
                entry = dataclasses.replace(
                    entry,
                    local=_Indices.of(read.local_indices, request.self_layout, read.coarse),
                    remote=_Indices.of(read.remote_indices, peer, read.coarse),
                )
            reads.append(entry)
        return _Template(request.peer_state, tuple(reads), tuple(pool_blocks.items()))


def plan_key(
    peer_state: DataTransceiverState,
    num_blocks: int,
    self_blocks: int,
    layerwise: bool,
    first_block: int,
    peer_dp_rank: int,
    local_ids: int,
    peer_block_ids: tuple[tuple[int, ...], ...],
    no_self_slot: bool,
    no_peer_slot: bool,
) -> tuple:
    """What a template is kept by: the ctx instance state, the request's blocks on each side (the ctx's may be
    another size), layer-wise (those stage what others read as rows), the reused prefix, the ctx DP rank, how many
    ids each side names, and which sides carry a state slot."""
    return (
        id(peer_state),
        num_blocks,
        self_blocks,
        layerwise,
        first_block,
        peer_dp_rank,
        local_ids,
        tuple(len(ids) for ids in peer_block_ids),
        no_self_slot,
        no_peer_slot,
    )


def _instantiate(
    template: _Template,
    local_block_ids: np.ndarray,
    peer_block_ids: tuple[tuple[int, ...], ...],
    self_pool_blocks: int,
) -> list[PeerRead]:
    """The template with the request's block ids, checked as the formatter checks them."""
    local = np.asarray(local_block_ids)
    check_block_range("gen block id", local, self_pool_blocks)
    for cp_rank, pool_blocks in template.pool_blocks:
        check_block_range("ctx block id", peer_block_ids[cp_rank], pool_blocks)
    local_ids = local.astype(np.int32)
    peer_ids = [np.array(ids, dtype=np.int32) for ids in peer_block_ids]
    return [entry.instantiate(local_ids, peer_ids) for entry in template.reads]
