"""The per-peer pulls of the gen side, and the one step enum they move through.

The fast path: a request whose every part is read directly, posted and finished on the thread
that asked for it, and checked on the ctx rank's hold board instead of by a verdict round trip.

A pull whose peer is not loaded yet (first contact, or a peer being closed) waits first (CONNECT) while the peer
directory loads it on its own thread; then, per ctx peer, the pipeline is three steps, each one posted call and one
status poll:

1. READ: the request's KV (and state) from the ctx pools into ours, without a notification. Gathered reads
   (whole block-major ctx segments of a slice our layout cannot take directly) READ piece by piece into a
   staging slot of ours and are unpacked here after each (SLOT: waiting for a free one).
   When the peer that made the params shares our clock and they carry its hold promise, a KV READ seen finished
   within that promise is done (``ReadDone`` then goes out as a plain notification). Another peer on our clock
   is READ its board window while the KV READ is in flight, to the same end: if the token is there with a
   promise the KV READ was seen finished within, the pull is done. Otherwise:
2. CHECK: once the READ has finished, READ the request's window of the peer's hold board, with ``ReadDone`` as
   its notification (the peer releases on it). The hold token there proves the blocks were held throughout.
3. VERDICT: only when the token is absent (released, expired, or never posted): wait for the peer's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from nixl_kv.buffers import StagingSlot
from nixl_kv.holds import BOARD_SLOTS, board_slots, window_start
from nixl_kv.interfaces import PeerRead
from nixl_kv.protocol import StageGrant
from nixl_kv.state import RankCommInfo


class Step(str, Enum):
    CONNECT = "waiting for the peer to be loaded"
    SLOT = "waiting for a staging slot"
    READ = "READ in flight"
    CHECK = "hold check in flight"
    VERDICT = "waiting for the ctx verdict"
    DONE = "done"


@dataclass
class DirectPull:
    """One gen rank's direct read of one request from one ctx rank."""

    read: PeerRead
    rank: RankCommInfo
    token: int
    transfer_id: int
    step: Step = Step.READ
    waiting_since: float = 0.0  # when it began to wait for its peer (CONNECT): a loading failure after it ends it
    handle: Any = None
    early: Any = None  # the board READ posted beside the KV READ (same-host peers); it lands in ``landing``
    landing: int | None = None  # the landing window of the hold check
    read_seen_ns: int = 0  # when the KV READ was seen finished (CLOCK_MONOTONIC)
    made_params: bool = False  # this peer made the params and shares our clock: its promise came in them
    promised_until_ns: int = 0  # that promise (0: none, or not one made for these params)
    promised: bool = False  # a promise (the params' or the early check's) ran past ``read_seen_ns``
    verdict: str | None = None  # None until the peer answers; "" means ok
    posted_at: float = 0.0
    peer_blocks: tuple[int, ...] = ()  # the ctx rank's block ids of the request (gathered reads)
    piece: int = 0  # the gathered piece being read
    slot: Any = None  # the staging slot gathered pieces land in
    posts_before: int = 0  # the receiver's READ count when it was posted (the transport check)
    timed_bytes: int = 0  # > 0 when this READ measures the transport

    @property
    def nbytes(self) -> int:
        return self.read.total_bytes

    @property
    def board_index(self) -> np.ndarray:
        return np.array([window_start(self.token, board_slots(self.rank.board))], dtype=np.int32)


@dataclass
class Transfer:
    """One READ (direct, or of one staged piece) and the ctx peer's answers about it."""

    transfer_id: int
    handle: Any = None
    grant: StageGrant | None = None
    posted_at: float = 0.0
    posts_before: int = 0  # the receiver's READ count when this one was posted
    nbytes: int = 0  # > 0 when this READ measures the transport: a long run, alone in flight, peer warmed up
    finished: bool = False
    verdict: str | None = None  # None until the ctx peer answers; "" means ok


@dataclass
class SteppedPull:
    """Everything this gen rank takes from one ctx rank, advanced step by step by the progress loop.

    ``plan`` is the step being read: the whole slice, or for layer-wise requests the layers that were ready
    when it was planned (``planned_below`` tracks how far the steps reach, ``ready_below`` what the peer
    announced)."""

    full: PeerRead
    rank: RankCommInfo
    plan: PeerRead | None = None
    next_piece: int = 0
    kv_left: bool = True  # the KV part is still to be read; ``full.state`` is read after it
    current: Transfer | None = None
    slot: StagingSlot | None = None
    retry_at: float = 0.0
    done: bool = False
    layerwise: bool = False
    watching: bool = False
    started: bool = False  # something was posted to the peer (a READ, a claim, a watch, a notice)
    ready_below: int = 0
    planned_below: int = 0

    def __post_init__(self) -> None:
        self.kv_left = self.full.has_kv
        if self.layerwise:
            self.planned_below = self.full.layers.start
        elif self.kv_left:
            self.plan = self.full

    @property
    def reading_piece(self) -> bool:
        """The step in progress reads a staged piece."""
        return self.kv_left and self.plan is not None and self.plan.staged

    @property
    def final_kv_read(self) -> bool:
        """The KV READ about to be posted is the last READ from this peer (no state follows)."""
        return self.last_step and self.full.state is None

    @property
    def last_step(self) -> bool:
        return not self.layerwise or self.planned_below >= self.full.layers.stop


def direct_eligible(plan: list[PeerRead], ranks: tuple[RankCommInfo, ...], layerwise: bool) -> bool:
    """The fast path takes requests read in one direct READ per peer from ranks that keep a hold board of the
    protocol's size (a peer's state is untrusted: a board of another size is not read, whatever it claims)."""
    if layerwise:
        return False
    for read in plan:
        if read.expected_readers == 0:
            continue
        board = ranks[read.peer_rank].board
        if board is None or board_slots(board) != BOARD_SLOTS:
            return False
        if read.staged and not (read.gathered and read.state is None):
            return False
        if read.local_indices is None and read.state is None and not read.staged:
            return False
    return True
