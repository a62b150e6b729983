"""Release a request: the one path that unpins its blocks on the ctx side.

A request ends when its readers are counted, it is cancelled, or its lease runs out. Its granted slots are
poisoned (a reader may still read them), its hold comes off the board before its blocks can be reused, and the
blocks are unpinned, or kept until the promise made in its params has run out (a reader may rely on it).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from nixl_kv.cache import CacheManager
from nixl_kv.ctx.table import Outgoing, RequestTable
from nixl_kv.errors import TransferError
from nixl_kv.holds import HoldBoard


class Release:
    def __init__(
        self,
        cache: CacheManager,
        board: HoldBoard | None,
        lease_ms: int,
        table: RequestTable,
        poison_granted: Callable[[int, float], None],
    ) -> None:
        self._cache = cache
        self._board = board
        self._lease_ms = lease_ms
        self._table = table
        self._poison_granted = poison_granted
        self._deferred: list[tuple[int, int]] = []  # (promised until ns, request id): unpins kept to a promise

    def finish(self, entry: Outgoing, failure: str | None) -> None:
        """End a request taken off the table: poison slots a reader may still read, unpin its blocks, resolve its
        future."""
        rid = entry.request.request_id
        self._table.mark_finished(rid)
        back_at = time.monotonic() + self._lease_ms / 1000  # (a READ from it then is of a refused request)
        self._poison_granted(rid, back_at)
        entry.request.transfer_end = time.monotonic()
        if entry.posted:
            self._board.clear(entry.token)  # before the blocks can be reused
        if entry.posted and entry.promised_until_ns > time.monotonic_ns():  # a reader may rely on it: keep it
            heapq.heappush(self._deferred, (entry.promised_until_ns, rid))
        else:
            self._cache.unpin(rid)
        if failure is None:
            entry.future.set_result(None)
        else:
            entry.future.set_exception(TransferError(failure))

    def expire(self, now: float) -> None:
        """End the requests whose lease ran out."""
        for entry in self._table.expired(now):
            self.finish(
                entry,
                f"lease of {self._lease_ms} ms expired with {len(entry.finished_readers)} of "
                f"{entry.expected_readers or '?'} readers done",
            )

    def release_deferred(self, everything: bool = False) -> None:
        """Unpin the requests whose promise has run out (``everything``: all of them, at close, once no READ
        can reach this rank any more)."""
        now_ns = time.monotonic_ns()
        while self._deferred and (everything or self._deferred[0][0] <= now_ns):
            _, rid = heapq.heappop(self._deferred)
            self._cache.unpin(rid)
