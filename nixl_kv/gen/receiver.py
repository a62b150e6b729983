"""CacheReceiver: the gen side's driver. Admits a request, plans it, pulls it from each ctx peer, proves the pulls,
finishes it (``nixl_kv.gen``, docs/reading_path.md).

A request completes only when every READ finished and every ctx peer's blocks are proven to have been pinned when
the read finished (DESIGN §5.6). It fails when a check refuses the pairing, a READ fails, a peer refuses, it is
cancelled, or the ctx lease it was given runs out (no request outlives it); a READ in flight then is abandoned, and
if the agent cannot end it its destination (pool blocks, staging slot, landing window) is reported poisoned.

This class owns the request table and the deadlines, and says who advances: the caller's thread admits, plans and
posts a direct request and finishes it from its status checks (``progress``); the progress loop advances stepped
requests, direct ones no caller polls, the release notices and the stuck READs.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from nixl_kv.buffers import CacheTransBufferManager
from nixl_kv.cache import CacheManager
from nixl_kv.control import Control
from nixl_kv.errors import IncompatibleStateError, NixlKvError, TransferError
from nixl_kv.gen.admit import Admit
from nixl_kv.gen.direct import MAX_SPIN_S, SPIN_GBPS, DirectPulls
from nixl_kv.gen.plan import Planner
from nixl_kv.gen.prove import Prove
from nixl_kv.gen.reads import Reads
from nixl_kv.gen.side import GenSide, Incoming, Requests
from nixl_kv.gen.stepped import SteppedPulls
from nixl_kv.gen.stuck import StuckReads
from nixl_kv.holds import BOARD_SLOTS, LandingRing, board_slots
from nixl_kv.interfaces import Formatter
from nixl_kv.loop import ProgressLoop, Tick
from nixl_kv.metrics import TransferMetrics
from nixl_kv.peers import BOARD, PEER_SWEEP_S, PeerDirectory, kv_list
from nixl_kv.protocol import LayersReady, ReadVerdict, StageGrant
from nixl_kv.requests import TransferRequest
from nixl_kv.state import DataTransceiverState
from nixl_kv.views import pool_views

log = logging.getLogger(__name__)


class CacheReceiver:
    def __init__(
        self,
        loop: ProgressLoop,
        cache: CacheManager,
        self_state: DataTransceiverState,
        self_rank: int,
        formatter: Formatter,
        staging: CacheTransBufferManager,
        direct_min_run_bytes: int,
        peers: PeerDirectory,
        max_states: int = 256,
        landing: LandingRing | None = None,
        metrics: TransferMetrics | None = None,
    ) -> None:
        self._loop = loop
        self._formatter = formatter
        self._self_state = self_state
        metrics = metrics or TransferMetrics(self_state.instance_id)
        requests = Requests()
        side = GenSide(
            loop,
            cache,
            self_state,
            self_rank,
            formatter,
            staging,
            metrics,
            Control(loop.agent, metrics, "gen"),
            requests,
            landing,
            pool_views(cache.layout),
            clock_domain=self_state.comm.ranks[self_rank].clock_domain,
            spin_gbps=SPIN_GBPS[cache.layout.pools[0].memory.value],
        )
        self._side, self._requests = side, requests
        self._reads = Reads(side)
        self.slow_peers = self._reads.slow_peers
        self._planner = Planner(side, direct_min_run_bytes)
        self._admit = Admit(side, max_states)
        self._prove = Prove(side, self._reads)
        self._direct = DirectPulls(side, self._planner, self._reads, self._prove)
        self._stepped = SteppedPulls(side, self._reads)
        side.peers = self._peers = peers  # (the transceiver's: see ``busy_agents`` and ``peer_changed``)
        side.stuck = self._stuck = StuckReads(loop.agent, cache, staging, landing, self._peers, self._engaged_agents)
        self.poisoned = self._stuck.poisoned
        self._peers_swept_at = 0.0
        layout, memory = cache.layout, cache.layout.pools[0].memory
        side.metadata, fine, coarse, side.windows = loop.call(
            lambda: (
                loop.agent.metadata(),
                loop.agent.prepare(None, layout.unit_descriptors(), memory),
                loop.agent.prepare(None, layout.unit_descriptors(coarse=True), memory),
                loop.agent.prepare(None, landing.rows, landing.region.memory) if landing is not None else None,
            )
        )
        side.local.update({False: fine, True: coarse})  # by granularity
        loop.on_message(ReadVerdict, self._on_verdict)
        loop.on_message(StageGrant, self._stepped.on_grant)
        loop.on_message(LayersReady, self._stepped.on_layers_ready)
        loop.add_ticker(self._tick)

    def receive_async(self, request: TransferRequest) -> Future:
        """Start pulling the request's KV; the future ends when the transfer is verified or has failed."""
        future: Future = Future()
        request.transfer_start = time.monotonic()
        try:
            incoming = self._admit.admit(request, future)  # admit -> plan -> enter (pinned, in the table) -> start
            try:
                self._planner.plan(incoming)
            except NixlKvError as exc:
                self._admit.refuse(incoming, exc)
            self._admit.enter(incoming)
        except Exception as exc:  # noqa: BLE001 - whatever the caller handed in, the request ends (never in flight)
            if not isinstance(exc, NixlKvError):  # a check that let through a value it should have refused: a bug
                log.exception("admitting request %s failed unexpectedly", request.request_id)
                exc = TransferError(f"request {request.request_id} could not be admitted: {type(exc).__name__}: {exc}")
            request.transfer_end = time.monotonic()
            future.set_exception(exc)
            return future
        if incoming.fast:
            self._direct.start(incoming)  # on this thread: no hop into the loop thread before the READ is posted
        else:
            self._loop.wake()
        return future

    def connect_to(self, serialized_ctx_state: bytes) -> None:
        """Load, connect and prepare every rank of a ctx instance now (see ``CacheTransceiver.connect_to``)."""
        ctx_state, problem = self._admit.decode_state(serialized_ctx_state)
        if problem:
            raise IncompatibleStateError(problem)
        self._formatter.inquire_support(self._self_state.cache, ctx_state.cache)
        for rank in ctx_state.comm.ranks:
            boards = (BOARD,) if rank.board is not None and board_slots(rank.board) == BOARD_SLOTS else ()
            self._peers.warm(rank, (kv_list(False), kv_list(True), *boards))  # (the only board size ever read)

    def cancel(self, request_id: int) -> bool:
        """Cancel a transfer that has not ended; False when there is none."""
        return bool(self._loop.call(lambda: self._cancel(request_id)))

    @property
    def pending(self) -> int:
        with self._requests.lock:
            return len(self._requests.active)

    def progress(self, from_caller: bool = True) -> int:
        """Advance the direct pulls due on the calling thread (``DirectPulls.progress``); how many requests ended."""
        return self._direct.progress(from_caller)

    def spin_budget_s(self) -> float:
        return self._direct.spin_budget_s()

    def hand_off(self) -> None:
        self._direct.hand_off()

    def release_stuck_at_close(self) -> None:
        """Once the agent is closed, no abandoned READ can land any more (``StuckReads.release_all``)."""
        self._stuck.release_all()

    # --- progress loop ----------------------------------------------------------------------------------
    def _tick(self, now: float) -> Tick:
        self._prove.send_release_notices()
        direct_due = self._direct.tick(now)
        stepped = self._stepped.tick(now)
        self._retry_stuck(now)
        if now - self._peers_swept_at >= PEER_SWEEP_S:
            self._peers_swept_at = now
            self._peers.forget_idle(now)
        if stepped or direct_due:
            return Tick.BUSY
        return Tick.WAITING if self.pending or self._stuck or self._prove.notices_queued else Tick.IDLE

    def _retry_stuck(self, now: float) -> None:
        """Release the destinations of abandoned READs once their status has left in progress. Under the direct
        lock: a request failing on the caller's thread registers all its stuck READs before any is retired."""
        if not self._stuck.due(now) or not self._direct.lock.acquire(timeout=MAX_SPIN_S):  # (a caller may spin)
            return
        try:
            self._stuck.retire(now)
        finally:
            self._direct.lock.release()

    def _on_verdict(self, sender: str, verdict: ReadVerdict) -> None:
        if not self._direct.on_verdict(sender, verdict):
            self._stepped.on_verdict(sender, verdict)

    def peer_changed(self, name: str) -> None:
        """The peer directory's thread: a peer got ready, failed to load, or was closed."""
        self._direct.peer_changed(name)

    def busy_agents(self) -> set[str]:
        """The peers an active request reads or will read from, and those of READs still in progress (never
        forgotten meanwhile: forgetting a NIXL peer would make their status lie)."""
        names = self._stuck.peers()
        for incoming in self._requests.all():
            names.update(p.rank.agent_name for p in incoming.pulls)
        return names

    def _engaged_agents(self) -> set[str]:
        """The peers an active request has posted to and still has business with (a READ or an answer in flight):
        a peer held back is closed only once it is none of them."""
        names = set()
        for incoming in self._requests.all():
            names.update(p.rank.agent_name for p in incoming.pulls if p.engaged)
        return names

    def _cancel(self, request_id: int) -> bool:
        incoming = self._requests.find(request_id)
        if incoming is None:
            return False
        self._fail(incoming, "cancelled on the gen side")
        return True

    def _fail(self, incoming: Incoming, reason: str) -> None:
        if incoming.fast:
            self._direct.fail(incoming, reason)
        else:
            self._stepped.fail(incoming, reason)

    def close(self) -> None:
        """Send the releases owed, fail every request still in flight (the loop is about to stop), then send what
        a caller's thread finished meanwhile."""
        self._prove.send_release_notices()
        for incoming in self._requests.all():
            self._fail(incoming, "the transceiver was closed")
        self._prove.send_release_notices()
        self._peers.close()
