"""CacheReceiver: the gen side. Checks the ctx state, plans, pulls from each ctx peer, waits for the verdicts.

A request completes only when every READ finished and every ctx peer confirmed the blocks were still pinned
when the read finished (DESIGN §5.6). It fails when a check refuses the pairing, a READ fails, a peer refuses,
it is cancelled, or the ctx lease it was given runs out (no request outlives it); an in-flight READ is
cancelled then, and if the agent cannot cancel it the destination (pool blocks or staging slot) is reported
poisoned.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nixl_kv import wire
from nixl_kv.buffers import CacheTransBufferManager, StagingSlot
from nixl_kv.cache import CacheManager
from nixl_kv.control import Control
from nixl_kv.direct_pull import DirectPull, Step, direct_eligible
from nixl_kv.errors import (
    AgentError,
    BufferExhaustedError,
    IncompatibleStateError,
    NixlKvError,
    NotSupportedError,
    TransferError,
)
from nixl_kv.holds import (
    BOARD_SLOTS,
    LandingRing,
    board_slots,
    hold_token,
    promise_mask,
    promised_until,
    shows_token,
    unmask_promise,
)
from nixl_kv.interfaces import Formatter, PeerRead, RangeRead, ReadRequest, TransferStatus
from nixl_kv.loop import IDLE_WAIT_S, ProgressLoop
from nixl_kv.memory import on_device
from nixl_kv.metrics import TransferMetrics
from nixl_kv.params_seal import is_sealed
from nixl_kv.peers import BOARD, PEER_SWEEP_S, PeerDirectory, kv_list
from nixl_kv.plan_cache import PlanCache
from nixl_kv.poll_queue import PollQueue
from nixl_kv.pool_checks import kv_pool_problems
from nixl_kv.protocol import LayersReady, LayerWatch, NoReaders, ReadDone, ReadVerdict, StageClaim, StageGrant
from nixl_kv.ranges import coalesce
from nixl_kv.requests import TransferRequest
from nixl_kv.state import ContextPhaseParams, DataTransceiverState, RankCommInfo
from nixl_kv.stuck import RequestKey, StuckRead, StuckReads
from nixl_kv.topology import holds_request, position
from nixl_kv.views import pool_views

log = logging.getLogger(__name__)

CLAIM_RETRY_S = 1e-3
SLOW_CHECK_BYTES = 64 << 20  # READs at least this large are timed against SLOW_GBPS
# below: a fallback path (DRAM, 128 MiB here: TCP 1.6-2.0 GB/s, shared memory 5.3-5.5; VRAM: cuda_ipc ~390)
SLOW_GBPS = {"DRAM": 3.0, "VRAM": 20.0}
MAX_RELEASE_NOTICES = 64  # ctx ranks told at once that a request was refused; the others release at their lease
LONG_RUN_BYTES = 1 << 20  # state READs are timed for the transport check only if their rows average this
DIRECT_BATCH = 64  # direct pulls whose status one progress call checks (oldest first): a tick's cost is bounded
CALLER_HANDOFF_S = 1e-3  # the loop thread progresses direct pulls the caller's thread has not polled for this long
SPIN_GBPS = {"DRAM": 2.0, "VRAM": 100.0}  # a conservative READ rate: how long a caller spins before it sleeps
SPIN_BASE_S = 300e-6  # at least this, and twice the fixed cost direct requests showed lately (EWMA)
MAX_SPIN_S = 5e-3
EARLY_CHECK_SECONDS = 10e-3  # READs expected (at SPIN_GBPS) to take longer check the board after they end
EARLY_CHECK_QUEUE = 8  # nor do READs posted behind this many direct pulls in flight
EXPIRE_BATCH = 16  # direct requests failed at their deadline per progress-loop tick
# A pull whose peer got ready (first contact) this close to its deadline (or within this part of its budget, for short
# ones) fails instead of starting its READ: the READ would outlive its request, its destination poisoned until the
# transport ends it (NIXL: ~1 s, ``ucx_config``).
MIN_READ_BUDGET_S = 0.2
MIN_READ_BUDGET_PART = 0.25
CONNECT_RECHECK_S = 0.05  # a pull waiting for its peer is woken when the peer directory is done; else polled this often


_NOT_ENGAGED = (Step.CONNECT, Step.DONE)


@dataclass
class _Transfer:
    """One READ (direct, or of one staged piece) and the ctx peer's answers about it."""

    transfer_id: int
    handle: Any = None
    grant: StageGrant | None = None
    posted_at: float = 0.0
    posts_before: int = 0  # the receiver's READ count when this one was posted
    nbytes: int = 0  # > 0 when this READ measures the transport: a long run, alone in flight, peer warmed up
    finished: bool = False
    verdict: str | None = None  # None until the ctx peer answers; "" means ok


@dataclass
class _PeerPull:
    """Everything this gen rank takes from one ctx rank, advanced step by step by the progress loop.

    ``plan`` is the step being read: the whole slice, or for layer-wise requests the layers that were ready
    when it was planned (``planned_below`` tracks how far the steps reach, ``ready_below`` what the peer
    announced)."""

    full: PeerRead
    rank: RankCommInfo
    plan: PeerRead | None = None
    next_piece: int = 0
    kv_left: bool = True  # the KV part is still to be read; ``full.state`` is read after it
    current: _Transfer | None = None
    slot: StagingSlot | None = None
    retry_at: float = 0.0
    done: bool = False
    layerwise: bool = False
    watching: bool = False
    started: bool = False  # something was posted to the peer (a READ, a claim, a watch, a notice)
    ready_below: int = 0
    planned_below: int = 0

    def __post_init__(self) -> None:
        self.kv_left = self.full.has_kv
        if self.layerwise:
            self.planned_below = self.full.layers.start
        elif self.kv_left:
            self.plan = self.full

    @property
    def reading_piece(self) -> bool:
        """The step in progress reads a staged piece."""
        return self.kv_left and self.plan is not None and self.plan.staged

    @property
    def final_kv_read(self) -> bool:
        """The KV READ about to be posted is the last READ from this peer (no state follows)."""
        return self.last_step and self.full.state is None

    @property
    def last_step(self) -> bool:
        return not self.layerwise or self.planned_below >= self.full.layers.stop


@dataclass(frozen=True)
class _ReleaseNotice:
    """A ReadDone owed to a peer after a pull its promise covered (sent by the progress loop)."""

    peer: str
    key: RequestKey
    transfer_id: int
    readers: int
    token: int
    secret: bytes


