"""Agreement on transfer outcomes across the ranks of a sync group (the reference's reduceTransferStates).

A request is completed when every rank of the group completed it, and failed when every rank reached a
terminal state and at least one failed or timed out. Timeouts seen by any rank are reported to all.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum

from nixl_kv.comm import CacheTransceiverComm


class Vote(IntEnum):
    COMPLETED = 1
    FAILED = 2
    TIMED_OUT = 3


@dataclass
class Outcome:
    completed: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    timed_out: set[int] = field(default_factory=set)


def reduce_outcomes(
    comm: CacheTransceiverComm, completed: set[int], failed: set[int], timed_out: set[int] = frozenset()
) -> Outcome:
    """One allgather over ``comm``: each rank contributes (request id, vote) pairs. Alone, a rank's own votes
    are the outcome (the same sets the counting below gives, without it)."""
    if comm.size == 1:
        return Outcome((completed - failed) - timed_out, failed | (completed & timed_out), set(timed_out))
    votes = [(rid, Vote.COMPLETED) for rid in completed - failed]
    votes += [(rid, Vote.FAILED) for rid in failed] + [(rid, Vote.TIMED_OUT) for rid in timed_out]
    gathered = [pair for rank_votes in comm.allgather(votes) for pair in rank_votes] if comm.size > 1 else votes
    counts: dict[int, Counter] = {}
    for rid, vote in gathered:
        counts.setdefault(rid, Counter())[Vote(vote)] += 1
    outcome = Outcome()
    for rid, count in counts.items():
        if count[Vote.TIMED_OUT]:
            outcome.timed_out.add(rid)
        terminal = count[Vote.COMPLETED] + count[Vote.FAILED]
        if terminal == comm.size and (count[Vote.FAILED] or count[Vote.TIMED_OUT]):
            outcome.failed.add(rid)
        elif count[Vote.COMPLETED] == comm.size:
            outcome.completed.add(rid)
    return outcome


def reduce_in_stages(
    comms: list[CacheTransceiverComm],
    completed: set[int],
    failed: set[int],
    timed_out: set[int] = frozenset(),
) -> Outcome:
    """Agreement over a product of groups (for example TP, then PP): reduce in one, feed the next."""
    outcome = Outcome(set(completed), set(failed), set(timed_out))
    for comm in comms:
        outcome = reduce_outcomes(comm, outcome.completed, outcome.failed, outcome.timed_out)
    return outcome


def ready_everywhere(comm: CacheTransceiverComm, ready: list[int]) -> set[int]:
    """Request ids every rank of ``comm`` reports ready."""
    if comm.size == 1:
        return set(ready)
    counts = Counter(rid for rank_ready in comm.allgather(ready) for rid in set(rank_ready))
    return {rid for rid, count in counts.items() if count == comm.size}
