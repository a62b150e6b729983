"""Pending work polled soonest-due first, and less often the longer it runs past its expected end.

The gen side's direct pulls are polled by status checks and by the progress loop, a bounded batch per call. Polled
in the order they were posted, READs that will never end (from ctx peers that died) took every batch, and a READ
posted behind them was not looked at until they failed at their deadline: a live request waited 1.88 s during a
flood of 600 dead ones (issue 22). Here an entry is due again at the next call while it is young (within its
expected time plus ``LATE_S``), then after a quarter of its lateness, at most ``MAX_GAP_S``: a new READ is polled at
the next call, a late one is still seen within 25% of its run, and each of 600 stuck ones costs ten polls a second.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

LATE_S = 2e-3
LATE_FRACTION = 0.25
MAX_GAP_S = 0.1

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(eq=False)
class _Entry(Generic[V]):
    value: V
    since: float  # when it was put (its step began)
    expected_s: float
    seq: int


class PollQueue(Generic[K, V]):
    """Keys with a value and a due time. Not thread-safe: the caller serializes (the receiver's direct lock)."""

    def __init__(self) -> None:
        self._entries: dict[K, _Entry[V]] = {}
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()

    def put(self, key: K, value: V, now: float, expected_s: float = 0.0, due: float | None = None) -> None:
        """Add (or replace) ``key``, due at once (or at ``due``); ``expected_s`` is how long its work should take."""
        entry = _Entry(value, now, expected_s, next(self._seq))
        self._entries[key] = entry
        heapq.heappush(self._heap, (now if due is None else due, entry.seq, key))

    def hurry(self, key: K, now: float) -> None:
        """Make ``key`` due at once (what it waits for happened)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.seq = next(self._seq)  # its earlier place in the heap goes stale
            heapq.heappush(self._heap, (now, entry.seq, key))

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        return None if entry is None else entry.value

    def visit(self, now: float, limit: int, visit: Callable[[K, V], None], clock: Callable[[], float]) -> None:
        """Call ``visit(key, value)`` for up to ``limit`` due entries, soonest first; an entry the visit neither
        popped nor put again is due again later (``clock`` tells when the visit ended)."""
        taken: list[tuple[K, _Entry[V]]] = []
        while self._heap and self._heap[0][0] <= now and len(taken) < limit:
            _, seq, key = heapq.heappop(self._heap)
            entry = self._entries.get(key)
            if entry is not None and entry.seq == seq:
                taken.append((key, entry))
        for key, entry in taken:
            try:
                visit(key, entry.value)
            finally:
                if self._entries.get(key) is entry:
                    heapq.heappush(self._heap, (self._due_after(entry, clock()), entry.seq, key))

    def next_due(self) -> float:
        """When the soonest entry is due (inf when there is none)."""
        while self._heap:
            _, seq, key = self._heap[0]
            entry = self._entries.get(key)
            if entry is not None and entry.seq == seq:
                return self._heap[0][0]
            heapq.heappop(self._heap)
        return math.inf

    def values(self) -> Iterator[V]:
        return (entry.value for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @staticmethod
    def _due_after(entry: _Entry[V], now: float) -> float:
        late = now - entry.since - entry.expected_s
        return now if late < LATE_S else now + min(MAX_GAP_S, late * LATE_FRACTION)
