"""The per-peer pull of the gen side (``Pull``), and the one step enum every path moves through.

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

The stepped paths (staged, layer-wise, peers without a board) are advanced by the progress loop, a READ at a time:
CONNECT (the peer ready) -> LAYERS for layer-wise requests (the peer watched; waiting for layers to read) -> for a
staged piece SLOT (one of ours) and CLAIM (the ctx packs the box into one of its slots and grants it) -> READ, its
``ReadDone`` riding on it -> VERDICT; then CONNECT again for the next piece, layers or the state, or DONE.
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
    """Where a pull is. Direct: CONNECT -> READ (-> SLOT -> READ per gathered piece) -> [CHECK] -> [VERDICT] -> DONE.
    Stepped: CONNECT -> [LAYERS] -> [SLOT -> CLAIM] -> READ -> VERDICT, then CONNECT again while more is to be read
    (the next piece, group of layers, or the state), else DONE."""

    CONNECT = "waiting for the peer to be loaded"
    LAYERS = "waiting for ready layers"
    SLOT = "waiting for a staging slot"
    CLAIM = "waiting for a stage grant"
    READ = "READ in flight"
    CHECK = "hold check in flight"
    VERDICT = "waiting for the ctx verdict"
    DONE = "done"


IN_TRANSFER = (Step.CLAIM, Step.READ, Step.CHECK, Step.VERDICT)  # a transfer id the peer may answer about


@dataclass
class Proof:
    """A fast pull's proof that the peer still held the blocks when its READ finished: the params' promise, or the
    hold board read beside (``early``, same-host peers) or after the KV READ."""

    token: int = 0  # the request's hold token on the peer's board
    early: Any = None  # the board READ posted beside the KV READ; it lands in ``landing``
    landing: int | None = None  # the landing window of the hold check
    read_seen_ns: int = 0  # when the KV READ was seen finished (CLOCK_MONOTONIC)
    made_params: bool = False  # this peer made the params and shares our clock: its promise came in them
    promised_until_ns: int = 0  # that promise (0: none, or not one made for these params)
    promised: bool = False  # a promise (the params' or the early check's) ran past ``read_seen_ns``
    peer_blocks: tuple[int, ...] = ()  # the ctx rank's block ids of the request (gathered reads)


@dataclass
class Steps:
    """A stepped pull's progress: what is left to read, and its exchange with the peer."""

    plan: PeerRead | None = None  # the part being read (None: the next one is still to be planned)
    kv_left: bool = True  # the KV part is still to be read; ``read.state`` is read after it
    grant: StageGrant | None = None  # the answer to the claim of ``transfer_id``
    retry_at: float = 0.0
    layerwise: bool = False
    watching: bool = False
    started: bool = False  # something was posted to the peer (a READ, a claim, a watch, a notice)
    ready_below: int = 0
    planned_below: int = 0


@dataclass
class Pull:
    """One gen rank's pull of one request from one ctx rank; ``step`` says where it is, whatever its path.

    Fast pulls (``direct_eligible``: ``proof`` set) read everything in one READ (or gathered pieces) and are proven by
    the peer's promise or hold board; the others (``steps`` set) read step by step (``plan``: the whole slice, or for
    layer-wise requests the layers that were ready when it was planned), each READ carrying its ``ReadDone`` and
    proven by a verdict. What every pull has is here; what only one kind has is in its ``Proof`` or ``Steps``."""

    read: PeerRead  # all this rank reads from the peer (its state folded into the KV READ unless layer-wise)
    rank: RankCommInfo
    transfer_id: int = 0  # the READ or claim in progress (stepped pulls take a new one for each)
    step: Step = Step.CONNECT
    proof: Proof | None = None  # fast pulls
    steps: Steps | None = None  # stepped pulls
    waiting_since: float = 0.0  # when it began to wait for its peer (CONNECT): a loading failure after it ends it
    handle: Any = None
    verdict: str | None = None  # None until the peer answers about ``transfer_id``; "" means ok
    posted_at: float = 0.0
    posts_before: int = 0  # the receiver's READ count when it was posted (the transport check)
    timed_bytes: int = 0  # > 0 when this READ measures the transport
    slot: StagingSlot | None = None  # the staging slot pieces land in
    piece: int = 0  # the piece being read (gathered: of ``read``; staged: of ``steps.plan``)

    @classmethod
    def fast_pull(cls, read: PeerRead, rank: RankCommInfo, transfer_id: int, proof: Proof) -> Pull:
        return cls(read, rank, transfer_id, Step.READ, proof=proof)

    @classmethod
    def stepped_pull(cls, read: PeerRead, rank: RankCommInfo, layerwise: bool) -> Pull:
        steps = Steps(kv_left=read.has_kv, layerwise=layerwise)
        if layerwise:
            steps.planned_below = read.layers.start
        elif steps.kv_left:
            steps.plan = read
        return cls(read, rank, steps=steps)

    @property
    def fast(self) -> bool:
        return self.proof is not None

    @property
    def nbytes(self) -> int:
        return self.read.total_bytes

    @property
    def board_index(self) -> np.ndarray:
        token = self.proof.token if self.proof is not None else 0  # (only fast pulls read the board)
        return np.array([window_start(token, board_slots(self.rank.board))], dtype=np.int32)

    @property
    def engaged(self) -> bool:
        """It has posted to the peer and still has business with it (a READ or an answer in flight)."""
        if self.step is Step.DONE:
            return False
        return self.step is not Step.CONNECT if self.steps is None else self.steps.started

    @property
    def reading_piece(self) -> bool:
        """The stepped READ in progress is of a staged piece."""
        steps = self.steps
        return steps is not None and steps.kv_left and steps.plan is not None and steps.plan.staged

    @property
    def final_kv_read(self) -> bool:
        """The KV READ about to be posted is the last READ from this peer (no state follows)."""
        return self.last_step and self.read.state is None

    @property
    def last_step(self) -> bool:
        steps = self.steps
        return steps is None or not steps.layerwise or steps.planned_below >= self.read.layers.stop


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
