"""CacheTransceiver: the API a serving engine calls on both sides (the reference's CacheTransceiver).

ctx side: ``respond_and_send_async`` then ``check_context_transfer_status``.
gen side: ``request_and_receive_async`` then ``check_gen_transfer_status`` (or ``request_and_receive_sync``).
Status checks report a request only once every rank of its sync group agrees (``consensus``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sys
import time
import uuid
from collections.abc import Mapping

from nixl_kv import ipc_path, wire
from nixl_kv.auth import KEY_BYTES as AUTH_KEY_BYTES
from nixl_kv.buffers import CacheTransBufferManager
from nixl_kv.cache import CacheManager
from nixl_kv.comm import CacheTransceiverComm, SingleProcessComm
from nixl_kv.config import DIRECT_MIN_RUN_BYTES, ENV_PREFIX, CacheTransceiverConfig
from nixl_kv.ctx.sender import CacheSender, SenderContext
from nixl_kv.errors import IncompatibleStateError, NotSupportedError, WireFormatError
from nixl_kv.gen.receiver import CacheReceiver
from nixl_kv.holds import KEY_BYTES, HoldBoard, LandingRing, clock_domain
from nixl_kv.layout import KVLayout, RnnLayout
from nixl_kv.loop import ProgressLoop
from nixl_kv.metrics import TransferMetrics, TransferSummary
from nixl_kv.params import ParamsMaker
from nixl_kv.peers import PeerDirectory
from nixl_kv.pool_checks import check_indexer_pools, check_kv_pools, check_rnn_pools
from nixl_kv.progress import ContextProgress
from nixl_kv.registry import agent_class, agent_names, formatter_class
from nixl_kv.requests import RequestState, RequestStatuses, TransferRequest
from nixl_kv.rnn import check_split, rnn_share
from nixl_kv.state import CacheState, CommState, DataTransceiverState, RankCommInfo
from nixl_kv.status import SideRules, TransferTracker, outcome_by_deadline
from nixl_kv.topology import position

log = logging.getLogger(__name__)


MAX_PEERS = 256  # remote agents (and descriptor lists) the peer directory keeps beyond those in use


def resolve_backend(name: str, environ: Mapping[str, str]) -> str:
    """DEFAULT becomes the first available agent (registered or installed, by name) with ``NIXL_KV_USE_<NAME>=1``,
    else NIXL."""
    if name != "DEFAULT":
        return name
    for agent in agent_names():
        if environ.get(f"{ENV_PREFIX}USE_{agent.upper()}", "").lower() in ("1", "true", "yes", "on"):
            return agent
    return "NIXL"


def create_cache_transceiver(
    cache: CacheManager,
    cache_state: CacheState,
    config: CacheTransceiverConfig | None,
    comm: CacheTransceiverComm | None = None,
    environ: Mapping[str, str] | None = None,
) -> CacheTransceiver | None:
    """The reference's factory: no config means disabled (None); NIXL_KV_* variables override the config."""
    if config is None:
        log.info("CacheTransceiver is disabled (no config)")
        return None
    environ = os.environ if environ is None else environ
    config = CacheTransceiverConfig.from_env(config, environ)
    config = dataclasses.replace(config, backend=resolve_backend(config.backend, environ))
    return CacheTransceiver(cache, cache_state, config, comm)


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
        hold_key: bytes = self._comm.bcast(secrets.token_bytes(KEY_BYTES) if self._comm.rank == 0 else None)
        auth_key: bytes = self._comm.bcast(secrets.token_bytes(AUTH_KEY_BYTES) if self._comm.rank == 0 else None)
        self._board, self._landing = HoldBoard(), LandingRing()
        _check_state(cache_state)
        check_kv_pools(cache.layout, cache_state, self._comm.rank, "this rank")
        dtype = getattr(cache, "dtype", None)  # optional: a layout knows only the element size
        if dtype is not None and dtype != cache_state.dtype:
            raise IncompatibleStateError(
                f"this rank: the cache holds {dtype.value}, its cache state says {cache_state.dtype.value}"
            )
        self._cache = cache
        layout = cache.layout
        self._staging = CacheTransBufferManager(
            self.config.max_tokens_in_buffer,
            layout.block_bytes // layout.tokens_per_block,
            self.config.num_staging_slots,
            layout.pools[0].memory,
            layout.pools[0].device_id,
        )
        indexer, rnn = _state_pools(cache, cache_state, self._comm.rank)
        if self.config.gil_switch_interval_us is not None:
            sys.setswitchinterval(self.config.gil_switch_interval_us / 1e6)
        agent = agent_class(self.config.backend)(
            f"nixl_kv-{self.instance_id}-{self._comm.rank}", progress_thread=self.config.agent_progress_thread
        )
        pools = (*layout.pools, *(indexer.pools if indexer else ()), *(rnn.regions if rnn else ()))
        agent.register(
            [
                *pools,
                self._staging.region,
                self._board.region,
                self._landing.region,
            ]
        )
        me = RankCommInfo(
            agent.name,
            agent.metadata(),
            layout,
            staging=self._staging.region,
            slot_bytes=self._staging.slot_bytes,
            indexer=indexer,
            rnn=rnn,
            board=self._board.region,
            clock_domain=clock_domain(),
            ipc_pools=ipc_path.export_blob(pools),  # the pools as CUDA IPC handles (b"": none, or the gather is off)
        )
        comm_state = CommState(tuple(self._comm.allgather(me)))
        self.state = DataTransceiverState(self.instance_id, cache_state, comm_state, hold_key)
        self._serialized_state = wire.encode(self.state)
        self._tp_sync, self._pp_sync, self._gen_sync, self._cp_group = self._groups(cache_state)
        agent = ipc_path.wrap(agent, pools)  # same-host READs of rows as CUDA IPC gathers, where that is on
        self._loop = ProgressLoop(agent, self.config.progress_poll_us / 1e6)
        self._agent = agent
        formatter = formatter_class(cache_state.attention_type.value)()
        sender_context = SenderContext(
            self.instance_id,
            self._comm.rank,
            cache_state,
            self._serialized_state,
            self.config.lease_ms,
            auth_key,
            hold_key,
            self._board,
            self.config.hold_promise_ms,
        )
        self._params_maker = sender_context.params_maker()
        self.metrics = TransferMetrics(self.instance_id)
        # one directory of remote agents for both sides: ctx peers read from, readers answered
        busy = lambda: self._receiver.busy_agents() | self._sender.busy_readers()  # noqa: E731
        self._peers = PeerDirectory(agent, MAX_PEERS, busy, on_change=lambda name: self._receiver.peer_changed(name))
        self._sender = CacheSender(
            self._loop, cache, sender_context, formatter, self._staging, self._peers, self.metrics
        )
        self._receiver = CacheReceiver(
            self._loop,
            cache,
            self.state,
            self._comm.rank,
            formatter,
            self._staging,
            self._direct_min_run_bytes(layout),
            self._peers,
            landing=self._landing,
            metrics=self.metrics,
        )
        offset = self._clock_offset()
        common = {
            "timeout_ms": self.config.kv_transfer_timeout_ms,
            "inflight_cancel": self.config.enable_inflight_cancel,
        }
        self._ctx = TransferTracker(
            SideRules(
                "ctx", self._tp_sync, [self._tp_sync, self._pp_sync], RequestState.CONTEXT_COMPLETE,
                self.config.kv_transfer_sender_future_timeout_ms,
                cancel=self._sender.cancel, clock_offset_s=offset, **common,
            ),
            self.metrics,
            TransferSummary(self.config.time_output_path, self.instance_id, self._comm.rank, "ctx"),
        )  # fmt: skip
        self._gen = TransferTracker(
            SideRules(
                "gen", self._gen_sync, [self._gen_sync], RequestState.GENERATION_TRANS_COMPLETE,
                self.config.kv_transfer_poll_interval_ms,
                cancel=self._receiver.cancel, clock_offset_s=offset,
                progress=self._receiver.progress, spin_budget_s=self._receiver.spin_budget_s,
                hand_off=self._receiver.hand_off, **common,
            ),
            self.metrics,
            TransferSummary(self.config.time_output_path, self.instance_id, self._comm.rank, "gen"),
        )  # fmt: skip
        self._closed = False

    def _direct_min_run_bytes(self, layout: KVLayout) -> int:
        configured = self.config.direct_min_run_bytes
        return DIRECT_MIN_RUN_BYTES[layout.pools[0].memory.value] if configured is None else configured

    def _clock_offset(self) -> float:
        """Seconds to add to this rank's monotonic clock to read rank 0's (merged timings across ranks)."""
        if self._comm.size == 1:
            return 0.0
        self._comm.barrier()
        readings = self._comm.allgather(time.monotonic())
        return readings[0] - readings[self._comm.rank]

    def _groups(self, cache_state: CacheState) -> tuple[CacheTransceiverComm, ...]:
        """Split the instance (rank order: TP fastest, then CP, then PP) into the groups that must agree on a
        request's outcome, as the reference does, and the CP group that shares a request's block lists.

        ctx: the TP group (all ranks of a PP stage; under attention DP the CP ranks of the request's TP rank),
        then the PP group.
        gen: the whole instance (under attention DP, the ranks of the same DP rank).
        """
        parallel = cache_state.parallel
        if self._comm.size == 1:
            return self._comm, self._comm, self._comm, self._comm
        rank = self._comm.rank
        where = position(parallel, rank)
        pp_group = self._comm.split(rank % (parallel.tp * parallel.cp), rank)
        cp_group = self._comm.split(where.pp_rank * parallel.tp + where.tp_rank, rank)
        if parallel.enable_attention_dp:  # a request lives on one TP rank: its CP ranks agree, then its PP ranks
            dp_group = self._comm.split(where.tp_rank, rank)
            return cp_group, pp_group, dp_group, cp_group
        tp_group = self._comm.split(where.pp_rank, rank)
        return tp_group, pp_group, self._comm, cp_group

    # --- ctx side -----------------------------------------------------------------------------------------
    def respond_and_send_async(self, request: TransferRequest) -> None:
        """Pin the request's blocks, set its ContextPhaseParams, and serve its readers in the background."""
        self._respond(request, RequestState.CONTEXT_TRANS_IN_PROGRESS, None)

    def respond_and_send_layer_wise(self, requests: list[TransferRequest], progress: ContextProgress) -> None:
        """Like ``respond_and_send_async`` while prefill is still running: readers pull each layer as soon
        as ``progress`` marks it done, so the transfer overlaps the rest of the prefill."""
        if self.state.cache.rnn is not None:
            raise NotSupportedError("layer-wise transfer of RNN state is not supported: respond once prefill is done")
        for request in requests:
            self._respond(request, RequestState.CONTEXT_INIT_AND_TRANS, progress)

    def _respond(self, request: TransferRequest, state: RequestState, progress: ContextProgress | None) -> None:
        if request.request_id in self._ctx:
            log.warning("request %d is already responding", request.request_id)
            return
        request.state = state
        blocks = tuple(int(b) for b in self._cache.block_ids(request.request_id))
        per_cp = tuple(self._cp_group.allgather(blocks))  # collective: every rank responds in the same order
        self._ctx.add(request, self._sender.send_async(request, per_cp, progress))

    def check_context_transfer_status(
        self, at_least: int | None = None, mark_complete: bool = False
    ) -> RequestStatuses:
        """None blocks until every transfer is terminal; 0 polls; n > 0 waits (bounded) for n of them."""
        return self._ctx.check(at_least, mark_complete)

    # --- gen side -----------------------------------------------------------------------------------------
    @property
    def loop_passes(self) -> int:
        """Passes the progress loop made so far (a benchmark's measure of the loop's work; see ``nixl_kv.loop``)."""
        return self._loop.passes

    def request_and_receive_async(self, request: TransferRequest) -> None:
        """Start pulling the request's KV from the ctx instance its ContextPhaseParams name."""
        if request.request_id in self._gen:
            log.warning("request %d is already receiving", request.request_id)
            return
        request.state = RequestState.GENERATION_TRANS_IN_PROGRESS
        self._gen.add(request, self._receiver.receive_async(request))

    def request_and_receive_sync(self, request: TransferRequest) -> None:
        """Pull the request's KV and return when it is verified (or has failed: see ``request.state``)."""
        request.state = RequestState.GENERATION_TRANS_IN_PROGRESS
        error = outcome_by_deadline(request, self._receiver.receive_async(request), self._receiver.cancel)
        if error is None:
            request.state = RequestState.GENERATION_TRANS_COMPLETE
        else:
            request.fail(error)

    def check_gen_transfer_status(self, at_least: int | None = None) -> RequestStatuses:
        """Like the ctx check; completed requests move to GENERATION_TRANS_COMPLETE."""
        return self._gen.check(at_least, True)

    def connect_to(self, serialized_ctx_state: bytes) -> None:
        """Meet a ctx instance before its first request (when the router learns of it, from the ctx side's
        ``get_serialized_data_transceiver_state``): its ranks' metadata is loaded, the connections set up and
        their descriptor lists prepared, so that first request pays none of it. Optional: without it the first
        request does it."""
        self._receiver.connect_to(serialized_ctx_state)

    def check_gen_transfer_complete(self) -> bool:
        """True when no gen transfer is in flight or awaiting agreement."""
        return self._gen.idle

    # --- both sides -------------------------------------------------------------------------------------
    def cancel_request(self, request: TransferRequest) -> bool:
        """Cancel a transfer that has not ended; True if one was cancelled. Its future then fails."""
        for tracker, cancel in ((self._ctx, self._sender.cancel), (self._gen, self._receiver.cancel)):
            if request.request_id in tracker and cancel(request.request_id):
                self.metrics.add(tracker.rules.side, cancellations=1)
                return True
        return False

    def has_poisoned_transfer_buffer(self) -> bool:
        """True while memory a remote may still touch is held back from reuse."""
        self.metrics.set_poisoned("gen", len(self._receiver.poisoned))
        self.metrics.set_poisoned("ctx", self._staging.poisoned_slots)
        return bool(self._receiver.poisoned) or self._staging.has_poisoned_buffer()

    def get_serialized_data_transceiver_state(self) -> bytes:
        return self._serialized_state

    def params_maker(self) -> ParamsMaker:
        """What makes this instance's params without responding (``nixl_kv.params``): for an engine whose
        scheduler hands out the params of requests its workers respond to. Holds the instance's private key."""
        return self._params_maker

    def close(self) -> None:
        """Fail what is in flight, stop the progress loop, release every agent resource."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.call(self._receiver.close)
            self._sender.cancel_all()
        except Exception as exc:  # closing goes on whatever failed
            log.warning("closing: %s", exc)
        finally:
            self._loop.stop()
            try:
                self._agent.close()
            finally:
                self._release_deferred_at_close()
            self._ctx.summary.close()
            self._gen.summary.close()

    def _release_deferred_at_close(self) -> None:
        """Blocks kept to a hold promise, and gen destinations of READs that could not be cancelled, go back now:
        the agent is closed, no READ reaches this rank or lands here any more. Not while the loop thread still
        runs (it did not stop in time): it releases them itself."""
        if self._loop.stopped:
            self._sender.release_deferred(everything=True)
            self._receiver.release_stuck_at_close()
        else:
            log.error("the progress loop is still running: blocks kept to hold promises are left to it")

    def __enter__(self) -> CacheTransceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _state_pools(cache: CacheManager, cache_state: CacheState, rank: int) -> tuple[KVLayout | None, RnnLayout | None]:
    """The cache's indexer-K and Mamba state pools: present exactly when the cache state says, on the KV's kind
    of memory, and holding this rank's share."""
    indexer: KVLayout | None = getattr(cache, "indexer_layout", None)
    rnn: RnnLayout | None = getattr(cache, "rnn_layout", None)
    for what, layout, wanted in (
        ("an indexer-K cache", indexer, cache_state.has_indexer_k_cache),
        ("RNN state", rnn, cache_state.rnn is not None),
    ):
        if wanted != (layout is not None):
            has, keeps = ("has", "keeps no") if wanted else ("has no", "keeps")
            raise IncompatibleStateError(f"the cache state {has} {what}; the cache {keeps} pools for it")
        regions = () if layout is None else layout.pools if isinstance(layout, KVLayout) else layout.regions
        if any(region.memory is not cache.layout.pools[0].memory for region in regions):
            raise NotSupportedError(f"{what} must live on the same kind of memory as the KV pools")
    if indexer is not None:
        check_indexer_pools(indexer, cache_state, cache.layout.num_layers, cache.layout.num_blocks, "this rank")
    if rnn is not None:
        check_split(cache_state.rnn, cache_state.parallel)
        check_rnn_pools(rnn, rnn_share(cache_state.rnn, cache_state.parallel, rank), cache_state.rnn, "this rank")
    return indexer, rnn


def _check_state(cache_state: CacheState) -> None:
    """The same field and cross-field rules as for a peer's state (the wire decoder's), for our own."""
    try:
        wire.decode(wire.encode(cache_state), CacheState)
    except WireFormatError as exc:
        raise IncompatibleStateError(f"this rank's cache state is not valid: {exc}") from None
