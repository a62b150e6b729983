"""Respond to a request: pin its blocks, post its hold, and make the params its readers need (DESIGN §5.2)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from nixl_kv.cache import CacheManager
from nixl_kv.ctx.table import Outgoing, RequestTable
from nixl_kv.holds import HoldBoard, hold_token, promise_mask
from nixl_kv.params import ParamsMaker
from nixl_kv.progress import ContextProgress
from nixl_kv.requests import TransferRequest
from nixl_kv.state import CacheState


@dataclass(frozen=True)
class SenderContext:
    """Who the sender is: its instance, its rank, its cache and how long it keeps blocks for readers."""

    instance_id: str
    rank: int
    cache_state: CacheState
    serialized_state: bytes
    lease_ms: int
    auth_key: bytes  # the instance's private key for request secrets (nixl_kv.auth): never leaves the instance
    hold_key: bytes = b""
    board: HoldBoard | None = None
    hold_promise_ms: int = 0

    def params_maker(self) -> ParamsMaker:
        return ParamsMaker(
            self.serialized_state, self.lease_ms, self.cache_state.parallel.dp_rank, self.rank, self.auth_key
        )


def respond(
    context: SenderContext,
    cache: CacheManager,
    table: RequestTable,
    request: TransferRequest,
    block_ids_per_cp: tuple[tuple[int, ...], ...],
    progress: ContextProgress | None,
) -> Future:
    """Pin, register and fill ``request.context_phase_params``; the future ends at release."""
    future: Future = Future()
    state = context.cache_state
    rnn_slot = cache.rnn_slot(request.request_id) if state.rnn is not None else None  # before pinning
    blocks = np.asarray(cache.pin(request.request_id), dtype=np.int64)
    request.transfer_start = time.monotonic()
    request.transfer_bytes = held_bytes(cache, len(blocks))
    num_blocks = -(-request.num_tokens // state.model.tokens_per_block)
    deadline = request.transfer_start + context.lease_ms / 1000
    request.transfer_deadline = deadline
    entry = Outgoing(request, blocks, num_blocks, deadline, future, progress=progress)
    maker = context.params_maker()
    entry.secret = maker.secret(request.request_id)
    with table.lock:  # the hold is posted before any thread can see (and so finish) the entry
        if request.request_id in table.outgoing:
            cache.unpin(request.request_id)
            raise ValueError(f"request {request.request_id} is already being sent")
        _post_hold(context, entry, rnn_slot)
        table.add(entry)
    request.context_phase_params = maker.make(
        request.request_id,
        block_ids_per_cp,
        request.num_tokens,
        request.first_gen_tokens,
        request.draft_tokens,
        layerwise=progress is not None,
        rnn_slot=rnn_slot,
        masked_promise=entry.masked_promise if entry.posted and progress is None else 0,
        prompt_digest=request.prompt_digest,
    )
    return future


def _post_hold(context: SenderContext, entry: Outgoing, rnn_slot: int | None) -> None:
    """Show the hold on the board before the params leave this rank: readers check their READs on it."""
    board = context.board
    if board is None:
        return
    request, key = entry.request, context.hold_key
    entry.token = hold_token(key, request.request_id, request.num_tokens, entry.block_ids, rnn_slot)
    promise_ms = min(context.hold_promise_ms, context.lease_ms)
    entry.promised_until_ns = time.monotonic_ns() + promise_ms * 1_000_000 if promise_ms else 0
    entry.masked_promise = entry.promised_until_ns ^ promise_mask(key, entry.token)
    entry.posted = board.post(entry.token, entry.masked_promise)


def held_bytes(cache: CacheManager, num_blocks: int) -> int:
    """What a request holds on this rank: its KV blocks, their indexer-K part, its Mamba state slot."""
    held = num_blocks * cache.layout.block_bytes
    indexer = getattr(cache, "indexer_layout", None)
    rnn = getattr(cache, "rnn_layout", None)
    if indexer is not None:
        held += num_blocks * indexer.block_bytes
    if rnn is not None:
        held += rnn.num_layers * (rnn.conv_slot_bytes + rnn.ssm_slot_bytes)
    return held
