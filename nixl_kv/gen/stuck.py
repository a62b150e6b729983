"""READs the gen side gave up on while they were still in progress, and what ends them.

UCX cannot cancel an RMA read in flight (releasing its handle is no cancel), so the destination of a READ abandoned
at its request's deadline stays poisoned (pool blocks pinned, staging slot or landing window held back) until its
status leaves in progress. A READ from a peer that died never left it on its own: UCX held it until TCP gave up,
minutes later (a gen instance lost that capacity for two minutes after a ctx crash, issue 22). Two things end it:

- the transport, where it can tell the peer is gone: with ``agents/ucx_config.py`` UCX fails a READ from a host that
  vanished in 1-2 s, closing its endpoint by force, so nothing lands after;
- closing the peer: one whose abandoned READ is still in progress ``CLOSE_GRACE_S`` after it was abandoned (a READ
  that is only slow ends within that), or whose READ failed (its connection may be broken), is held back from new
  READs and, once no active request is engaged with it (every READ to it is past its deadline or failed), closed
  (``TransferAgent.close_peer``). The UCX agent force-closes its endpoint, ending the READs; NIXL refuses while they
  are in flight (its only close is graceful: a peer that answers later would still write), and is closed once they
  ended. The next request that needs the peer loads it again from its params.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nixl_kv.buffers import CacheTransBufferManager, StagingSlot
from nixl_kv.cache import CacheManager
from nixl_kv.holds import LandingRing
from nixl_kv.interfaces import TransferAgent, TransferStatus
from nixl_kv.peers import PeerDirectory

RequestKey = tuple[str, int]  # (ctx instance id, ctx request id)
STUCK_RETRY_S = 0.1
CLOSE_GRACE_S = 0.25
CLOSE_CHECK_S = 0.05  # how often peers waiting to be closed are looked at (a walk over the active requests)


@dataclass
class StuckRead:
    key: RequestKey
    request_id: int
    handle: Any
    peer: str
    slot: StagingSlot | None
    landing: int | None
    abandoned_at: float
    retry_at: float = 0.0
    closing: bool = False  # its peer is to be closed (once: an agent that cannot end it is not asked again)


class StuckReads:
    """The abandoned READs still in progress; ``poisoned`` says, per request, why its destination is held back.
    Called on the progress loop's thread under the receiver's direct lock (a request failing on the caller's thread
    registers all its READs before any is retired)."""

    def __init__(
        self,
        agent: TransferAgent,
        cache: CacheManager,
        staging: CacheTransBufferManager,
        landing: LandingRing | None,
        peers: PeerDirectory,
        engaged: Callable[[], set[str]],
    ) -> None:
        """``engaged()``: the peers an active request has something in flight with (they are not closed yet)."""
        self._agent, self._cache, self._staging, self._landing = agent, cache, staging, landing
        self._peers, self._engaged = peers, engaged
        self.poisoned: dict[RequestKey, str] = {}
        self._reads: list[StuckRead] = []
        self._to_close: set[str] = set()  # held back, closed once no request is engaged with them
        self._next_close_check = 0.0

    def __bool__(self) -> bool:
        return bool(self._reads)

    def peers(self) -> set[str]:
        """The peers of READs still in progress (any thread: a snapshot)."""
        return {read.peer for read in tuple(self._reads)}

    def due(self, now: float) -> bool:
        """Whether ``retire`` has work now (a READ to retry, a peer to close)."""
        return any(read.retry_at <= now for read in self._reads) or self._closes_due(now)

    def _closes_due(self, now: float) -> bool:
        return now >= self._next_close_check and bool(self._to_close or self._peers.unclosed())

    def add(self, read: StuckRead, reason: str) -> None:
        self.poisoned[read.key] = f"READ from {read.peer} may still be writing ({reason})"
        self._reads.append(read)
        if read.slot is not None:
            self._staging.poison(read.slot, reason)

    def retire(self, now: float) -> None:
        """Release the destinations of READs that ended; close peers whose READs outlived the grace."""
        overdue = set()
        for read in [read for read in self._reads if read.retry_at <= now]:
            if self._agent.status(read.handle) is TransferStatus.IN_PROGRESS or not self._agent.release_transfer(
                read.handle
            ):
                read.retry_at = now + STUCK_RETRY_S
                if not read.closing and now - read.abandoned_at >= CLOSE_GRACE_S:
                    overdue.add(read.peer)
                continue
            self._release(read)
        if overdue:
            for read in self._reads:
                read.closing = read.closing or read.peer in overdue
            self.close_when_free(overdue)
        if self._closes_due(now):
            self._next_close_check = now + CLOSE_CHECK_S
            engaged = self._engaged()
            for name in self._to_close - engaged:
                self._peers.close_peer(name)
            stuck = {read.peer for read in self._reads}  # an agent that refused waits for them to end
            for name in self._peers.unclosed() - engaged - stuck:
                self._peers.close_peer(name)
            self._to_close &= engaged

    def close_when_free(self, names: set[str]) -> None:
        """Hold these peers back from new READs and close them once no active request is engaged with them: peers
        whose READs outlived their requests, or whose connection broke (a READ failed): the next request that needs
        one loads it again."""
        self._peers.hold_back(names)
        self._to_close |= names

    def release_all(self) -> None:
        """Once the agent is closed (its memory deregistered, its endpoints gone), no abandoned READ can land any
        more: the destinations still poisoned come back (pins, staging slots, landing windows)."""
        for read in list(self._reads):
            self._release(read)
        self._to_close.clear()

    def _release(self, read: StuckRead) -> None:
        self._reads.remove(read)
        if read.slot is not None:
            self._staging.clear_poison(read.slot)
        if read.landing is not None and self._landing is not None:
            self._landing.give(read.landing)
        if not any(other.key == read.key and other.request_id == read.request_id for other in self._reads):
            self.poisoned.pop(read.key, None)
            self._cache.unpin(read.request_id)
