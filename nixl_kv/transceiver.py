"""CacheTransceiver: the API a serving engine calls on both sides (the reference's CacheTransceiver).

ctx side: ``respond_and_send_async`` then ``check_context_transfer_status``.
gen side: ``request_and_receive_async`` then ``check_gen_transfer_status`` (or ``request_and_receive_sync``).
Status checks report a request only once every rank of its sync group agrees (``consensus``).
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from nixl_kv import wire
from nixl_kv.buffers import CacheTransBufferManager
from nixl_kv.cache import CacheManager
from nixl_kv.comm import CacheTransceiverComm, SingleProcessComm
from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.consensus import ready_everywhere, reduce_in_stages, reduce_outcomes
from nixl_kv.errors import NixlKvError
from nixl_kv.loop import ProgressLoop
from nixl_kv.receiver import CacheReceiver
from nixl_kv.registry import agent_class, formatter_class
from nixl_kv.requests import RequestState, RequestStatuses, TransferRequest
from nixl_kv.sender import CacheSender, SenderContext
from nixl_kv.state import CacheState, CommState, DataTransceiverState, RankCommInfo
from nixl_kv.topology import position

log = logging.getLogger(__name__)

DEFAULT_POLL_SLICE_MS = 10
SAFETY_MARGIN_S = 5.0  # beyond a transfer's own deadline, before a status check gives up on its future


def wait_interval_s(configured_ms: int | None, needs_progress: bool) -> float:
    """How long one status check waits on one transfer (the reference's future wait interval)."""
    if configured_ms is None:
        wait_ms = DEFAULT_POLL_SLICE_MS
    else:
        wait_ms = configured_ms if needs_progress else min(configured_ms, DEFAULT_POLL_SLICE_MS)
    return max(1, wait_ms) / 1000


@dataclass
class _Pending:
    """Requests whose futures ended locally and now wait for the sync group to agree."""

    futures: dict[int, tuple[TransferRequest, Future]] = field(default_factory=dict)
    awaiting: dict[int, TransferRequest] = field(default_factory=dict)
    completed: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)

    def record(self, request: TransferRequest, error: str | None) -> None:
        rid = request.request_id
        self.awaiting[rid] = request
        if error is None:
            self.completed.add(rid)
        else:
            request.error = error
            self.failed.add(rid)
            self.completed.discard(rid)

    def settle(self, rid: int) -> TransferRequest | None:
        self.completed.discard(rid)
        self.failed.discard(rid)
        return self.awaiting.pop(rid, None)


