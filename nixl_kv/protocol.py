"""Control messages between a gen reader and a ctx rank, carried as NIXL notifications (DESIGN §5).

Direct mode: the gen rank's READ carries ``ReadDone`` as its completion notification, so the ctx rank learns
the read has finished, and answers ``ReadVerdict``: ok only if the request's blocks were still pinned then.
Staged mode: the gen rank sends ``StageClaim`` for a box; the ctx rank packs it into a staging slot and
answers ``StageGrant`` (or a refusal, possibly worth retrying); the gen rank READs the slot with ``ReadDone``
as notification, and the ctx rank frees the slot and answers ``ReadVerdict``. ``final`` marks a reader's last
READ of the request: the ctx rank counts readers, not READs. A gen rank whose READ failed sends
``ReadDone(failed=True)`` so the ctx rank need not wait for its lease to run out, and ``NoReaders`` tells a
ctx rank that holds part of a request no gen rank needs. Layer-wise requests: the gen rank sends
``LayerWatch``; the ctx rank answers ``LayersReady`` now and whenever more of its layers are computed, and
the gen rank reads each group of ready layers as its own step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nixl_kv.state import MAX_BLOCKS, MAX_HEADS, MAX_LAYERS, MAX_RANKS, bounds


@dataclass(frozen=True)
class ReadDone:
    ctx_instance_id: str
    request_id: int
    transfer_id: int
    reader_metadata: bytes
    expected_readers: int = field(metadata=bounds(1, MAX_RANKS))
    final: bool = True
    failed: bool = False
    reason: str = ""
    checks_hold: bool = False  # the reader checks the hold board itself: no verdict unless the hold is not posted
    hold_token: int = 0  # the token the reader computed from its params: the ctx refuses a READ of other blocks
    proof: bytes = field(default=b"", metadata={"max_bytes": 64})  # the request's secret (nixl_kv.auth)


@dataclass(frozen=True)
class ReadVerdict:
    ctx_instance_id: str
    request_id: int
    transfer_id: int
    ok: bool
    reason: str = ""
    proof: bytes = field(default=b"", metadata={"max_bytes": 64})  # the request's secret (nixl_kv.auth)


@dataclass(frozen=True)
class StageClaim:
    """Ask a ctx rank to pack a box (global coordinates, half-open ranges) of a request into a staging slot."""

    ctx_instance_id: str
    request_id: int
    transfer_id: int
    reader_metadata: bytes
    num_blocks: int = field(metadata=bounds(1, MAX_BLOCKS))
    layers: tuple[int, ...] = field(metadata=bounds(0, MAX_LAYERS, max_items=2))
    heads: tuple[int, ...] = field(metadata=bounds(0, MAX_HEADS, max_items=2))
    blocks: tuple[int, ...] = field(metadata=bounds(0, MAX_BLOCKS, max_items=2))
    proof: bytes = field(default=b"", metadata={"max_bytes": 64})  # the request's secret (nixl_kv.auth)

    def problems(self) -> list[str]:
        ranges = (self.layers, self.heads, self.blocks)
        if any(len(pair) != 2 or pair[0] >= pair[1] for pair in ranges):
            return ["layers, heads and blocks are non-empty [start, stop) pairs"]
        return []


@dataclass(frozen=True)
class StageGrant:
    """The packed box is in the ctx rank's staging memory at ``address`` (``nbytes``), or it was refused."""

    ctx_instance_id: str
    request_id: int
    transfer_id: int
    ok: bool
    address: int = 0
    nbytes: int = 0
    retry: bool = False
    reason: str = ""
    proof: bytes = field(default=b"", metadata={"max_bytes": 64})  # the request's secret (nixl_kv.auth)


@dataclass(frozen=True)
class NoReaders:
    """Sent by the first gen rank of a request to each ctx rank that holds part of it but that no gen rank
    needs (an unused duplicate of a head, an empty CP share): it may release the request at once."""

    ctx_instance_id: str
    request_id: int
    reader_metadata: bytes
    proof: bytes = field(default=b"", metadata={"max_bytes": 64})  # the request's secret (nixl_kv.auth)


@dataclass(frozen=True)
class LayerWatch:
    """A gen rank asks a ctx rank to announce its layer-wise progress on a request (``LayersReady``)."""

    ctx_instance_id: str
    request_id: int
    reader_metadata: bytes
    proof: bytes = field(default=b"", metadata={"max_bytes": 64})  # the request's secret (nixl_kv.auth)


@dataclass(frozen=True)
class LayersReady:
    """Global layers below ``ready_below`` that the ctx rank holds are computed and may be read."""

    ctx_instance_id: str
    request_id: int
    ready_below: int = field(metadata=bounds(0, MAX_LAYERS))
    proof: bytes = field(default=b"", metadata={"max_bytes": 64})  # the request's secret (nixl_kv.auth)
