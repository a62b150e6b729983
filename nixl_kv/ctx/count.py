"""Count a request's readers: each ``ReadDone`` (a reader's final READ finished, or it gave up) and ``NoReaders``.

A request is done when every expected reader reported (each report says how many to expect). A reader that did
not see the hold on the board after its READ gets a ``ReadVerdict``, ok only while the blocks are still pinned: a
reader that reports after the lease ended gets a refusal, never a false ok.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nixl_kv.ctx.readers import Readers
from nixl_kv.ctx.table import Outgoing, RequestTable
from nixl_kv.protocol import NoReaders, ReadDone, ReadVerdict

log = logging.getLogger(__name__)


class Count:
    def __init__(
        self,
        instance_id: str,
        table: RequestTable,
        readers: Readers,
        free_slot: Callable[[str, int, int], None],
        finish: Callable[[Outgoing, str | None], None],
    ) -> None:
        self._instance_id = instance_id
        self._table = table
        self._readers = readers
        self._free_slot = free_slot
        self._finish = finish

    def on_read_done(self, reader: str, message: ReadDone) -> None:
        if self._readers.forged(reader, message) or not self._readers.reachable(reader, message.reader_metadata):
            return
        self._free_slot(reader, message.transfer_id, message.request_id)
        entry = self._table.get(message.request_id)
        ours = entry is not None
        wrong = ours and bool(message.hold_token) and message.hold_token != entry.token
        mismatch = f"the reader's hold token does not match what request {message.request_id} pinned here" * wrong
        refusal = self._record(reader, message, mismatch)
        if ours and message.checks_hold and entry.posted and not wrong and not message.failed:
            return  # the reader saw the hold on the board after its READ: it needs no verdict
        verdict = ReadVerdict(self._instance_id, message.request_id, message.transfer_id, not refusal, refusal)
        if failure := self._readers.tell(reader, verdict):
            log.warning("could not answer reader %s of request %d: %s", reader, message.request_id, failure)

    def on_no_readers(self, reader: str, message: NoReaders) -> None:
        """Nothing is answered, so the reader's metadata is not loaded."""
        if self._readers.forged(reader, message):
            return
        if self._table.park(reader, message, self.on_no_readers):
            return
        with self._table.lock:
            entry = self._table.outgoing.get(message.request_id)
            if entry is None or entry.finished_readers:
                return
            del self._table.outgoing[message.request_id]
        log.debug("request %d: %s says no gen rank reads this rank's part", message.request_id, reader)
        self._finish(entry, None)

    def _record(self, reader: str, message: ReadDone, refusal: str = "") -> str:
        """Record one reader's report (``refusal``: a reason to fail it however it reports); returns "" for ok or
        the reason of refusal."""
        failure = refusal or ((message.reason or "the reader's READ failed") if message.failed else "")
        table = self._table
        with table.lock:
            entry = table.outgoing.get(message.request_id)
            if entry is None:
                return f"request {message.request_id} is not pinned here (unknown, finished, cancelled or expired)"
            if not (message.final or message.failed):
                return ""
            if entry.expected_readers is None:
                entry.expected_readers = message.expected_readers
            entry.finished_readers[reader] = failure
            finished = len(entry.finished_readers) >= entry.expected_readers
            if finished:
                del table.outgoing[message.request_id]
        if finished:
            failures = [f"{name}: {why}" for name, why in entry.finished_readers.items() if why]
            self._finish(entry, "; ".join(failures) if failures else None)
        return failure