class CacheTransceiver:
    def __init__(
        self,
        cache: CacheManager,
        cache_state: CacheState,
        config: CacheTransceiverConfig | None = None,
        comm: CacheTransceiverComm | None = None,
    ) -> None:
        self.config = config or CacheTransceiverConfig()
        self._comm = comm or SingleProcessComm()
        self.instance_id: str = self._comm.bcast(uuid.uuid4().hex if self._comm.rank == 0 else None)
        self._cache = cache
        layout = cache.layout
        self._staging = CacheTransBufferManager(
            self.config.max_tokens_in_buffer,
            layout.block_bytes // layout.tokens_per_block,
            self.config.num_staging_slots,
            layout.pools[0].memory,
            layout.pools[0].device_id,
        )
        agent = agent_class(self.config.backend)(f"nixl_kv-{self.instance_id}-{self._comm.rank}")
        agent.register([*layout.pools, self._staging.region])
        me = RankCommInfo(
            agent.name, agent.metadata(), layout, staging=self._staging.region, slot_bytes=self._staging.slot_bytes
        )
        self.state = DataTransceiverState(self.instance_id, cache_state, CommState(tuple(self._comm.allgather(me))))
        self._serialized_state = wire.encode(self.state)
        self._tp_sync, self._pp_sync, self._gen_sync, self._cp_group = self._groups(cache_state)
        self._loop = ProgressLoop(agent)
        self._agent = agent
        formatter = formatter_class(cache_state.attention_type.value)()
        sender_context = SenderContext(
            self.instance_id, self._comm.rank, cache_state, self._serialized_state, self.config.lease_ms
        )
        self._sender = CacheSender(self._loop, cache, sender_context, formatter, self._staging)
        self._receiver = CacheReceiver(
            self._loop,
            cache,
            self.state,
            self._comm.rank,
            formatter,
            self._staging,
            self.config.kv_transfer_timeout_ms,
            self.config.direct_min_run_bytes,
        )
        self._ctx = _Pending()
        self._gen = _Pending()
        self._closed = False

    def _groups(self, cache_state: CacheState) -> tuple[CacheTransceiverComm, ...]:
        """Split the instance (rank order: TP fastest, then CP, then PP) into the groups that must agree on a
        request's outcome, as the reference does, and the CP group that shares a request's block lists.

        ctx: the TP group (all ranks of a PP stage; under attention DP only the rank itself), then the PP group.
        gen: the whole instance (under attention DP, the ranks of the same DP rank).
        """
        parallel = cache_state.parallel
        if self._comm.size == 1:
            return self._comm, self._comm, self._comm, self._comm
        rank = self._comm.rank
        where = position(parallel, rank)
        pp_group = self._comm.split(rank % (parallel.tp * parallel.cp), rank)
        cp_group = self._comm.split(where.pp_rank * parallel.tp + where.tp_rank, rank)
        if parallel.enable_attention_dp:
            tp_in_dp = self._comm.split(rank, rank)
            dp_group = self._comm.split(where.tp_rank, rank)
            return tp_in_dp, pp_group, dp_group, cp_group
        tp_group = self._comm.split(where.pp_rank, rank)
        return tp_group, pp_group, self._comm, cp_group

    # --- ctx side -----------------------------------------------------------------------------------------
    def respond_and_send_async(self, request: TransferRequest) -> None:
        """Pin the request's blocks, set its ContextPhaseParams, and serve its readers in the background."""
        if request.request_id in self._ctx.futures:
            log.warning("request %d is already responding", request.request_id)
            return
        request.state = RequestState.CONTEXT_TRANS_IN_PROGRESS
        blocks = tuple(int(b) for b in self._cache.block_ids(request.request_id))
        per_cp = tuple(self._cp_group.allgather(blocks))  # collective: every rank responds in the same order
        future = self._sender.send_async(request, per_cp)
        self._ctx.futures[request.request_id] = (request, future)

    def check_context_transfer_status(
        self, at_least: int | None = None, mark_complete: bool = False
    ) -> RequestStatuses:
        """None blocks until every transfer is terminal; 0 polls; n > 0 waits (bounded) for n of them."""
        blocking = at_least is None
        wait_s = wait_interval_s(self.config.kv_transfer_sender_future_timeout_ms, (at_least or 0) > 0)
        ready = [rid for rid, (_, future) in self._ctx.futures.items() if future.done()]
        selected = ready_everywhere(self._tp_sync, ready)
        for rid in self._ctx.futures:
            if len(selected) >= (at_least or 0):
                break
            selected.add(rid)
        lease_s = self.config.lease_ms / 1000 + SAFETY_MARGIN_S
        self._collect(self._ctx, selected, blocking, lease_s if blocking else wait_s)
        outcome = reduce_in_stages([self._tp_sync, self._pp_sync], self._ctx.completed, self._ctx.failed)
        return self._settle(self._ctx, outcome.completed, outcome.failed, RequestState.CONTEXT_COMPLETE, mark_complete)

    # --- gen side -----------------------------------------------------------------------------------------
    def request_and_receive_async(self, request: TransferRequest) -> None:
        """Start pulling the request's KV from the ctx instance its ContextPhaseParams name."""
        if request.request_id in self._gen.futures:
            log.warning("request %d is already receiving", request.request_id)
            return
        request.state = RequestState.GENERATION_TRANS_IN_PROGRESS
        self._gen.futures[request.request_id] = (request, self._receiver.receive_async(request))

    def request_and_receive_sync(self, request: TransferRequest) -> None:
        """Pull the request's KV and return when it is verified (or has failed: see ``request.state``)."""
        request.state = RequestState.GENERATION_TRANS_IN_PROGRESS
        future = self._receiver.receive_async(request)
        error = _outcome(future, self._gen_deadline_s())
        if error is None:
            request.state = RequestState.GENERATION_TRANS_COMPLETE
        else:
            request.fail(error)

    def check_gen_transfer_status(self, at_least: int | None = None) -> RequestStatuses:
        """Like the ctx check; completed requests move to GENERATION_TRANS_COMPLETE."""
        blocking = at_least is None
        wait_s = wait_interval_s(self.config.kv_transfer_poll_interval_ms, (at_least or 0) > 0)
        if (at_least or 0) > 0:
            self._wait_for_ready(self._gen, at_least, wait_s)
        ready = [rid for rid, (_, future) in self._gen.futures.items() if future.done()]
        selected = set(self._gen.futures) if blocking else ready_everywhere(self._gen_sync, ready)
        self._collect(self._gen, selected, blocking, self._gen_deadline_s() if blocking else 0.0)
        outcome = reduce_outcomes(self._gen_sync, self._gen.completed, self._gen.failed)
        return self._settle(self._gen, outcome.completed, outcome.failed, RequestState.GENERATION_TRANS_COMPLETE, True)

    def check_gen_transfer_complete(self) -> bool:
        """True when no gen transfer is in flight or awaiting agreement."""
        return not self._gen.futures and not self._gen.awaiting

    # --- both sides -------------------------------------------------------------------------------------
    def cancel_request(self, request: TransferRequest) -> bool:
        """Cancel a transfer that has not ended; True if one was cancelled. Its future then fails."""
        if request.request_id in self._ctx.futures:
            return self._sender.cancel(request.request_id)
        if request.request_id in self._gen.futures:
            return self._receiver.cancel(request.request_id)
        return False

    def has_poisoned_transfer_buffer(self) -> bool:
        """True while memory a remote may still touch is held back from reuse."""
        return bool(self._receiver.poisoned) or self._staging.has_poisoned_buffer()

    def get_serialized_data_transceiver_state(self) -> bytes:
        return self._serialized_state

    def close(self) -> None:
        """Fail what is in flight, stop the progress loop, release every agent resource."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.call(self._receiver.close)
            self._sender.cancel_all()
        except NixlKvError as exc:
            log.warning("closing: %s", exc)
        finally:
            self._loop.stop()
            self._agent.close()

    def __enter__(self) -> CacheTransceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers ----------------------------------------------------------------------------------------------
    def _gen_deadline_s(self) -> float:
        budget_ms = self.config.kv_transfer_timeout_ms or self.config.lease_ms
        return budget_ms / 1000 + SAFETY_MARGIN_S

    @staticmethod
    def _wait_for_ready(pending: _Pending, at_least: int, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            futures = [future for _, future in pending.futures.values()]
            done = sum(future.done() for future in futures)
            remaining = deadline - time.monotonic()
            if done >= at_least or remaining <= 0 or done == len(futures):
                return
            wait_futures([f for f in futures if not f.done()], timeout=remaining, return_when="FIRST_COMPLETED")

    @staticmethod
    def _collect(pending: _Pending, selected: set[int], blocking: bool, wait_s: float) -> None:
        for rid, (request, future) in list(pending.futures.items()):
            if not blocking and rid not in selected:
                continue
            try:
                error = _outcome(future, wait_s, raise_timeout=not blocking)
            except FutureTimeout:
                continue
            del pending.futures[rid]
            pending.record(request, error)

    @staticmethod
    def _settle(
        pending: _Pending,
        completed: set[int],
        failed: set[int],
        done_state: RequestState,
        mark_complete: bool,
    ) -> RequestStatuses:
        statuses = RequestStatuses()
        for rid in sorted(failed):
            request = pending.settle(rid)
            if request is not None:
                request.fail(request.error or "a rank of the sync group failed this transfer")
                statuses.error_request_ids.add(rid)
        for rid in sorted(completed):
            request = pending.settle(rid)
            if request is not None:
                statuses.completed_request_ids.add(rid)
                if mark_complete:
                    request.state = done_state
        return statuses


def _outcome(future: Future, timeout_s: float, raise_timeout: bool = False) -> str | None:
    """None if the transfer succeeded, else its error; a future that outlives ``timeout_s`` is an error."""
    try:
        future.result(timeout=timeout_s)
    except FutureTimeout:
        if raise_timeout:
            raise
        return f"no outcome within {timeout_s:.1f} s"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
