"""CacheSender: the ctx side. Pins a request's blocks, answers its readers, releases at the end (DESIGN §5).

A request is done when every expected reader reported its READ finished (``ReadDone``); each report gets a
``ReadVerdict`` that is ok only while the blocks are still pinned. When the lease runs out first, the blocks
are released and the request fails; a reader that reports later gets a refusal, never a false ok.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from nixl_kv import wire
from nixl_kv.cache import CacheManager
from nixl_kv.errors import AgentError, TransferError
from nixl_kv.loop import ProgressLoop
from nixl_kv.protocol import ReadDone, ReadVerdict
from nixl_kv.requests import TransferRequest
from nixl_kv.state import ContextPhaseParams

log = logging.getLogger(__name__)

MAX_KNOWN_READERS = 1024  # gen agents whose metadata stays loaded; the oldest is forgotten beyond this


@dataclass
class _Outgoing:
    request: TransferRequest
    block_ids: np.ndarray
    lease_deadline: float
    future: Future
    expected_readers: int | None = None
    reports: dict[tuple[str, int], str] = field(default_factory=dict)  # (reader, transfer id) -> failure or ""


class CacheSender:
    def __init__(
        self,
        loop: ProgressLoop,
        cache: CacheManager,
        instance_id: str,
        serialized_state: bytes,
        lease_ms: int,
        dp_rank: int = 0,
    ) -> None:
        self._loop = loop
        self._cache = cache
        self._instance_id = instance_id
        self._serialized_state = serialized_state
        self._lease_ms = lease_ms
        self._dp_rank = dp_rank
        self._lock = threading.Lock()
        self._outgoing: dict[int, _Outgoing] = {}
        self._known_readers: OrderedDict[str, None] = OrderedDict()  # LRU of loaded reader agents
        loop.on_message(ReadDone, self._on_read_done)
        loop.add_ticker(self._tick)

    def send_async(self, request: TransferRequest) -> Future:
        """Pin the request's blocks and fill its ContextPhaseParams; the future ends when its readers are done."""
        future: Future = Future()
        blocks = np.asarray(self._cache.pin(request.request_id), dtype=np.int64)
        params = ContextPhaseParams(
            request_id=request.request_id,
            ctx_state=self._serialized_state,
            block_ids=(tuple(int(b) for b in blocks),),
            num_tokens=request.num_tokens,
            lease_ms=self._lease_ms,
            ctx_dp_rank=self._dp_rank,
            first_gen_tokens=request.first_gen_tokens,
            draft_tokens=request.draft_tokens,
        )
        request.transfer_start = time.monotonic()
        request.transfer_bytes = len(blocks) * self._cache.layout.block_bytes
        with self._lock:
            if request.request_id in self._outgoing:
                self._cache.unpin(request.request_id)
                raise ValueError(f"request {request.request_id} is already being sent")
            self._outgoing[request.request_id] = _Outgoing(
                request, blocks, request.transfer_start + self._lease_ms / 1000, future
            )
        request.context_phase_params = wire.encode(params)
        return future

    def cancel(self, request_id: int) -> bool:
        """Stop serving a request: its blocks are released and late readers are refused."""
        with self._lock:
            entry = self._outgoing.pop(request_id, None)
        if entry is None:
            return False
        self._finish(entry, f"request {request_id} was cancelled on the ctx side")
        return True

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._outgoing)

    # --- progress loop side ---------------------------------------------------------------------------
    def _on_read_done(self, reader: str, message: ReadDone) -> None:
        if not self._reachable(reader, message.reader_metadata):
            return
        verdict = self._record(reader, message)
        self._reply(reader, message, verdict)

    def _record(self, reader: str, message: ReadDone) -> str:
        """Record one reader's report; returns "" for ok or the reason of refusal."""
        if message.ctx_instance_id != self._instance_id:
            return f"this ctx rank belongs to instance {self._instance_id}, not {message.ctx_instance_id}"
        with self._lock:
            entry = self._outgoing.get(message.request_id)
            if entry is None:
                return f"request {message.request_id} is not pinned here (unknown, finished, cancelled or expired)"
            if entry.expected_readers is None:
                entry.expected_readers = message.expected_readers
            entry.reports[(reader, message.transfer_id)] = _failure_of(message)
            finished = len(entry.reports) >= entry.expected_readers
            if finished:
                del self._outgoing[message.request_id]
        if finished:
            failures = [reason for reason in entry.reports.values() if reason]
            self._finish(entry, "; ".join(failures) if failures else None)
        return _failure_of(message)

    def _reply(self, reader: str, message: ReadDone, refusal: str) -> None:
        verdict = ReadVerdict(
            ctx_instance_id=self._instance_id,
            request_id=message.request_id,
            transfer_id=message.transfer_id,
            ok=not refusal,
            reason=refusal,
        )
        try:
            self._loop.agent.notify(reader, wire.encode(verdict))
        except AgentError as exc:
            log.warning("could not answer reader %s of request %d: %s", reader, message.request_id, exc)

    def _reachable(self, reader: str, metadata: bytes) -> bool:
        """A NIXL agent can only notify agents whose metadata it loaded."""
        if reader in self._known_readers:
            self._known_readers.move_to_end(reader)
            return True
        try:
            loaded = self._loop.agent.load_remote(metadata)
        except AgentError as exc:
            log.warning("reader %s sent unusable metadata: %s", reader, exc)
            return False
        if loaded != reader:
            log.warning("reader %s sent the metadata of %s; ignored", reader, loaded)
            return False
        self._known_readers[reader] = None
        while len(self._known_readers) > MAX_KNOWN_READERS:
            stale, _ = self._known_readers.popitem(last=False)
            try:
                self._loop.agent.forget_remote(stale)
            except AgentError as exc:
                log.info("could not forget reader %s: %s", stale, exc)
        return True

    def _tick(self, now: float) -> bool:
        with self._lock:
            expired = [rid for rid, entry in self._outgoing.items() if entry.lease_deadline <= now]
            entries = [self._outgoing.pop(rid) for rid in expired]
            busy = bool(self._outgoing)
        for entry in entries:
            done = len(entry.reports)
            self._finish(
                entry,
                f"lease of {self._lease_ms} ms expired with {done} of {entry.expected_readers or '?'} readers done",
            )
        return busy

    def _finish(self, entry: _Outgoing, failure: str | None) -> None:
        entry.request.transfer_end = time.monotonic()
        self._cache.unpin(entry.request.request_id)
        if failure is None:
            entry.future.set_result(None)
        else:
            entry.future.set_exception(TransferError(failure))


def _failure_of(message: ReadDone) -> str:
    return (message.reason or "the reader's READ failed") if message.failed else ""