@dataclass
class _Incoming:
    key: RequestKey
    request: TransferRequest
    ctx_state: DataTransceiverState
    num_blocks: int
    deadline: float
    future: Future
    read_request: ReadRequest | None = None
    peers: list[_PeerPull] = field(default_factory=list)
    direct: list[DirectPull] | None = None  # the fast path's pulls (then ``peers`` is empty)
    secret: bytes = b""  # the request's secret from its params: our proof to the ctx, and the ctx's to us
    stuck: bool = False  # a READ could not be cancelled: the blocks stay pinned until the agent lets go


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
        max_peers: int = 256,
        landing: LandingRing | None = None,
        metrics: TransferMetrics | None = None,
    ) -> None:
        self._direct_min_run_bytes = direct_min_run_bytes
        self._metrics = metrics or TransferMetrics(self_state.instance_id)
        self._loop = loop
        self._cache = cache
        self._self_state = self_state
        self._self_rank = self_rank
        self._formatter = formatter
        self._staging = staging
        self._max_peers = max_peers
        self._views = pool_views(cache.layout)
        self._control = Control(loop.agent, self._metrics, "gen")
        self._plans = PlanCache(self._plan_from_scratch)
        self._lock = threading.Lock()
        self._active: dict[RequestKey, _Incoming] = {}
        self._by_request: dict[int, RequestKey] = {}
        self._by_transfer: dict[int, tuple[_Incoming, _PeerPull]] = {}
        self._transfer_ids = itertools.count(1)
        self._states: OrderedDict[bytes, tuple[DataTransceiverState, str]] = OrderedDict()  # state, its problem
        self._peers = PeerDirectory(loop.agent, max_peers, self._busy_agents, on_change=self._peer_changed)
        self._changed_peers: collections.deque[str] = collections.deque()  # from the peer directory's thread
        self._connecting: dict[str, set[tuple[RequestKey, int]]] = {}  # peer -> direct pulls waiting for it
        self._peers_swept_at = 0.0
        self._stuck = StuckReads(loop.agent, cache, staging, landing, self._peers, self._engaged_agents)
        self.poisoned = self._stuck.poisoned
        self.slow_peers: dict[str, float] = {}  # peers whose large READs ran below SLOW_GBPS (warned once)
        self._warmed: set[str] = set()
        self._posts = 0
        self._stepped: dict[RequestKey, _Incoming] = {}  # requests the loop thread advances step by step
        self._direct_lock = threading.RLock()  # the direct pulls: the caller's thread or the loop thread
        self._direct_queue: PollQueue[tuple[RequestKey, int], tuple[_Incoming, DirectPull]] = PollQueue()
        self._direct_by_transfer: dict[int, tuple[_Incoming, DirectPull]] = {}
        self._direct_deadlines: list[tuple[float, RequestKey]] = []
        self._caller_polled_at = 0.0
        self._direct_ended = 0  # direct requests ended, ever (progress reports the difference)
        self._fixed_cost_s = 0.0  # EWMA of what direct requests took beyond their bytes at the spin rate
        self._landing = landing
        self._release_notices: collections.deque[_ReleaseNotice] = collections.deque()
        self._clock_domain = self_state.comm.ranks[self_rank].clock_domain
        layout = cache.layout
        memory = layout.pools[0].memory
        self._spin_gbps = SPIN_GBPS[memory.value]
        self._metadata, fine, coarse, windows = loop.call(
            lambda: (
                loop.agent.metadata(),
                loop.agent.prepare(None, layout.unit_descriptors(), memory),
                loop.agent.prepare(None, layout.unit_descriptors(coarse=True), memory),
                loop.agent.prepare(None, landing.rows, landing.region.memory) if landing is not None else None,
            )
        )
        self._local = {False: fine, True: coarse}  # by granularity
        self._windows = windows
        loop.on_message(ReadVerdict, self._on_verdict)
        loop.on_message(StageGrant, self._on_grant)
        loop.on_message(LayersReady, self._on_layers_ready)
        loop.add_ticker(self._tick)

    def receive_async(self, request: TransferRequest) -> Future:
        """Start pulling the request's KV; the future ends when the transfer is verified or has failed."""
        future: Future = Future()
        request.transfer_start = time.monotonic()
        try:
            incoming = self._prepare(request, future)
        except NixlKvError as exc:
            request.transfer_end = time.monotonic()
            future.set_exception(exc)
            return future
        if incoming.direct is not None:
            self._start_direct(incoming)  # on this thread: no hop into the loop thread before the READ is posted
        else:
            self._loop.wake()
        return future

    def connect_to(self, serialized_ctx_state: bytes) -> None:
        """Load, connect and prepare every rank of a ctx instance now (see ``CacheTransceiver.connect_to``)."""
        ctx_state, problem = self._decode_state(serialized_ctx_state)
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
        with self._lock:
            return len(self._active)

    # --- caller thread: decode, check, plan -------------------------------------------------------------
    def _prepare(self, request: TransferRequest, future: Future) -> _Incoming:
        if request.context_phase_params is None:
            raise TransferError(f"request {request.request_id} carries no ContextPhaseParams")
        if not is_sealed(request.context_phase_params):  # damaged on the way (or not made by a ctx transceiver)
            raise TransferError(f"the ContextPhaseParams of request {request.request_id} fail their checksum")
        params = wire.decode(request.context_phase_params, ContextPhaseParams)
        if not params.secret:  # (nothing can tell its ctx side: a message without the secret is dropped there)
            raise TransferError(f"the params of request {request.request_id} carry no request secret")
        ctx_state, problem = self._decode_state(params.ctx_state)
        key = (ctx_state.instance_id, params.request_id)
        with self._lock:
            if key in self._active or request.request_id in self._by_request:  # a retry must not end the original
                raise TransferError(f"request {request.request_id} (ctx request {key}) is already being received")
        try:
            if problem:
                raise IncompatibleStateError(problem)
            read_request, plan = self._plan(request, params, ctx_state)
        except NixlKvError as exc:
            self._release_ctx_side(params, ctx_state, str(exc))
            raise
        request.first_gen_tokens, request.draft_tokens = params.first_gen_tokens, params.draft_tokens
        request.num_tokens = params.num_tokens
        request.transfer_bytes = sum(read.total_bytes for read in plan)
        budget_ms = params.lease_ms  # the ctx side releases the blocks then: reading later cannot succeed
        num_blocks = -(-params.num_tokens // ctx_state.cache.model.tokens_per_block)
        deadline = request.transfer_start + budget_ms / 1000
        request.transfer_deadline = deadline
        incoming = _Incoming(key, request, ctx_state, num_blocks, deadline, future, read_request, secret=params.secret)
        layerwise = params.layerwise
        ranks = ctx_state.comm.ranks
        if ctx_state.hold_key and self._landing is not None and direct_eligible(plan, ranks, layerwise):
            incoming.direct = [self._direct_pull(read, params, ctx_state) for read in plan]
        else:
            incoming.peers = [
                _PeerPull(
                    self._folded(read, ranks[read.peer_rank]) if not layerwise else read,
                    ranks[read.peer_rank],
                    layerwise=layerwise and read.has_kv,
                )
                for read in plan
            ]
        with self._lock:
            if key in self._active or request.request_id in self._by_request:
                raise TransferError(f"request {request.request_id} (ctx request {key}) is already being received")
            self._cache.pin(request.request_id)  # the destination blocks stay ours until the READs are over
            self._active[key] = incoming
            self._by_request[request.request_id] = key
            if incoming.direct is None:
                self._stepped[key] = incoming
        return incoming

    def _local_blocks(self, request_id: int) -> np.ndarray:
        try:
            return np.asarray(self._cache.block_ids(request_id))
        except KeyError as exc:
            raise TransferError(f"the gen cache holds no blocks for request {request_id}: {exc}") from None

    def _local_slot(self, request_id: int) -> int | None:
        """The request's Mamba state slot, for caches that keep RNN state (``rnn_layout`` not None)."""
        if getattr(self._cache, "rnn_layout", None) is None:
            return None
        try:
            return self._cache.rnn_slot(request_id)
        except KeyError as exc:
            raise TransferError(f"the gen cache holds no RNN state slot for request {request_id}: {exc}") from None

    def _release_ctx_side(self, params: ContextPhaseParams, ctx_state: DataTransceiverState, reason: str) -> None:
        """A request this rank cannot read fails as a whole: tell the ctx ranks holding it, so they release its
        blocks now rather than at the end of their lease (in the background: first contact takes a while)."""
        ctx = ctx_state.cache.parallel
        holders = [
            ctx_state.comm.ranks[rank] for rank in range(ctx.world_size) if holds_request(ctx, rank, params.ctx_dp_rank)
        ]
        message = self._control.encode(
            ReadDone(
                ctx_instance_id=ctx_state.instance_id,
                request_id=params.request_id,
                transfer_id=0,
                reader_metadata=self._metadata,
                expected_readers=1,
                final=True,
                failed=True,
                reason=f"a gen rank cannot read the request: {reason}"[:512],
            ),
            params.secret,
        )

        for rank in holders[:MAX_RELEASE_NOTICES]:  # (best effort: the ctx lease still ends the request)
            self._peers.when_loaded(rank, lambda name=rank.agent_name: self._loop.agent.notify(name, message))

    def _plan(
        self, request: TransferRequest, params: ContextPhaseParams, ctx_state: DataTransceiverState
    ) -> tuple[ReadRequest, list[PeerRead]]:
        """Check the pairing and plan this rank's reads of the request (no byte moves yet)."""
        if params.layerwise and ctx_state.cache.rnn is not None:
            raise NotSupportedError(
                "layer-wise transfer of RNN state is not supported (the state is final only at the end)"
            )
        if params.ctx_dp_rank >= ctx_state.cache.parallel.dp_size:
            raise TransferError(f"ctx DP rank {params.ctx_dp_rank} is outside the ctx dp_size")
        read_request = ReadRequest(
            self_state=self._self_state,
            self_rank=self._self_rank,
            self_layout=self._cache.layout,
            peer_state=ctx_state,
            peer_block_ids=params.block_ids,
            local_block_ids=self._local_blocks(request.request_id),
            num_tokens=params.num_tokens,
            peer_dp_rank=params.ctx_dp_rank,
            first_block=request.reused_blocks,
            stage_bytes=self._stage_bytes(ctx_state),
            direct_min_run_bytes=self._direct_min_run_bytes,
            layerwise=params.layerwise,
            self_indexer=getattr(self._cache, "indexer_layout", None),
            self_rnn=getattr(self._cache, "rnn_layout", None),
            self_rnn_slot=self._local_slot(request.request_id),
            peer_rnn_slot=params.rnn_slot,
        )
        num_blocks = -(-params.num_tokens // ctx_state.cache.model.tokens_per_block)
        return read_request, self._plans.plan(read_request, num_blocks)

    def _plan_from_scratch(self, read_request: ReadRequest) -> list[PeerRead]:
        """What the plan cache calls for a new kind of request (its template is kept for the next ones)."""
        self._formatter.inquire_support(self._self_state.cache, read_request.peer_state.cache)
        return self._formatter.plan(read_request)

    def _folded(self, read: PeerRead, rank: RankCommInfo) -> PeerRead:
        """A direct KV part and the state after it, read together: each READ costs a confirmation round trip."""
        if read.state is None or read.local_indices is None:
            return read
        local, remote = self._cache.layout, rank.layout
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

    # --- the direct path: caller's thread posts, whoever polls first finishes ------------------------------
    def _direct_pull(self, read: PeerRead, params: ContextPhaseParams, ctx_state: DataTransceiverState) -> DirectPull:
        rank = ctx_state.comm.ranks[read.peer_rank]
        cp_rank = position(ctx_state.cache.parallel, read.peer_rank).cp_rank
        blocks = params.block_ids[min(cp_rank, len(params.block_ids) - 1)]
        token = hold_token(ctx_state.hold_key, params.request_id, params.num_tokens, blocks, params.rnn_slot)
        folded = self._folded(read, rank)
        pull = DirectPull(folded, rank, token, next(self._transfer_ids), peer_blocks=blocks)
        if read.peer_rank == params.ctx_rank and self._on_our_clock(rank):  # its promise, if any, is in the params
            pull.made_params = True
            mask = promise_mask(ctx_state.hold_key, token)
            pull.promised_until_ns = unmask_promise(params.masked_promise, mask, time.monotonic_ns())
        return pull

    def _start_direct(self, incoming: _Incoming) -> None:
        with self._direct_lock:
            if incoming.future.done():  # cancelled or closed between _prepare and here: nothing may be posted
                return
            try:
                for pull in incoming.direct:
                    self._post_when_ready(incoming, pull)
            except Exception as exc:  # noqa: BLE001 - any failure must end the request, here or in the loop
                self._fail_direct(incoming, f"{type(exc).__name__}: {exc}")
                return
            if all(pull.step is Step.DONE for pull in incoming.direct):
                self._end(incoming, None)
                return
            heapq.heappush(self._direct_deadlines, (incoming.deadline, incoming.key))

    def _post_when_ready(self, incoming: _Incoming, pull: DirectPull) -> None:
        """Post now if the peer is ready (loaded, its lists prepared); else wait for it (CONNECT) while the peer
        directory loads it off this thread: a peer that is slow to load must not hold up requests to live peers."""
        if self._peers.ready(pull.rank, self._direct_lists(pull.read)):
            self._post_direct(incoming, pull)
            return
        pull.step, pull.waiting_since = Step.CONNECT, time.monotonic()
        unit = (incoming.key, pull.read.peer_rank)
        self._connecting.setdefault(pull.rank.agent_name, set()).add(unit)
        self._direct_queue.put(unit, (incoming, pull), pull.waiting_since, due=pull.waiting_since + CONNECT_RECHECK_S)

    def _peer_changed(self, name: str) -> None:
        """The peer directory's thread: a peer got ready, failed to load, or was closed."""
        self._changed_peers.append(name)
        self._loop.wake()

    def _hurry_connecting(self, now: float) -> None:
        """Under the direct lock: the pulls waiting for peers that changed are due now."""
        while self._changed_peers:
            for unit in self._connecting.get(self._changed_peers.popleft(), ()):
                self._direct_queue.hurry(unit, now)

    def _stop_connecting(self, unit: tuple[RequestKey, int], pull: DirectPull) -> None:
        waiting = self._connecting.get(pull.rank.agent_name)
        if waiting is not None:
            waiting.discard(unit)
            if not waiting:
                del self._connecting[pull.rank.agent_name]

    @staticmethod
    def _direct_lists(read: PeerRead) -> tuple[bytes, ...]:
        """The peer's lists a direct pull uses: its KV list (a READ of pool units or segments), its board (the hold
        check after any READ); a pull that only tells the peer it has no reader needs none."""
        if not read.expected_readers:
            return ()
        return (kv_list(read.coarse), BOARD) if read.local_indices is not None else (BOARD,)

    def _post_direct(self, incoming: _Incoming, pull: DirectPull) -> None:
        """Step 1: the READ, or for a ctx rank no gen rank needs, the NoReaders notice."""
        if pull.read.expected_readers == 0:
            self._peers.connect(pull.rank)
            self._control.send(pull.rank.agent_name, NoReaders(*incoming.key, self._metadata), incoming.secret)
            pull.step = Step.DONE
            return
        read, agent = pull.read, self._loop.agent
        if read.gathered:
            self._post_piece(incoming, pull)
            return
        if read.local_indices is not None:
            remote = self._peers.descriptors(pull.rank, read.coarse)
            local, indices = self._local[read.coarse], (read.local_indices, read.remote_indices)
            pull.handle = self._to_peer(pull.rank, agent.read, local, indices[0], remote, indices[1], b"")
        else:
            self._peers.connect(pull.rank)
            pull.handle = self._to_peer(
                pull.rank,
                agent.read_ranges,
                pull.rank.agent_name,
                read.state.local_rows,
                self._cache.layout.pools[0].memory,
                read.state.remote_rows,
                pull.rank.layout.pools[0].memory,
                b"",
            )
        self._post_early_check(pull)
        long_runs = read.coarse or (
            read.state is not None and read.state.nbytes >= LONG_RUN_BYTES * len(read.state.local_rows)
        )
        pull.timed_bytes = self._measurable(pull.rank.agent_name, pull.nbytes, long_runs and len(incoming.direct) == 1)
        pull.posted_at, pull.posts_before = time.monotonic(), self._posts
        self._queue_direct(incoming, pull, pull.nbytes)

    def _queue_direct(self, incoming: _Incoming, pull: DirectPull, nbytes: int = 0) -> None:
        """Poll the pull's step from now on, expected to move ``nbytes`` at the spin rate."""
        expected_s = nbytes / (self._spin_gbps * 1e9)
        self._direct_queue.put((incoming.key, pull.read.peer_rank), (incoming, pull), time.monotonic(), expected_s)

    def progress(self, from_caller: bool = True) -> int:
        """Advance the direct pulls due (at most DIRECT_BATCH status checks, soonest due first: ``PollQueue``);
        returns how many requests ended.

        Status checks call it, so a request completes on the caller's thread. The caller announces itself
        before it takes the lock, so the loop thread stops polling, and waits for the lock rather than spinning
        in Python while the loop thread holds it (which would keep that thread from the GIL for a switch
        interval). The loop thread polls only pulls no caller polls (``_tick``) and never waits."""
        if from_caller:
            self._caller_polled_at = time.monotonic()
            if not self._direct_lock.acquire(timeout=MAX_SPIN_S):
                return 0
        elif not self._direct_lock.acquire(blocking=False):
            return 0
        ended = self._direct_ended
        try:
            now = time.monotonic()
            self._hurry_connecting(now)
            self._direct_queue.visit(now, DIRECT_BATCH, self._visit_direct, time.monotonic)
            return self._direct_ended - ended
        finally:
            self._direct_lock.release()

    def _visit_direct(self, unit: tuple[RequestKey, int], item: tuple[_Incoming, DirectPull]) -> None:
        incoming, pull = item
        if incoming.future.done():
            self._direct_queue.pop(unit)
            return
        try:
            self._advance_direct(unit, incoming, pull)
        except NixlKvError as exc:
            self._fail_direct(incoming, str(exc))
        except Exception as exc:  # a bug or an out-of-memory must end the request, never leave it half done
            log.exception("request %s failed unexpectedly", incoming.key)
            self._fail_direct(incoming, f"{type(exc).__name__}: {exc}")

    def spin_budget_s(self) -> float:
        """How long a waiting caller should poll before it sleeps: about the time the pending READs take (their
        bytes at a conservative rate, plus twice the fixed cost recent direct requests showed)."""
        if not self._direct_queue:
            return 0.0
        if not self._direct_lock.acquire(blocking=False):  # the queue is being advanced: never walk it meanwhile
            return SPIN_BASE_S
        try:
            pending = sum(pull.nbytes for _, pull in itertools.islice(self._direct_queue.values(), DIRECT_BATCH))
        finally:
            self._direct_lock.release()
        fixed = max(SPIN_BASE_S, 2 * self._fixed_cost_s)
        return min(MAX_SPIN_S, fixed + pending / (self._spin_gbps * 1e9))

    def hand_off(self) -> None:
        """The caller stops polling (it sleeps on the futures): the loop thread takes the direct pulls over now."""
        if self._direct_queue:
            self._caller_polled_at = 0.0
            self._loop.wake()

    def _post_piece(self, incoming: _Incoming, pull: DirectPull) -> None:
        """A gathered READ: the ctx segments of the next piece into our staging slot (one run per consecutive
        ctx blocks); without a free slot, wait for one (SLOT)."""
        self._queue_direct(incoming, pull)
        if pull.slot is None:
            try:  # no lease: the slot comes back (or stays poisoned with its READ) when the request ends
                pull.slot = self._staging.acquire((incoming.key, pull.read.peer_rank), float("inf"), 1)
            except BufferExhaustedError:
                pull.step = Step.SLOT
                return
        box = pull.read.pieces[pull.piece]
        ctx = incoming.ctx_state
        theirs = self._formatter.localize(
            ctx.cache, pull.read.peer_rank, box, incoming.num_blocks, np.asarray(pull.peer_blocks)
        )
        layout, slot = pull.rank.layout, pull.slot.region
        segment = layout.segment_bytes
        nbytes = segment * len(theirs.block_ids)
        if nbytes > slot.nbytes:
            raise TransferError(f"a gathered piece of {nbytes} bytes does not fit a {slot.nbytes}-byte slot")
        remote_at = layout.pools[0].address + theirs.block_ids * segment
        local_at = slot.address + np.arange(len(theirs.block_ids), dtype=np.int64) * segment
        local_rows, remote_rows = coalesce(local_at, remote_at, np.full(len(local_at), segment), [slot], layout.pools)
        self._peers.connect(pull.rank)
        pull.handle = self._to_peer(
            pull.rank,
            self._loop.agent.read_ranges,
            pull.rank.agent_name,
            local_rows,
            slot.memory,
            remote_rows,
            layout.pools[0].memory,
            b"",
        )
        pull.step = Step.READ
        self._queue_direct(incoming, pull, nbytes)
        pull.posted_at, pull.posts_before = time.monotonic(), self._posts

    def _unpack_piece(self, incoming: _Incoming, pull: DirectPull) -> None:
        """The piece's whole ctx segments ``[block, layer, kv, head, token, dim]`` into our pools (one kernel on a
        GPU), done before the slot is reused."""
        box, layout = pull.read.pieces[pull.piece], pull.rank.layout
        blocks = self._local_blocks(incoming.request.request_id)
        local = self._formatter.localize(self._self_state.cache, self._self_rank, box, incoming.num_blocks, blocks)
        data = pull.slot.array[: layout.segment_bytes * len(box.blocks)]
        with on_device(pull.slot.region):  # this thread's GPU is the slot's
            self._formatter.unpack(self._cache.layout, self._views, local, data, segments=True)

    def _post_early_check(self, pull: DirectPull) -> None:
        """READ the hold's board window now, beside the KV READ, from a peer on our clock (see direct_pull), for
        READs short enough to end within a promise (a longer one gains little and would outlive it)."""
        if pull.made_params or not self._on_our_clock(pull.rank):
            return  # the params told its promise (the board would say no more), or a clock we cannot compare
        if pull.nbytes > EARLY_CHECK_SECONDS * self._spin_gbps * 1e9 or len(self._direct_queue) >= EARLY_CHECK_QUEUE:
            return  # a long READ, or one queued behind a burst: it would be seen done too late to gain
        pull.landing = self._landing.take()
        if pull.landing is not None:  # else every window is in use: the check after the READ will do
            pull.early = self._read_board(pull, b"")

    def _on_our_clock(self, rank: RankCommInfo) -> bool:
        return bool(self._clock_domain) and rank.clock_domain == self._clock_domain

    def _advance_direct(self, unit: tuple[RequestKey, int], incoming: _Incoming, pull: DirectPull) -> None:
        if pull.step is Step.CONNECT:
            self._connect_direct(unit, incoming, pull)
            return
        if pull.step is Step.SLOT:
            self._direct_queue.pop(unit)
            self._post_piece(incoming, pull)
            return
        agent = self._loop.agent
        if pull.handle is not None:
            status = agent.status(pull.handle)
            if status is TransferStatus.IN_PROGRESS:
                return
            if status is TransferStatus.FAILED:
                self._stuck.close_when_free({pull.rank.agent_name})  # (its connection may be broken)
                raise TransferError(f"{pull.step.value.split()[0]} from {pull.rank.agent_name} failed")
            agent.release_transfer(pull.handle)
            pull.handle = None
            self._peers.proven(pull.rank.agent_name)
            pull.read_seen_ns = time.monotonic_ns()
            pull.promised = pull.read_seen_ns < pull.promised_until_ns
        if pull.early is not None and not self._early_check_ended(incoming, pull):
            return
        self._direct_queue.pop(unit)
        if pull.step is Step.READ and pull.read.gathered:
            self._unpack_piece(incoming, pull)
            pull.piece += 1
            if pull.piece < len(pull.read.pieces):
                self._post_piece(incoming, pull)
                return
            self._staging.release(pull.slot)
            pull.slot = None
        if pull.step is Step.READ:
            self._transport_check(
                pull.rank.agent_name, pull.timed_bytes, pull.posted_at, pull.posts_before, time.monotonic()
            )
            if pull.promised:
                self._release_hold(incoming, pull)  # queued first: it goes out even if ending the request fails
                self._direct_done(incoming, pull)
            else:
                self._post_check(incoming, pull)
            return
        held = shows_token(self._landing.window(pull.landing), pull.token)  # Step.CHECK finished
        self._landing.give(pull.landing)
        pull.landing = None
        if held:
            self._direct_done(incoming, pull)
        else:
            self._await_verdict(incoming, pull)

    def _connect_direct(self, unit: tuple[RequestKey, int], incoming: _Incoming, pull: DirectPull) -> None:
        """Step 0: the peer directory loaded the peer (post now), failed to (end the request), or is still at it."""
        if reason := self._peers.failure(pull.rank.agent_name, pull.waiting_since):
            raise TransferError(reason)
        if not self._peers.ready(pull.rank, self._direct_lists(pull.read)):
            self._direct_queue.put(unit, (incoming, pull), pull.waiting_since, due=time.monotonic() + CONNECT_RECHECK_S)
            return
        if self._too_late_to_start(incoming, time.monotonic()):
            raise TransferError(f"{pull.rank.agent_name} was loaded too close to the deadline to start a READ")
        self._stop_connecting(unit, pull)
        self._direct_queue.pop(unit)
        pull.step = Step.READ
        self._post_direct(incoming, pull)
        if all(p.step is Step.DONE for p in incoming.direct):  # (it only told the peer it has no reader)
            self._direct_ended += 1
            self._end(incoming, None)

    def _early_check_ended(self, incoming: _Incoming, pull: DirectPull) -> bool:
        """Once the board READ beside the KV READ is over: was the hold there, promised past the KV READ?"""
        agent = self._loop.agent
        status = agent.status(pull.early)
        if status is TransferStatus.IN_PROGRESS:
            return False
        agent.release_transfer(pull.early)
        pull.early = None
        if status is TransferStatus.DONE:
            mask = promise_mask(incoming.ctx_state.hold_key, pull.token)
            until = promised_until(self._landing.window(pull.landing), pull.token, mask, time.monotonic_ns())
            pull.promised = bool(until) and pull.read_seen_ns < until
        self._landing.give(pull.landing)
        pull.landing = None
        return True

    def _release_hold(self, incoming: _Incoming, pull: DirectPull) -> None:
        """After a pull the promise covered: the ReadDone that releases the blocks. Nothing waits on it (the
        promise holds the blocks meanwhile), so the loop thread sends it at its next tick, within its idle wait
        (2 ms): woken for it, it would take the GIL from the caller just as the caller returns."""
        self._release_notices.append(
            _ReleaseNotice(
                pull.rank.agent_name,
                incoming.key,
                pull.transfer_id,
                pull.read.expected_readers,
                pull.token,
                incoming.secret,
            )
        )

    def _post_check(self, incoming: _Incoming, pull: DirectPull) -> None:
        """Step 2: READ the peer's hold board, the ReadDone riding on it; no free window: ask for a verdict.
        A verdict may overtake the check's completion: from here on it is kept until the check has finished."""
        self._direct_by_transfer[pull.transfer_id] = (incoming, pull)
        pull.landing = self._landing.take()
        checks_hold = pull.landing is not None
        notification = self._read_done_message(
            incoming.key, incoming.secret, pull.transfer_id, pull.read.expected_readers, True, checks_hold, pull.token
        )
        if not checks_hold:
            self._loop.agent.notify(pull.rank.agent_name, notification)
            self._await_verdict(incoming, pull)
            return
        pull.handle = self._read_board(pull, notification)
        pull.step = Step.CHECK
        self._queue_direct(incoming, pull)

    def _read_board(self, pull: DirectPull, notification: bytes) -> Any:
        """READ the hold's board window of the peer into the pull's landing window."""
        landing = np.array([pull.landing], dtype=np.int32)
        board = self._peers.board(pull.rank)
        return self._to_peer(
            pull.rank, self._loop.agent.read, self._windows, landing, board, pull.board_index, notification
        )

    def _await_verdict(self, incoming: _Incoming, pull: DirectPull) -> None:
        """Step 3 (rare): the hold was not on the board; the peer answers the ReadDone with a verdict."""
        pull.step = Step.VERDICT
        if pull.verdict is not None:
            self._take_verdict(incoming, pull)

    def _take_verdict(self, incoming: _Incoming, pull: DirectPull) -> None:
        self._direct_by_transfer.pop(pull.transfer_id, None)
        if pull.verdict:
            self._fail_direct(incoming, f"ctx side refused: {pull.rank.agent_name}: {pull.verdict}")
        else:
            self._direct_done(incoming, pull)

    def _direct_done(self, incoming: _Incoming, pull: DirectPull) -> None:
        pull.step = Step.DONE
        self._direct_by_transfer.pop(pull.transfer_id, None)
        if all(p.step is Step.DONE for p in incoming.direct):
            request = incoming.request
            elapsed = time.monotonic() - request.transfer_start
            fixed = max(0.0, elapsed - request.transfer_bytes / (self._spin_gbps * 1e9))
            self._fixed_cost_s += 0.1 * (min(fixed, MAX_SPIN_S) - self._fixed_cost_s)
            self._direct_ended += 1
            self._end(incoming, None)

    def _direct_verdict(self, sender: str, verdict: ReadVerdict) -> bool:
        """A verdict for a direct pull; False when it is not one."""
        with self._direct_lock:
            found = self._direct_by_transfer.get(verdict.transfer_id)
            if found is None:
                return False
            incoming, pull = found
            if sender != pull.rank.agent_name or verdict.request_id != incoming.key[1]:
                log.warning("ignored a verdict from %s for transfer %d it does not own", sender, verdict.transfer_id)
                return True
            if self._forged(incoming, verdict, sender):
                return True
            pull.verdict = "" if verdict.ok else (verdict.reason or "refused by the ctx side")
            if pull.step is Step.VERDICT and not incoming.future.done():
                self._take_verdict(incoming, pull)
            return True

    def _expire_direct(self, now: float) -> bool:
        """Fail the direct requests past their deadline, at most EXPIRE_BATCH per call: the direct lock is let go
        between batches, so that hundreds due at once (a flood to dead peers) do not stall the live requests'
        polling. Returns whether more are due."""
        if not self._direct_deadlines or self._direct_deadlines[0][0] > now:
            return False  # nothing due: no lock taken (a spinning caller holds it often)
        with self._direct_lock:
            for _ in range(EXPIRE_BATCH):
                if not self._direct_deadlines or self._direct_deadlines[0][0] > now:
                    return False
                _, key = heapq.heappop(self._direct_deadlines)
                with self._lock:
                    incoming = self._active.get(key)
                if incoming is not None and incoming.direct is not None and not incoming.future.done():
                    waiting = [
                        f"{p.rank.agent_name} ({p.step.value})" for p in incoming.direct if p.step is not Step.DONE
                    ]
                    self._fail_direct(incoming, f"deadline passed waiting for {', '.join(waiting)}")
            return bool(self._direct_deadlines) and self._direct_deadlines[0][0] <= now

    def _fail_direct(self, incoming: _Incoming, reason: str) -> None:
        """End a direct request in error: what may still land stays poisoned; ctx peers are told not to wait."""
        with self._direct_lock:
            if incoming.future.done():
                return
            for pull in incoming.direct:
                self._direct_queue.pop((incoming.key, pull.read.peer_rank))
                if pull.step is Step.CONNECT:
                    self._stop_connecting((incoming.key, pull.read.peer_rank), pull)
                self._direct_by_transfer.pop(pull.transfer_id, None)
                peer = pull.rank.agent_name
                landing, pull.landing = pull.landing, None  # it belongs to the early check, or else the CHECK
                if pull.early is not None:
                    self._abandon(incoming, pull.early, None, landing, reason, peer)
                    landing, pull.early = None, None
                if pull.handle is not None:
                    self._abandon(incoming, pull.handle, pull.slot, landing, reason, peer)
                    pull.handle, pull.slot = None, None
                elif landing is not None:
                    self._landing.give(landing)
                if pull.slot is not None:
                    self._staging.release(pull.slot)
                    pull.slot = None
                if pull.step is not Step.DONE and pull.read.expected_readers:
                    self._tell_ctx_failed(incoming, pull.rank, pull.transfer_id, pull.read.expected_readers, reason)
            self._end(incoming, reason)

    def _abandon(
        self, incoming: _Incoming, handle: Any, slot: StagingSlot | None, landing: int | None, reason: str, peer: str
    ) -> None:
        """Let go of a READ that will not be waited for. UCX cannot cancel an RMA read in flight (releasing its
        handle is no cancel), so while the READ is still in progress its destination stays poisoned: the pool
        blocks pinned, the staging slot or landing window held back, until its status leaves in progress
        (``StuckReads``, which closes the peer of a READ that never leaves it)."""
        agent = self._loop.agent
        if agent.status(handle) is not TransferStatus.IN_PROGRESS and agent.release_transfer(handle):
            if slot is not None:
                self._staging.release(slot)
            if landing is not None:
                self._landing.give(landing)
            return
        now = time.monotonic()
        self._stuck.add(StuckRead(incoming.key, incoming.request.request_id, handle, peer, slot, landing, now), reason)
        incoming.stuck = True

    def _stage_bytes(self, ctx_state: DataTransceiverState) -> int:
        ctx_slots = [rank.slot_bytes for rank in ctx_state.comm.ranks if rank.staging is not None]
        return min([self._staging.slot_bytes, *ctx_slots]) if ctx_slots else 0

    def _decode_state(self, data: bytes) -> tuple[DataTransceiverState, str]:
        """A ctx state, decoded and checked once, and what is wrong with it ("" when nothing): a state whose ranks'
        KV pools contradict its cache state is refused before anything is planned from it."""
        with self._lock:
            known = self._states.get(data)
        if known is None:
            state = wire.decode(data, DataTransceiverState)
            problems = [
                f"ctx rank {rank}: {'; '.join(wrong)}"
                for rank, info in enumerate(state.comm.ranks)
                if (wrong := kv_pool_problems(info.layout, state.cache, rank))
            ]
            heading = "ctx KV pools do not match their share of the ctx cache state: "
            known = (state, heading + " | ".join(problems) if problems else "")
            with self._lock:
                self._states[data] = known
                while len(self._states) > self._max_peers:
                    self._states.popitem(last=False)
        return known

    # --- progress loop ----------------------------------------------------------------------------------
    def _tick(self, now: float) -> bool:
        self._send_release_notices()
        neglected = bool(self._direct_queue) and now - self._caller_polled_at > CALLER_HANDOFF_S
        if neglected:  # nobody polls: the loop thread finishes direct pulls (an embedder that checks rarely)
            self.progress(from_caller=False)
            neglected = self._direct_queue.next_due() <= time.monotonic() + IDLE_WAIT_S  # else: sleep till due
        expiring = self._expire_direct(now)
        with self._lock:
            active = list(self._stepped.values())
        for incoming in active:
            try:
                self._advance(incoming, now)
            except NixlKvError as exc:
                self._fail(incoming, str(exc))
            except Exception as exc:  # a bug or an out-of-memory must end the request, never leave it half done
                log.exception("request %s failed unexpectedly", incoming.key)
                self._fail(incoming, f"{type(exc).__name__}: {exc}")
        self._retry_stuck(now)
        if now - self._peers_swept_at >= PEER_SWEEP_S:
            self._peers_swept_at = now
            self._peers.forget_idle(now)
        return bool(active) or neglected or expiring

    def _retry_stuck(self, now: float) -> None:
        """Release the destinations of abandoned READs once their status has left in progress. Under the direct
        lock: a request failing on the caller's thread registers all its stuck READs before any is retired."""
        if not self._stuck.due(now) or not self._direct_lock.acquire(timeout=MAX_SPIN_S):  # (a caller may spin)
            return
        try:
            self._stuck.retire(now)
        finally:
            self._direct_lock.release()

    def release_stuck_at_close(self) -> None:
        """Once the agent is closed, no abandoned READ can land any more (``StuckReads.release_all``)."""
        self._stuck.release_all()

    def _advance(self, incoming: _Incoming, now: float) -> None:
        for peer in incoming.peers:
            if not peer.done:
                self._advance_peer(incoming, peer, now)
                if incoming.future.done():
                    return
        if all(peer.done for peer in incoming.peers):
            self._end(incoming, None)
        elif now > incoming.deadline:
            waiting = [f"{p.rank.agent_name} ({self._peer_step(p)})" for p in incoming.peers if not p.done]
            self._fail(incoming, f"deadline passed waiting for {', '.join(waiting)}")

    @staticmethod
    def _peer_step(peer: _PeerPull) -> str:
        current = peer.current
        if current is None:
            return f"waiting for layers from {peer.planned_below}" if peer.layerwise else "not started"
        if peer.reading_piece and current.grant is None:
            return "waiting for a stage grant"
        return "READ in flight" if not current.finished else "waiting for the ctx confirmation"

    def _advance_peer(self, incoming: _Incoming, peer: _PeerPull, now: float) -> None:
        current = peer.current
        if current is None:
            if not self._stepped_peer_ready(incoming, peer):
                return
            if not peer.started and self._too_late_to_start(incoming, now):
                raise TransferError(f"{peer.rank.agent_name} was loaded too close to the deadline to start a READ")
            if peer.kv_left and peer.plan is None and not self._next_step(incoming, peer):
                return
            if now >= peer.retry_at:
                self._begin(incoming, peer)
            return
        if peer.reading_piece and current.handle is None and not current.finished:
            self._on_granted(incoming, peer, current, now)
            return
        if not current.finished:
            status = self._loop.agent.status(current.handle)
            if status is TransferStatus.FAILED:
                self._stuck.close_when_free({peer.rank.agent_name})  # (its connection may be broken)
                raise TransferError(f"READ from {peer.rank.agent_name} failed")
            if status is TransferStatus.IN_PROGRESS:
                return
            self._loop.agent.release_transfer(current.handle)
            current.handle = None
            self._peers.proven(peer.rank.agent_name)
            self._transport_check(peer.rank.agent_name, current.nbytes, current.posted_at, current.posts_before, now)
            if peer.reading_piece:
                self._unpack(incoming, peer)
            current.finished = True  # only once the bytes are in place
        if current.verdict is None:
            return
        if current.verdict:
            raise TransferError(f"ctx side refused: {peer.rank.agent_name}: {current.verdict}")
        self._by_transfer.pop(current.transfer_id, None)
        peer.current = None
        if not peer.kv_left:  # the state was read: that was the last READ
            peer.done = True
            return
        peer.next_piece += 1
        if not peer.plan.staged or peer.next_piece == len(peer.plan.pieces):
            peer.plan, peer.next_piece = None, 0
            if peer.last_step:
                peer.kv_left = False
                peer.done = peer.full.state is None

    def _stepped_peer_ready(self, incoming: _Incoming, peer: _PeerPull) -> bool:
        """Whether the peer is loaded (its KV list prepared) for the next step; its loading is queued if not, and a
        loading that failed ends the request."""
        if reason := self._peers.failure(peer.rank.agent_name, incoming.request.transfer_start):
            raise TransferError(reason)
        direct_kv = peer.full.local_indices is not None and peer.full.expected_readers
        return self._peers.ready(peer.rank, (kv_list(peer.full.coarse),) if direct_kv else ())

    @staticmethod
    def _too_late_to_start(incoming: _Incoming, now: float) -> bool:
        budget = incoming.deadline - incoming.request.transfer_start
        return now > incoming.deadline - min(MIN_READ_BUDGET_S, MIN_READ_BUDGET_PART * budget)

    def _to_peer(self, rank: RankCommInfo, call: Callable[..., Any], *args: Any) -> Any:
        """An agent call that posts a READ to the peer. If the agent refuses it, the connection may be broken (NIXL
        refuses a peer whose endpoint failed): the peer is closed once no request is engaged with it, and the next
        request that needs it loads it again."""
        try:
            return call(*args)
        except AgentError:
            self._stuck.close_when_free({rank.agent_name})
            raise

    def _measurable(self, agent_name: str, nbytes: int, long_runs: bool) -> int:
        """Bytes to time for the transport check, or 0: only long runs (scattered head slabs are slow on any
        path), only READs alone in flight (concurrent ones share the link), never a peer's first (warm-up)."""
        self._posts += 1
        first = agent_name not in self._warmed
        self._warmed.add(agent_name)
        alone = len(self._active) <= 1  # this request only: its READ is alone unless it reads several peers
        return nbytes if long_runs and alone and not first else 0

    def _transport_check(self, agent_name: str, nbytes: int, posted_at: float, posts_before: int, now: float) -> None:
        """Warn once per peer when large READs crawl: UCX fell back to a host-staged or TCP path."""
        memory = self._cache.layout.pools[0].memory
        seconds = now - posted_at
        shared = self._posts != posts_before  # another READ started meanwhile: not a clean measurement
        if nbytes < SLOW_CHECK_BYTES or seconds <= 0 or shared or agent_name in self.slow_peers:
            return
        gbps = nbytes / seconds / 1e9
        if gbps < SLOW_GBPS[memory.value]:
            self.slow_peers[agent_name] = gbps
            log.warning(
                "READs from %s run at %.2f GB/s (%d MiB in %.1f ms) on %s: UCX is likely staging through host memory "
                "or using TCP; check UCX_TLS (cuda_ipc for NVLink, rc/dc with GPUDirect RDMA across hosts, cma/sm "
                "within a host)",
                agent_name, gbps, nbytes >> 20, seconds * 1e3, memory.value,
            )  # fmt: skip

    def _next_step(self, incoming: _Incoming, peer: _PeerPull) -> bool:
        """Layer-wise: watch the peer, then plan the next group of ready layers; False while none is ready."""
        if not peer.watching:
            peer.started = True
            self._peers.connect(peer.rank)
            self._control.send(peer.rank.agent_name, LayerWatch(*incoming.key, self._metadata), incoming.secret)
            peer.watching = True
            return False
        upper = min(peer.ready_below, peer.full.layers.stop)
        if upper <= peer.planned_below:
            return False
        step = dataclasses.replace(
            incoming.read_request, layers=range(peer.planned_below, upper), only_peer=peer.full.peer_rank
        )
        (peer.plan,) = self._formatter.plan(step)
        peer.planned_below = upper
        return True

    def _begin(self, incoming: _Incoming, peer: _PeerPull) -> None:
        """Post the direct READ, claim the next staged piece, or tell an unneeded ctx rank it has no reader."""
        peer.started = True
        if peer.full.expected_readers == 0:
            self._peers.connect(peer.rank)
            self._control.send(peer.rank.agent_name, NoReaders(*incoming.key, self._metadata), incoming.secret)
            peer.done = True
            return
        transfer = _Transfer(next(self._transfer_ids))
        if not peer.kv_left:
            state = peer.full.state
            self._peers.connect(peer.rank)
            transfer.handle = self._to_peer(
                peer.rank,
                self._loop.agent.read_ranges,
                peer.rank.agent_name,
                state.local_rows,
                self._cache.layout.pools[0].memory,
                state.remote_rows,
                peer.rank.layout.pools[0].memory,
                self._read_done(incoming, peer, transfer, final=True),
            )
            long_runs = state.nbytes >= LONG_RUN_BYTES * len(state.local_rows)
            transfer.nbytes = self._measurable(peer.rank.agent_name, state.nbytes, long_runs)
            transfer.posted_at, transfer.posts_before = time.monotonic(), self._posts
        elif not peer.plan.staged:
            coarse = peer.plan.coarse
            remote = self._peers.descriptors(peer.rank, coarse)
            notification = self._read_done(incoming, peer, transfer, final=peer.final_kv_read)
            transfer.handle = self._to_peer(
                peer.rank,
                self._loop.agent.read,
                self._local[coarse],
                peer.plan.local_indices,
                remote,
                peer.plan.remote_indices,
                notification,
            )
            transfer.nbytes = self._measurable(peer.rank.agent_name, peer.plan.nbytes, coarse)
            transfer.posted_at, transfer.posts_before = time.monotonic(), self._posts
        else:
            if peer.slot is None:
                try:
                    # no lease: the receiver itself returns the slot (or poisons it) when the piece ends
                    peer.slot = self._staging.acquire(incoming.key, float("inf"), 1)
                except BufferExhaustedError:
                    peer.retry_at = time.monotonic() + CLAIM_RETRY_S
                    return
            self._peers.connect(peer.rank)
            box = peer.plan.pieces[peer.next_piece]
            claim = StageClaim(
                ctx_instance_id=incoming.key[0],
                request_id=incoming.key[1],
                transfer_id=transfer.transfer_id,
                reader_metadata=self._metadata,
                num_blocks=incoming.num_blocks,
                layers=(box.layers.start, box.layers.stop),
                heads=(box.heads.start, box.heads.stop),
                blocks=(box.blocks.start, box.blocks.stop),
            )
            self._control.send(peer.rank.agent_name, claim, incoming.secret)
        peer.current = transfer
        self._by_transfer[transfer.transfer_id] = (incoming, peer)

    def _on_granted(self, incoming: _Incoming, peer: _PeerPull, current: _Transfer, now: float) -> None:
        grant = current.grant
        if grant is None:
            return
        if not grant.ok:
            if not grant.retry:
                raise TransferError(f"ctx side refused to stage: {peer.rank.agent_name}: {grant.reason}")
            self._by_transfer.pop(current.transfer_id, None)
            peer.current, peer.retry_at = None, now + CLAIM_RETRY_S
            return
        staging = peer.rank.staging
        if staging is None or not (
            staging.address <= grant.address and grant.address + grant.nbytes <= staging.address + staging.nbytes
        ):
            raise TransferError(f"{peer.rank.agent_name} granted memory outside its staging buffer")
        box_bytes = self._formatter.box_bytes(self._self_state.cache, peer.plan.pieces[peer.next_piece])
        if grant.nbytes != box_bytes or grant.nbytes > peer.slot.region.nbytes:
            raise TransferError(
                f"{peer.rank.agent_name} granted {grant.nbytes} bytes for a {box_bytes}-byte box "
                f"(local slot {peer.slot.region.nbytes} bytes)"
            )
        last = peer.final_kv_read and peer.next_piece == len(peer.plan.pieces) - 1
        notification = self._read_done(incoming, peer, current, final=last)
        slot = peer.slot.region
        current.nbytes = self._measurable(peer.rank.agent_name, grant.nbytes, True)
        current.posted_at, current.posts_before = time.monotonic(), self._posts
        current.handle = self._to_peer(
            peer.rank,
            self._loop.agent.read_ranges,
            peer.rank.agent_name,
            np.array([[slot.address, grant.nbytes, slot.device_id]], dtype=np.uint64),
            slot.memory,
            np.array([[grant.address, grant.nbytes, staging.device_id]], dtype=np.uint64),
            staging.memory,
            notification,
        )

    def _unpack(self, incoming: _Incoming, peer: _PeerPull) -> None:
        box = peer.plan.pieces[peer.next_piece]
        blocks = np.asarray(self._cache.block_ids(incoming.request.request_id))
        local = self._formatter.localize(self._self_state.cache, self._self_rank, box, incoming.num_blocks, blocks)
        self._formatter.unpack(self._cache.layout, self._views, local, peer.slot.array)
        self._staging.release(peer.slot)
        peer.slot = None

    def _read_done(self, incoming: _Incoming, peer: _PeerPull, transfer: _Transfer, final: bool) -> bytes:
        return self._read_done_message(
            incoming.key, incoming.secret, transfer.transfer_id, peer.full.expected_readers, final, False
        )

    def _read_done_message(
        self,
        key: RequestKey,
        secret: bytes,
        transfer_id: int,
        expected_readers: int,
        final: bool,
        checks_hold: bool,
        hold_token: int = 0,
        failure: str = "",
    ) -> bytes:
        """``failure``: the reader gives up (a ``ReadDone(failed)``, so the ctx rank need not wait its lease)."""
        done = ReadDone(
            ctx_instance_id=key[0],
            request_id=key[1],
            transfer_id=transfer_id,
            reader_metadata=self._metadata,
            expected_readers=expected_readers,
            final=final,
            failed=bool(failure),
            reason=failure[:512],
            checks_hold=checks_hold,
            hold_token=hold_token,
        )
        return self._control.encode(done, secret)

    def _busy_agents(self) -> set[str]:
        """The peers an active request reads or will read from, and those of READs still in progress (never
        forgotten meanwhile: forgetting a NIXL peer would make their status lie)."""
        with self._lock:
            active = list(self._active.values())
        names = self._stuck.peers()
        for incoming in active:
            names.update(p.rank.agent_name for p in incoming.peers)
            names.update(p.rank.agent_name for p in incoming.direct or ())
        return names

    def _engaged_agents(self) -> set[str]:
        """The peers an active request has posted to and still has business with (a READ or an answer in flight):
        a peer held back is closed only once it is none of them."""
        with self._lock:
            active = list(self._active.values())
        names = set()
        for incoming in active:
            names.update(p.rank.agent_name for p in incoming.peers if p.started and not p.done)
            names.update(p.rank.agent_name for p in incoming.direct or () if p.step not in _NOT_ENGAGED)
        return names

    def _on_verdict(self, sender: str, verdict: ReadVerdict) -> None:
        if self._direct_verdict(sender, verdict):
            return
        transfer = self._owned_transfer(sender, verdict)
        if transfer is not None:
            transfer.verdict = "" if verdict.ok else (verdict.reason or "refused by the ctx side")

    def _on_grant(self, sender: str, grant: StageGrant) -> None:
        transfer = self._owned_transfer(sender, grant)
        if transfer is not None and transfer.grant is None:  # the first answer to a claim is the answer
            transfer.grant = grant

    def _on_layers_ready(self, sender: str, message: LayersReady) -> None:
        with self._lock:
            incoming = self._active.get((message.ctx_instance_id, message.request_id))
        if incoming is None or self._forged(incoming, message, sender):
            return
        for peer in incoming.peers:
            if peer.rank.agent_name == sender:
                peer.ready_below = max(peer.ready_below, message.ready_below)

    def _owned_transfer(self, sender: str, message: ReadVerdict | StageGrant) -> _Transfer | None:
        transfer_id, request_id = message.transfer_id, message.request_id
        found = self._by_transfer.get(transfer_id)
        if found is None:
            return None  # the request already ended
        incoming, peer = found
        if sender != peer.rank.agent_name or request_id != incoming.key[1] or peer.current is None:
            log.warning("ignored an answer from %s for transfer %d it does not own", sender, transfer_id)
            return None
        if self._forged(incoming, message, sender):
            return None
        return peer.current

    def _forged(self, incoming: _Incoming, message: Any, sender: str) -> bool:
        return self._control.forged(message, incoming.secret, sender)

    def _cancel(self, request_id: int) -> bool:
        with self._lock:
            key = self._by_request.get(request_id)
            incoming = self._active.get(key) if key else None
        if incoming is None:
            return False
        if incoming.direct is not None:
            self._fail_direct(incoming, "cancelled on the gen side")
        else:
            self._fail(incoming, "cancelled on the gen side")
        return True

    def _fail(self, incoming: _Incoming, reason: str) -> None:
        """End a request in error: abandon READs still in flight and tell the ctx peers not to wait."""
        for peer in incoming.peers:
            current = peer.current
            if current is not None and current.handle is not None:
                self._abandon(incoming, current.handle, peer.slot, None, reason, peer.rank.agent_name)
                current.handle, peer.slot = None, None  # the slot was released, or poisoned with the READ
            if peer.slot is not None:
                self._staging.release(peer.slot)
                peer.slot = None
            if not peer.done and peer.full.expected_readers:
                transfer_id = current.transfer_id if current is not None else 0
                self._tell_ctx_failed(incoming, peer.rank, transfer_id, peer.full.expected_readers, reason)
        self._end(incoming, reason)

    def _tell_ctx_failed(
        self, incoming: _Incoming, rank: RankCommInfo, transfer_id: int, expected_readers: int, reason: str
    ) -> None:
        """So the ctx rank releases the request now rather than at the end of its lease; only to a peer loaded now
        (loading one to tell it would cost the thread that fails requests, for a peer that may be dead)."""
        if not self._peers.loaded_now(rank.agent_name):
            return
        message = self._read_done_message(
            incoming.key, incoming.secret, transfer_id, expected_readers, True, False, failure=reason
        )
        try:
            self._loop.agent.notify(rank.agent_name, message)
        except AgentError as exc:
            log.info("could not tell %s that request %s failed: %s", rank.agent_name, incoming.key, exc)

    def _end(self, incoming: _Incoming, failure: str | None) -> None:
        with self._lock:
            self._active.pop(incoming.key, None)
            self._stepped.pop(incoming.key, None)
            self._by_request.pop(incoming.request.request_id, None)
        for peer in incoming.peers:
            if peer.current is not None:
                self._by_transfer.pop(peer.current.transfer_id, None)
        incoming.request.transfer_end = time.monotonic()
        if not incoming.stuck:
            self._cache.unpin(incoming.request.request_id)
        if failure is None:
            incoming.future.set_result(None)
        else:
            incoming.future.set_exception(TransferError(failure))

    def _send_release_notices(self) -> None:
        while self._release_notices:
            notice = self._release_notices.popleft()
            message = self._read_done_message(
                notice.key, notice.secret, notice.transfer_id, notice.readers, True, True, notice.token
            )
            try:
                self._loop.agent.notify(notice.peer, message)
            except AgentError as exc:  # the peer releases at its lease end
                log.info("could not tell %s that request %s was read: %s", notice.peer, notice.key, exc)

    def close(self) -> None:
        """Send the releases owed, fail every request still in flight (the loop is about to stop), then send what
        a caller's thread finished meanwhile."""
        self._send_release_notices()
        with self._lock:
            active = list(self._active.values())
        for incoming in active:
            if incoming.direct is not None:
                self._fail_direct(incoming, "the transceiver was closed")
            else:
                self._fail(incoming, "the transceiver was closed")
        self._send_release_notices()
        self._peers.close()
