"""Finish a request: resolve it, unpin its blocks unless a READ may still land in them, tell the ctx when it failed.

UCX cannot cancel an RMA read in flight (releasing its handle is no cancel), so a READ abandoned while still in
progress keeps its destination poisoned: the pool blocks pinned, the staging slot or landing window held back,
until its status leaves in progress (``StuckReads``, which closes the peer of a READ that never leaves it).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nixl_kv.buffers import StagingSlot
from nixl_kv.errors import AgentError, TransferError
from nixl_kv.gen.pull import IN_TRANSFER, Step
from nixl_kv.gen.side import GenSide, Incoming
from nixl_kv.gen.stuck import StuckRead
from nixl_kv.interfaces import TransferStatus
from nixl_kv.state import RankCommInfo

log = logging.getLogger(__name__)


def end(side: GenSide, incoming: Incoming, failure: str | None) -> None:
    """The request leaves the table and its future resolves; its blocks are unpinned unless a READ is stuck."""
    side.requests.remove(incoming)
    incoming.request.transfer_end = time.monotonic()
    side.peers.ended(pull.rank.agent_name for pull in incoming.pulls)  # (first-contact slots it no longer needs)
    if not incoming.stuck:
        side.cache.unpin(incoming.request.request_id)
    if failure is None:
        incoming.future.set_result(None)
    else:
        incoming.future.set_exception(TransferError(failure))


def fail(side: GenSide, incoming: Incoming, reason: str) -> None:
    """End a request in error, whatever its path: every READ still in flight is abandoned (its destination poisoned
    while it may land), staging slots and landing windows come back, and each ctx peer still counting on a read is
    told not to wait. The caller has already stopped advancing the pulls (under the lock of their path)."""
    for pull in incoming.pulls:
        peer, proof, landing = pull.rank.agent_name, pull.proof, None
        if proof is not None:
            landing, proof.landing = proof.landing, None  # it belongs to the early check, or else the CHECK
            if proof.early is not None:
                abandon(side, incoming, proof.early, None, landing, reason, peer)
                landing, proof.early = None, None
        if pull.handle is not None:
            abandon(side, incoming, pull.handle, pull.slot, landing, reason, peer)
            pull.handle, pull.slot = None, None  # the slot was released, or poisoned with the READ
        elif landing is not None:
            side.landing.give(landing)
        if pull.slot is not None:
            side.staging.release(pull.slot)
            pull.slot = None
        if pull.step is not Step.DONE and pull.read.expected_readers:
            # (a stepped pull between transfers has no transfer the peer knows of; a direct one has one throughout)
            transfer_id = pull.transfer_id if pull.fast or pull.step in IN_TRANSFER else 0
            tell_ctx_failed(side, incoming, pull.rank, transfer_id, pull.read.expected_readers, reason)
    end(side, incoming, reason)


def abandon(
    side: GenSide,
    incoming: Incoming,
    handle: Any,
    slot: StagingSlot | None,
    landing: int | None,
    reason: str,
    peer: str,
) -> None:
    """Let go of a READ that will not be waited for: its destination comes back now if the READ is over, else it
    stays poisoned (see the module's docstring)."""
    agent = side.agent
    if agent.status(handle) is not TransferStatus.IN_PROGRESS and agent.release_transfer(handle):
        if slot is not None:
            side.staging.release(slot)
        if landing is not None:
            side.landing.give(landing)
        return
    now = time.monotonic()
    side.stuck.add(StuckRead(incoming.key, incoming.request.request_id, handle, peer, slot, landing, now), reason)
    incoming.stuck = True


def tell_ctx_failed(
    side: GenSide, incoming: Incoming, rank: RankCommInfo, transfer_id: int, expected_readers: int, reason: str
) -> None:
    """So the ctx rank releases the request now rather than at the end of its lease; only to a peer loaded now
    (loading one to tell it would cost the thread that fails requests, for a peer that may be dead)."""
    if not side.peers.loaded_now(rank.agent_name):
        return
    message = side.read_done(incoming.key, incoming.secret, transfer_id, expected_readers, True, False, failure=reason)
    try:
        side.agent.notify(rank.agent_name, message)
    except AgentError as exc:
        log.info("could not tell %s that request %s failed: %s", rank.agent_name, incoming.key, exc)
