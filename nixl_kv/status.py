"""Status checks of one side of a transceiver: local outcomes, deadlines, and the sync group's agreement.

Semantics of the reference's checkContextTransferStatus / checkGenTransferStatus: ``at_least`` None blocks
until every transfer is terminal (each is bounded by its lease), 0 is a pure poll, n > 0 waits up to the
configured interval for n. A request is reported only once every rank of its sync group agrees. Deadlines
(``kv_transfer_timeout_ms``) are observe-only unless in-flight cancellation is on: then a timeout seen by any
rank is shared through the same agreement, and every rank cancels its part, so the request ends in error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from nixl_kv.comm import CacheTransceiverComm
from nixl_kv.consensus import ready_everywhere, reduce_in_stages
from nixl_kv.metrics import TransferMetrics, TransferSummary, TransferTiming, merge_timings
from nixl_kv.requests import RequestState, RequestStatuses, TransferRequest

log = logging.getLogger(__name__)

DEFAULT_POLL_SLICE_MS = 10
RESCAN_S = 1e-3  # a spinning check rescans its futures this often (requests ended by other threads)
SAFETY_MARGIN_S = 5.0


def wait_interval_s(configured_ms: int | None, needs_progress: bool) -> float:
    """How long one status check waits for progress (the reference's future wait interval)."""
    if configured_ms is None:
        wait_ms = DEFAULT_POLL_SLICE_MS
    else:
        wait_ms = configured_ms if needs_progress else min(configured_ms, DEFAULT_POLL_SLICE_MS)
    return max(1, wait_ms) / 1000


def outcome_now(future: Future) -> str | None | bool:
    """None if the transfer succeeded, its error, or False while it is still running."""
    if not future.done():
        return False
    exception = future.exception()
    return None if exception is None else f"{type(exception).__name__}: {exception}"


def outcome_by_deadline(request: TransferRequest, future: Future, cancel: Callable[[int], bool]) -> str | None:
    """Wait for the transfer until its own deadline (plus a margin); one that outlives it is cancelled."""
    remaining = max(0.0, request.transfer_deadline - time.monotonic()) + SAFETY_MARGIN_S
    try:
        future.result(timeout=remaining)
    except FutureTimeout:  # not reached unless a bug kept the transfer alive past its deadline
        try:
            cancel(request.request_id)
        except Exception as exc:
            log.error("cancelling request %d after its deadline failed: %s", request.request_id, exc)
        return f"no outcome {SAFETY_MARGIN_S:.0f} s past the transfer's deadline; cancelled"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass
class SideRules:
    """How one side checks: who must agree, how long to wait, how to cancel, what 'done' means."""

    side: str
    select: CacheTransceiverComm  # ranks that must all be ready before a request is collected
    agree: list[CacheTransceiverComm]  # groups reduced in turn to agree on outcomes
    done_state: RequestState
    wait_ms: int | None
    timeout_ms: int | None
    inflight_cancel: bool
    cancel: Callable[[int], bool]
    clock_offset_s: float = 0.0  # this rank's monotonic clock -> rank 0's
    progress: Callable[[], int] = lambda: 0  # advances transfers on the checking thread, returns how many ended
    spin_budget_s: Callable[[], float] = lambda: 0.0  # how long a waiting check polls before it sleeps
    hand_off: Callable[[], None] = lambda: None  # the check sleeps: another thread must advance transfers


@dataclass
class TransferTracker:
    rules: SideRules
    metrics: TransferMetrics
    summary: TransferSummary
    futures: dict[int, tuple[TransferRequest, Future]] = field(default_factory=dict)
    awaiting: dict[int, TransferRequest] = field(default_factory=dict)
    completed: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    timed_out: set[int] = field(default_factory=set)
    cancel_requested: set[int] = field(default_factory=set)
    ended: deque[int] = field(default_factory=deque)  # ids whose futures ended, appended by any thread
    ready: set[int] = field(default_factory=set)  # ended and not yet collected: a check costs what ended
    wakeup: threading.Event = field(default_factory=threading.Event)

    def add(self, request: TransferRequest, future: Future) -> None:
        rid = request.request_id
        self.futures[rid] = (request, future)
        future.add_done_callback(lambda _, rid=rid: self._on_end(rid))

    def _on_end(self, rid: int) -> None:
        self.ended.append(rid)
        self.wakeup.set()

    def _ready_count(self) -> int:
        """Take in what ended since the last look (deque pops are atomic); returns how many are ready."""
        while self.ended:
            rid = self.ended.popleft()
            if rid in self.futures:  # the callback runs once the future is done
                self.ready.add(rid)
        return len(self.ready)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self.futures

    @property
    def idle(self) -> bool:
        return not self.futures and not self.awaiting

    def check(self, at_least: int | None, mark_complete: bool) -> RequestStatuses:
        rules = self.rules
        blocking = at_least is None
        if blocking and rules.inflight_cancel:
            raise ValueError("in-flight cancellation needs finite status checks: pass at_least=0 to poll")
        wait_s = wait_interval_s(rules.wait_ms, (at_least or 0) > 0)
        rules.progress()
        if (at_least or 0) > 0:
            self._wait_for_ready(at_least, wait_s)
        elif blocking and self.futures:  # each transfer ends by its own deadline; _collect enforces it
            latest = max(request.transfer_deadline for request, _ in self.futures.values())
            self._wait_for_ready(len(self.futures), latest - time.monotonic() + SAFETY_MARGIN_S)
        self._watch_deadlines()
        self._ready_count()
        selected = set(self.futures) if blocking else ready_everywhere(rules.select, list(self.ready))
        self._collect(selected, blocking)
        timed_out = self.timed_out if rules.inflight_cancel else set()
        outcome = reduce_in_stages(rules.agree, self.completed, self.failed, timed_out)
        if rules.inflight_cancel:
            self._cancel_timed_out(outcome.timed_out)
        return self._settle(outcome.completed, outcome.failed, mark_complete)

    def _wait_for_ready(self, at_least: int, wait_s: float) -> None:
        """Poll (advancing transfers on this thread) for about as long as the READs in flight take, then sleep
        until a future ends: a request whose READ ends meanwhile completes without waking another thread."""
        now = time.monotonic()
        deadline = now + wait_s
        spin_until = min(deadline, now + self.rules.spin_budget_s())
        while True:
            self.wakeup.clear()
            ready = self._ready_count()
            now = time.monotonic()
            if ready >= at_least or ready == len(self.futures) or now >= deadline:
                return
            if now < spin_until:
                self._spin(ready, at_least, min(spin_until, now + RESCAN_S))
                continue
            self.rules.hand_off()
            self.wakeup.wait(min(deadline - now, DEFAULT_POLL_SLICE_MS / 1000))
            spin_until = time.monotonic() + self.rules.spin_budget_s()

    def _spin(self, ready: int, at_least: int, until: float) -> None:
        """Advance transfers on this thread until ``at_least`` are ready (as counted by the ends it caused) or
        ``until``; the caller then takes in every end (another thread may have ended some)."""
        while ready < at_least and time.monotonic() < until:
            ready += self.rules.progress()

    def _watch_deadlines(self) -> None:
        limit_ms = self.rules.timeout_ms
        if limit_ms is None:
            return
        now = time.monotonic()
        for rid, (request, future) in self.futures.items():
            elapsed_ms = ((request.transfer_end if future.done() else now) - request.transfer_start) * 1000
            if elapsed_ms > limit_ms and rid not in self.timed_out:
                self.timed_out.add(rid)
                self.metrics.add(self.rules.side, timeouts=1)
                action = "cancelling" if self.rules.inflight_cancel else "observe-only"
                log.warning(
                    "%s transfer of request %d exceeded its deadline: %.0f ms > %d ms (%s)",
                    self.rules.side, rid, elapsed_ms, limit_ms, action,
                )  # fmt: skip

    def _collect(self, selected: set[int], blocking: bool) -> None:
        for rid in selected:
            if rid not in self.futures:
                continue
            request, future = self.futures[rid]
            error = outcome_by_deadline(request, future, self.rules.cancel) if blocking else outcome_now(future)
            if error is False:
                continue
            del self.futures[rid]
            self.ready.discard(rid)
            self.awaiting[rid] = request
            if error is None:
                self.completed.add(rid)
            else:
                request.error = error
                self.failed.add(rid)
                self.completed.discard(rid)

    def _cancel_timed_out(self, timed_out: set[int]) -> None:
        for rid in timed_out:
            self.timed_out.add(rid)  # remembered even before this rank registers the request
            entry = self.futures.get(rid)
            if entry is None or entry[1].done() or rid in self.cancel_requested:
                continue
            try:
                accepted = self.rules.cancel(rid)
            except Exception as exc:  # retried on the next check
                log.error("%s cancellation of request %d failed: %s", self.rules.side, rid, exc)
                accepted = False
            if accepted:
                self.cancel_requested.add(rid)
                self.metrics.add(self.rules.side, cancellations=1)

    def _settle(self, completed: set[int], failed: set[int], mark_complete: bool) -> RequestStatuses:
        statuses = RequestStatuses()
        rows: list[tuple[TransferRequest, str]] = []
        for rid in sorted(failed):
            past_deadline = rid in self.cancel_requested  # cancelled here because its deadline passed
            request = self._forget(rid)
            if request is not None:
                error = request.error or "a rank of the sync group failed this transfer"
                if past_deadline:  # the cause first: a caller maps it (a server to 504), the cancel is its effect
                    error = f"deadline of {self.rules.timeout_ms} ms passed (kv_transfer_timeout_ms): {error}"
                request.fail(error)
                statuses.error_request_ids.add(rid)
                rows.append((request, "error"))
        for rid in sorted(completed):
            request = self._forget(rid)
            if request is not None:
                statuses.completed_request_ids.add(rid)
                if mark_complete:
                    request.state = self.rules.done_state
                rows.append((request, "completed"))
        self._record(rows)
        return statuses

    def _forget(self, rid: int) -> TransferRequest | None:
        for ids in (self.completed, self.failed, self.timed_out, self.cancel_requested):
            ids.discard(rid)
        return self.awaiting.pop(rid, None)

    def _record(self, rows: list[tuple[TransferRequest, str]]) -> None:
        """Merge timings over the sync group (one collective per check) and count, log and summarise them."""
        offset = self.rules.clock_offset_s
        mine = [
            TransferTiming(r.request_id, r.transfer_start + offset, r.transfer_end + offset, r.transfer_bytes)
            for r, _ in rows
        ]
        gathered = [mine]
        for comm in self.rules.agree:
            if comm.size > 1:
                gathered = comm.allgather([t for timings in gathered for t in timings])
        if not rows:  # (after the collectives: every rank of the group makes them at every check)
            return
        merged = merge_timings(gathered)
        failures = sum(outcome == "error" for _, outcome in rows)
        done_bytes = sum(merged[r.request_id].bytes for r, outcome in rows if outcome == "completed")
        self.metrics.add(self.rules.side, requests=len(rows) - failures, failures=failures, bytes=done_bytes)
        self.summary.write([(merged[r.request_id], outcome) for r, outcome in rows])
