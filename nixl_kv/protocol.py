"""Control messages between a gen reader and a ctx rank, carried as NIXL notifications (DESIGN §5).

A gen rank's READ carries ``ReadDone`` as its completion notification, so the ctx rank learns the read has
finished; the ctx rank answers with ``ReadVerdict``: ok only if the request's blocks were still pinned then.
A gen rank whose READ failed sends ``ReadDone(failed=True)`` on its own so the ctx rank need not wait for
its lease to run out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nixl_kv.state import MAX_RANKS, bounds


@dataclass(frozen=True)
class ReadDone:
    ctx_instance_id: str
    request_id: int
    transfer_id: int
    reader_metadata: bytes
    expected_readers: int = field(metadata=bounds(1, MAX_RANKS))
    failed: bool = False
    reason: str = ""


@dataclass(frozen=True)
class ReadVerdict:
    ctx_instance_id: str
    request_id: int
    transfer_id: int
    ok: bool
    reason: str = ""
