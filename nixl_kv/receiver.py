"""CacheReceiver: the gen side. Checks the ctx state, plans, READs from each ctx peer, waits for the verdict.

A request completes only when every READ finished and every ctx peer confirmed the blocks were still pinned
when the read finished (DESIGN §5.6). It fails, always within its deadline, when a check refuses the pairing,
a READ fails, a peer refuses, or the deadline passes; an in-flight READ is cancelled then, and if the agent
cannot cancel it the destination blocks are reported poisoned.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nixl_kv import wire
from nixl_kv.cache import CacheManager
from nixl_kv.errors import AgentError, NixlKvError, TransferError
from nixl_kv.interfaces import Formatter, PeerRead, ReadRequest, TransferStatus
from nixl_kv.loop import ProgressLoop
from nixl_kv.protocol import ReadDone, ReadVerdict
from nixl_kv.requests import TransferRequest
from nixl_kv.state import ContextPhaseParams, DataTransceiverState, RankCommInfo

log = logging.getLogger(__name__)

RequestKey = tuple[str, int]  # (ctx instance id, ctx request id)


@dataclass
class _Read:
    transfer_id: int
    peer: str
    handle: Any
    expected_readers: int
    finished: bool = False
    verdict: str | None = None  # None until the ctx peer answers; "" means ok


@dataclass
class _Incoming:
    key: RequestKey
    request: TransferRequest
    ctx_state: DataTransceiverState
    plan: list[PeerRead]
    deadline: float
    future: Future
    reads: list[_Read] = field(default_factory=list)


class CacheReceiver:
    def __init__(
        self,
        loop: ProgressLoop,
        cache: CacheManager,
        self_state: DataTransceiverState,
        self_rank: int,
        formatter: Formatter,
        timeout_ms: int | None,
        max_peers: int = 256,
    ) -> None:
        self._loop = loop
        self._cache = cache
        self._self_state = self_state
        self._self_rank = self_rank
        self._formatter = formatter
        self._timeout_ms = timeout_ms
        self._max_peers = max_peers
        self._lock = threading.Lock()
        self._active: dict[RequestKey, _Incoming] = {}
        self._by_request: dict[int, RequestKey] = {}
        self._by_transfer: dict[int, tuple[_Incoming, _Read]] = {}
        self._transfer_ids = itertools.count(1)
        self._states: OrderedDict[bytes, DataTransceiverState] = OrderedDict()
        self._peers: OrderedDict[tuple[str, bytes], Any] = OrderedDict()
        self._loaded_agents: set[str] = set()
        self.poisoned: dict[RequestKey, str] = {}
        layout = cache.layout
        self._metadata, self._local = loop.call(
            lambda: (
                loop.agent.metadata(),
                loop.agent.prepare(None, layout.strided_descriptors(), layout.pools[0].memory),
            )
        )
        loop.on_message(ReadVerdict, self._on_verdict)
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
        self._loop.submit(lambda: self._start(incoming))
        return future

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
        params = wire.decode(request.context_phase_params, ContextPhaseParams)
        ctx_state = self._decode_state(params.ctx_state)
        self._formatter.inquire_support(self._self_state.cache, ctx_state.cache)
        plan = self._formatter.plan(
            ReadRequest(
                self_state=self._self_state,
                self_rank=self._self_rank,
                self_layout=self._cache.layout,
                peer_state=ctx_state,
                peer_block_ids=params.block_ids,
                local_block_ids=np.asarray(self._cache.block_ids(request.request_id)),
                num_tokens=params.num_tokens,
            )
        )
        request.first_gen_tokens, request.draft_tokens = params.first_gen_tokens, params.draft_tokens
        request.num_tokens = params.num_tokens
        request.transfer_bytes = sum(read.nbytes for read in plan)
        budget_ms = params.lease_ms if self._timeout_ms is None else min(self._timeout_ms, params.lease_ms)
        key = (ctx_state.instance_id, params.request_id)
        incoming = _Incoming(key, request, ctx_state, plan, request.transfer_start + budget_ms / 1000, future)
        with self._lock:
            if key in self._active or request.request_id in self._by_request:
                raise TransferError(f"request {request.request_id} (ctx request {key}) is already being received")
            self._active[key] = incoming
            self._by_request[request.request_id] = key
        return incoming

    def _decode_state(self, data: bytes) -> DataTransceiverState:
        with self._lock:
            state = self._states.get(data)
        if state is None:
            state = wire.decode(data, DataTransceiverState)
            with self._lock:
                self._states[data] = state
                while len(self._states) > self._max_peers:
                    self._states.popitem(last=False)
        return state

    # --- progress loop ----------------------------------------------------------------------------------
    def _start(self, incoming: _Incoming) -> None:
        if incoming.future.done():  # cancelled before it started
            return
        try:
            for read in incoming.plan:
                rank = incoming.ctx_state.comm.ranks[read.peer_rank]
                remote = self._remote_descriptors(rank)
                transfer_id = next(self._transfer_ids)
                done = ReadDone(
                    ctx_instance_id=incoming.ctx_state.instance_id,
                    request_id=incoming.key[1],
                    transfer_id=transfer_id,
                    reader_metadata=self._metadata,
                    expected_readers=read.expected_readers,
                )
                handle = self._loop.agent.read(
                    self._local, read.local_indices, remote, read.remote_indices, wire.encode(done)
                )
                entry = _Read(transfer_id, rank.agent_name, handle, read.expected_readers)
                incoming.reads.append(entry)
                self._by_transfer[transfer_id] = (incoming, entry)
        except NixlKvError as exc:
            self._fail(incoming, f"could not start the READs: {exc}")

    def _remote_descriptors(self, rank: RankCommInfo) -> Any:
        """Load a ctx rank's metadata and prepare its pool descriptors, once per peer (LRU-bounded)."""
        rows = rank.layout.strided_descriptors()
        key = (rank.agent_name, rows.tobytes())
        prepared = self._peers.get(key)
        if prepared is not None:
            self._peers.move_to_end(key)
            return prepared
        if rank.agent_name not in self._loaded_agents:
            loaded = self._loop.agent.load_remote(rank.agent_metadata)
            if loaded != rank.agent_name:
                self._loop.agent.forget_remote(loaded)
                raise AgentError(f"metadata of {rank.agent_name!r} describes agent {loaded!r}")
            self._loaded_agents.add(loaded)
        prepared = self._loop.agent.prepare(rank.agent_name, rows, rank.layout.pools[0].memory)
        self._peers[key] = prepared
        while len(self._peers) > self._max_peers:
            (old_agent, _), old = self._peers.popitem(last=False)
            self._loop.agent.release_prepared(old)
            if all(agent != old_agent for agent, _ in self._peers):
                self._loaded_agents.discard(old_agent)
                self._loop.agent.forget_remote(old_agent)
        return prepared

    def _on_verdict(self, sender: str, verdict: ReadVerdict) -> None:
        found = self._by_transfer.get(verdict.transfer_id)
        if found is None:
            return  # the request already ended
        incoming, read = found
        if sender != read.peer or verdict.request_id != incoming.key[1]:
            log.warning("ignored a verdict from %s for transfer %d it does not own", sender, verdict.transfer_id)
            return
        read.verdict = "" if verdict.ok else (verdict.reason or "refused by the ctx side")

    def _tick(self, now: float) -> bool:
        with self._lock:
            active = list(self._active.values())
        for incoming in active:
            self._advance(incoming, now)
        return bool(active)

    def _advance(self, incoming: _Incoming, now: float) -> None:
        if not incoming.reads:
            if now > incoming.deadline:
                self._fail(incoming, "deadline passed before the READs started")
            return
        for read in incoming.reads:
            if read.finished:
                continue
            status = self._loop.agent.status(read.handle)
            if status is TransferStatus.FAILED:
                self._fail(incoming, f"READ from {read.peer} failed")
                return
            if status is TransferStatus.DONE:
                read.finished = True
                self._loop.agent.release_transfer(read.handle)
                read.handle = None
        refusals = [f"{r.peer}: {r.verdict}" for r in incoming.reads if r.verdict]
        if refusals:
            self._fail(incoming, "ctx side refused: " + "; ".join(refusals))
        elif all(r.finished and r.verdict == "" for r in incoming.reads):
            self._end(incoming, None)
        elif now > incoming.deadline:
            waiting = sum(not r.finished for r in incoming.reads)
            unanswered = sum(r.verdict is None for r in incoming.reads)
            self._fail(
                incoming,
                f"deadline passed with {waiting} READ(s) unfinished and {unanswered} ctx confirmation(s) missing",
            )

    def _cancel(self, request_id: int) -> bool:
        with self._lock:
            key = self._by_request.get(request_id)
            incoming = self._active.get(key) if key else None
        if incoming is None:
            return False
        self._fail(incoming, "cancelled on the gen side")
        return True

    def _fail(self, incoming: _Incoming, reason: str) -> None:
        """End a request in error: cancel READs still in flight and tell the ctx peers not to wait."""
        for read in incoming.reads:
            if read.handle is not None and not read.finished:
                if not self._loop.agent.release_transfer(read.handle):
                    self.poisoned[incoming.key] = f"READ from {read.peer} could not be cancelled ({reason})"
                read.handle = None
                self._tell_ctx_failed(incoming, read, reason)
        self._end(incoming, reason)

    def _tell_ctx_failed(self, incoming: _Incoming, read: _Read, reason: str) -> None:
        message = ReadDone(
            ctx_instance_id=incoming.ctx_state.instance_id,
            request_id=incoming.key[1],
            transfer_id=read.transfer_id,
            reader_metadata=self._metadata,
            expected_readers=read.expected_readers,
            failed=True,
            reason=reason[:512],
        )
        try:
            self._loop.agent.notify(read.peer, wire.encode(message))
        except AgentError as exc:
            log.info("could not tell %s that request %s failed: %s", read.peer, incoming.key, exc)

    def _end(self, incoming: _Incoming, failure: str | None) -> None:
        with self._lock:
            self._active.pop(incoming.key, None)
            self._by_request.pop(incoming.request.request_id, None)
        for read in incoming.reads:
            self._by_transfer.pop(read.transfer_id, None)
        incoming.request.transfer_end = time.monotonic()
        if failure is None:
            incoming.future.set_result(None)
        else:
            incoming.future.set_exception(TransferError(failure))

    def close(self) -> None:
        """Fail every request still in flight (the loop is about to stop)."""
        with self._lock:
            active = list(self._active.values())
        for incoming in active:
            self._fail(incoming, "the transceiver was closed")
