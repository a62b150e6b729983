"""The ctx side's request table: the requests this rank serves, their leases, and messages that came early.

Ranks of a ctx instance respond at slightly different times, so a proven claim, watch or NoReaders may reach a
rank before it registered the request: it is parked for EARLY_GRACE_S and replayed once the request shows up.
READ completions are never parked: a READ before registration may have read unfinished KV.
"""

from __future__ import annotations

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

from nixl_kv.progress import ContextProgress
from nixl_kv.protocol import StageClaim
from nixl_kv.requests import TransferRequest

log = logging.getLogger(__name__)

EARLY_GRACE_S = 1.0  # a claim, watch or NoReaders for a request this rank has not registered yet waits this long
MAX_PARKED = 4096  # requests with early messages waiting; beyond it the oldest are dropped
MAX_PARKED_PER_REQUEST = 256  # early messages kept for one request (a reader sends a few); later ones are dropped
MAX_FINISHED = 4096  # recently finished requests, whose late messages are refused at once rather than parked

Handler = Callable[[str, Any], None]


@dataclass
class Outgoing:
    """One request this rank serves, from respond to release."""

    request: TransferRequest
    block_ids: np.ndarray
    num_blocks: int
    lease_deadline: float
    future: Future
    expected_readers: int | None = None
    finished_readers: dict[str, str] = field(default_factory=dict)  # reader -> failure, "" when ok
    progress: ContextProgress | None = None  # layer-wise requests: per-layer readiness
    watchers: set[str] = field(default_factory=set)  # readers told about layer readiness
    announced: int = -1  # the last ready_below sent to the watchers
    token: int = 0  # its hold token (nixl_kv.holds), 0 without a board
    posted: bool = False  # the token is on the board (else its readers ask for verdicts: its window was full)
    promised_until_ns: int = 0  # its blocks are not released before this (CLOCK_MONOTONIC), whatever happens
    masked_promise: int = 0  # the promise as posted on the board and carried in the params
    secret: bytes = b""  # the request's secret (nixl_kv.auth): the proof its readers' messages must carry


class RequestTable:
    """``lock`` guards ``outgoing`` and ``watched`` (the caller's thread registers, the loop thread ends); the rest
    is the loop thread's."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outgoing: dict[int, Outgoing] = {}
        self.watched: dict[int, Outgoing] = {}  # layer-wise requests with watchers
        self.finished: OrderedDict[int, None] = OrderedDict()
        self.parked: OrderedDict[int, list[tuple[float, str, Any, Handler]]] = OrderedDict()
        self._leases: list[tuple[float, int, int, Outgoing]] = []  # (deadline, order, request id, entry): a heap
        self._lease_order = itertools.count()

    def get(self, request_id: int) -> Outgoing | None:
        with self.lock:
            return self.outgoing.get(request_id)

    def take(self, request_id: int) -> Outgoing | None:
        """Remove the request (whoever takes it ends it)."""
        with self.lock:
            return self.outgoing.pop(request_id, None)

    def add(self, entry: Outgoing) -> None:
        """Under ``lock``: register the request with its lease."""
        rid = entry.request.request_id
        self.outgoing[rid] = entry
        heapq.heappush(self._leases, (entry.lease_deadline, next(self._lease_order), rid, entry))

    def expired(self, now: float) -> list[Outgoing]:
        """Take the requests whose lease ran out (off a heap: costs what changed, not what is outstanding)."""
        entries = []
        with self.lock:
            while self._leases and self._leases[0][0] <= now:
                _, _, rid, entry = heapq.heappop(self._leases)
                if self.outgoing.get(rid) is entry:
                    entries.append(self.outgoing.pop(rid))
        return entries

    def watchers(self) -> set[str]:
        """The readers watching the layers of a request this rank still serves."""
        with self.lock:
            return {r for rid, e in self.watched.items() if self.outgoing.get(rid) is e for r in e.watchers}

    def mark_finished(self, request_id: int) -> None:
        self.finished[request_id] = None
        while len(self.finished) > MAX_FINISHED:
            self.finished.popitem(last=False)

    # --- early messages ---------------------------------------------------------------------------------
    def park(self, reader: str, message: Any, handler: Handler) -> bool:
        """Park a (proven) message for a request this rank has not registered yet; False if it is registered or
        finished (handle it now)."""
        if message.request_id in self.finished:
            return False
        with self.lock:
            if message.request_id in self.outgoing:
                return False
        waiting = self.parked.setdefault(message.request_id, [])
        if len(waiting) >= MAX_PARKED_PER_REQUEST:  # only a peer holding the secret gets here: bounded all the same
            log.debug("dropped an early %s for request %d from %s", type(message).__name__, message.request_id, reader)
            return True
        waiting.append((time.monotonic(), reader, message, handler))
        while len(self.parked) > MAX_PARKED:
            self._drop_parked(*self.parked.popitem(last=False))
        return True

    def replay_parked(self, now: float) -> None:
        with self.lock:
            ready = [rid for rid in self.parked if rid in self.outgoing]
        for rid in ready:
            for _, reader, message, handler in self.parked.pop(rid):
                handler(reader, message)
        stale = [rid for rid, waiting in self.parked.items() if now - waiting[0][0] > EARLY_GRACE_S]
        for rid in stale:
            self._drop_parked(rid, self.parked.pop(rid))

    def _drop_parked(self, request_id: int, waiting: list) -> None:
        """The request never showed up here: claims are refused, other messages dropped."""
        self.finished[request_id] = None
        for _, reader, message, handler in waiting:
            if isinstance(message, StageClaim):
                handler(reader, message)  # now refused: the request counts as finished
