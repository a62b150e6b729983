"""Plan a request: check the pairing, plan this rank's reads (from a template when one fits: ``PlanCache``), fold
each peer's state into its KV READ, and choose the path: direct (the fast path) or stepped."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from nixl_kv import ipc_path
from nixl_kv.errors import NotSupportedError, TransferError
from nixl_kv.gen.plan_cache import PlanCache, plan_key
from nixl_kv.gen.pull import Proof, Pull, direct_eligible
from nixl_kv.gen.side import GenSide, Incoming
from nixl_kv.holds import hold_token, promise_mask, unmask_promise
from nixl_kv.interfaces import PeerRead, RangeRead, ReadRequest
from nixl_kv.ranges import coalesce
from nixl_kv.requests import TransferRequest
from nixl_kv.runs import MIN_SAVED, coalesced_rows
from nixl_kv.state import ContextPhaseParams, DataTransceiverState, RankCommInfo
from nixl_kv.topology import position


class Planner:
    def __init__(self, side: GenSide, direct_min_run_bytes: int) -> None:
        self._side = side
        self._direct_min_run_bytes = direct_min_run_bytes
        self._plans = PlanCache(self._plan_from_scratch)

    def plan(self, incoming: Incoming) -> None:
        """The admitted request's reads and its per-peer pulls (no byte moves yet); NixlKvError if it cannot be
        read here."""
        request, params, ctx_state = incoming.request, incoming.params, incoming.ctx_state
        self._check_pairing(params, ctx_state)
        local_ids = self.local_blocks(request.request_id)
        self_slot = self._local_slot(request.request_id)
        layout = self._side.cache.layout
        num_blocks = -(-params.num_tokens // ctx_state.cache.model.tokens_per_block)
        key = plan_key(
            ctx_state,
            num_blocks,
            -(-params.num_tokens // layout.tokens_per_block),  # ours: the ctx's may be another size
            params.layerwise,
            request.reused_blocks,
            params.ctx_dp_rank,
            len(local_ids),
            params.block_ids,
            self_slot is None,
            params.rnn_slot is None,
        )
        plan = self._plans.cached(key, ctx_state, local_ids, params.block_ids, layout.num_blocks)
        if plan is None:  # planned from scratch, or from a template made now
            incoming.read_request = self._read_request(request, params, ctx_state, local_ids, self_slot)
            plan = self._plans.plan(incoming.read_request, num_blocks)
        request.transfer_bytes = sum(read.total_bytes for read in plan)
        self._pulls(incoming, plan, params)
        if not incoming.fast and incoming.read_request is None:  # (stepped pulls plan their layer-wise steps from it)
            incoming.read_request = self._read_request(request, params, ctx_state, local_ids, self_slot)

    @staticmethod
    def _check_pairing(params: ContextPhaseParams, ctx_state: DataTransceiverState) -> None:
        if params.layerwise and ctx_state.cache.rnn is not None:
            raise NotSupportedError(
                "layer-wise transfer of RNN state is not supported (the state is final only at the end)"
            )
        if params.ctx_dp_rank >= ctx_state.cache.parallel.dp_size:
            raise TransferError(f"ctx DP rank {params.ctx_dp_rank} is outside the ctx dp_size")

    def _read_request(
        self,
        request: TransferRequest,
        params: ContextPhaseParams,
        ctx_state: DataTransceiverState,
        local_ids: np.ndarray,
        self_slot: int | None,
    ) -> ReadRequest:
        """Everything the formatter plans this rank's reads of the request from."""
        side = self._side
        return ReadRequest(
            self_state=side.self_state,
            self_rank=side.self_rank,
            self_layout=side.cache.layout,
            peer_state=ctx_state,
            peer_block_ids=params.block_ids,
            local_block_ids=local_ids,
            num_tokens=params.num_tokens,
            peer_dp_rank=params.ctx_dp_rank,
            first_block=request.reused_blocks,
            stage_bytes=self._stage_bytes(ctx_state),
            direct_min_run_bytes=ipc_path.min_run_bytes(  # (shorter runs from peers whose rows are gathered)
                side.agent, ctx_state, params.layerwise, self._direct_min_run_bytes
            ),
            layerwise=params.layerwise,
            self_indexer=getattr(side.cache, "indexer_layout", None),
            self_rnn=getattr(side.cache, "rnn_layout", None),
            self_rnn_slot=self_slot,
            peer_rnn_slot=params.rnn_slot,
        )

    def _pulls(self, incoming: Incoming, plan: list[PeerRead], params: ContextPhaseParams) -> None:
        """The request's per-peer pulls: fast ones where every part can be (``direct_eligible``), else stepped."""
        ctx_state, layerwise = incoming.ctx_state, params.layerwise
        ranks = ctx_state.comm.ranks
        if ctx_state.hold_key and self._side.landing is not None and direct_eligible(plan, ranks, layerwise):
            incoming.fast = True
            incoming.pulls = [self._direct_pull(read, params, ctx_state) for read in plan]
        else:
            incoming.pulls = [
                Pull.stepped_pull(
                    self._folded(read, ranks[read.peer_rank]) if not layerwise else read,
                    ranks[read.peer_rank],
                    layerwise=layerwise and read.has_kv,
                )
                for read in plan
            ]
        for pull in incoming.pulls:
            if pull.read.expected_readers:
                ipc = ipc_path.label(self._side.agent, pull.rank, pull.read) if incoming.fast else ""
                self._side.metrics.count_path(ipc + path_of(pull.read, layerwise))

    def local_blocks(self, request_id: int) -> np.ndarray:
        try:
            return np.asarray(self._side.cache.block_ids(request_id))
        except KeyError as exc:
            raise TransferError(f"the gen cache holds no blocks for request {request_id}: {exc}") from None

    def _local_slot(self, request_id: int) -> int | None:
        """The request's Mamba state slot, for caches that keep RNN state (``rnn_layout`` not None)."""
        if getattr(self._side.cache, "rnn_layout", None) is None:
            return None
        try:
            return self._side.cache.rnn_slot(request_id)
        except KeyError as exc:
            raise TransferError(f"the gen cache holds no RNN state slot for request {request_id}: {exc}") from None

    def _plan_from_scratch(self, read_request: ReadRequest) -> list[PeerRead]:
        """What the plan cache calls for a new kind of request (its template is kept for the next ones)."""
        self._side.formatter.inquire_support(self._side.self_state.cache, read_request.peer_state.cache)
        return self._side.formatter.plan(read_request)

    def _folded(self, read: PeerRead, rank: RankCommInfo) -> PeerRead:
        """A direct KV part as explicit rows where that posts fewer descriptors (``nixl_kv.runs``: adjacent blocks
        on both sides merge), and read with the state after it: each READ costs a confirmation round trip."""
        gathers = ipc_path.offer(self._side.agent, rank)  # a same-host peer's rows are gathered (``ipc_path``)
        if read.local_indices is None:
            return read
        local, remote = self._side.cache.layout, rank.layout
        if read.state is None:
            saved = 0 if gathers else MIN_SAVED[local.pools[0].memory.value]  # (a gather takes rows, never indices)
            rows = coalesced_rows(local, read.local_indices, remote, read.remote_indices, read.coarse, saved)
            if rows is None:
                return read  # the prepared lists post it as cheaply
            return dataclasses.replace(
                read, nbytes=0, local_indices=None, remote_indices=None, state=RangeRead("kv", *rows)
            )
        kv = RangeRead(
            "kv",
            *coalesce(
                local.unit_addresses(read.local_indices, read.coarse),
                remote.unit_addresses(read.remote_indices, read.coarse),
                np.full(len(read.local_indices), local.segment_bytes if read.coarse else local.unit_bytes),
                local.pools,
                remote.pools,
            ),
        )
        return dataclasses.replace(
            read, nbytes=0, local_indices=None, remote_indices=None, state=RangeRead.joined([kv, read.state])
        )

    def _direct_pull(self, read: PeerRead, params: ContextPhaseParams, ctx_state: DataTransceiverState) -> Pull:
        rank = ctx_state.comm.ranks[read.peer_rank]
        cp_rank = position(ctx_state.cache.parallel, read.peer_rank).cp_rank
        blocks = params.block_ids[min(cp_rank, len(params.block_ids) - 1)]
        token = hold_token(ctx_state.hold_key, params.request_id, params.num_tokens, blocks, params.rnn_slot)
        folded = self._folded(read, rank)
        transfer_id = next(self._side.transfer_ids)
        proof = Proof(token, peer_blocks=blocks)
        if read.peer_rank == params.ctx_rank and self._side.on_our_clock(rank.clock_domain):  # its promise, if any
            proof.made_params = True
            mask = promise_mask(ctx_state.hold_key, token)
            proof.promised_until_ns = unmask_promise(params.masked_promise, mask, time.monotonic_ns())
        return Pull.fast_pull(folded, rank, transfer_id, proof)

    def _stage_bytes(self, ctx_state: DataTransceiverState) -> int:
        ctx_slots = [rank.slot_bytes for rank in ctx_state.comm.ranks if rank.staging is not None]
        return min([self._side.staging.slot_bytes, *ctx_slots]) if ctx_slots else 0


def path_of(read: PeerRead, layerwise: bool = False) -> str:
    """The way a per-peer read moves its bytes, as ``nixl-kv pair`` reports it: ``prepared`` (one prepared entry per
    block or unit), ``coalesced`` (explicit rows, adjacent blocks merged), ``rows`` (rows with per-request state
    folded in), ``gathered`` (whole ctx segments into our slot, unpacked here), ``staged`` (packed by the ctx)."""
    if read.gathered:
        path = "gathered"
    elif read.staged:
        path = "staged"
    elif read.local_indices is not None:
        path = "prepared"
    elif read.state is not None:
        path = "coalesced" if read.state.what == "kv" else "rows"
    else:
        path = "none"
    return f"layerwise {path}" if layerwise else path
