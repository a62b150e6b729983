"""Prove a direct pull: its READ finished while the ctx rank still held the blocks (DESIGN §5.6).

In order of preference: the promise the params carry (the peer that made them, on our clock: a READ seen finished
within it is proven, nothing more to ask); the board window READ beside the KV READ (a peer on our clock: the hold
there with a promise past the READ proves it); the board window READ after the KV READ, with the ``ReadDone`` riding
on it (the hold token there proves the blocks were held throughout); and only when the token is absent, the ctx
rank's verdict (the direct driver waits for it).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from nixl_kv.errors import AgentError
from nixl_kv.gen.pull import Pull, Step
from nixl_kv.gen.reads import Reads
from nixl_kv.gen.side import GenSide, Incoming
from nixl_kv.gen.stuck import RequestKey
from nixl_kv.holds import promise_mask, promised_until, shows_token
from nixl_kv.interfaces import TransferStatus

log = logging.getLogger(__name__)

EARLY_CHECK_SECONDS = 10e-3  # READs expected (at the spin rate) to take longer check the board after they end
EARLY_CHECK_QUEUE = 8  # nor do READs posted behind this many direct pulls in flight


@dataclass(frozen=True)
class ReleaseNotice:
    """A ReadDone owed to a peer after a pull its promise covered (sent by the progress loop)."""

    peer: str
    key: RequestKey
    transfer_id: int
    readers: int
    token: int
    secret: bytes


class Prove:
    def __init__(self, side: GenSide, reads: Reads) -> None:
        self._side = side
        self._reads = reads
        self._notices: collections.deque[ReleaseNotice] = collections.deque()

    def early_check(self, pull: Pull, queued: int) -> None:
        """READ the hold's board window now, beside the KV READ, from a peer on our clock, for READs short enough
        to end within a promise (a longer one gains little and would outlive it); ``queued``: pulls in flight."""
        side = self._side
        if pull.proof.made_params or not side.on_our_clock(pull.rank.clock_domain):
            return  # the params told its promise (the board would say no more), or a clock we cannot compare
        if pull.nbytes > EARLY_CHECK_SECONDS * side.spin_gbps * 1e9 or queued >= EARLY_CHECK_QUEUE:
            return  # a long READ, or one queued behind a burst: it would be seen done too late to gain
        pull.proof.landing = side.landing.take()
        if pull.proof.landing is not None:  # else every window is in use: the check after the READ will do
            pull.proof.early = self.read_board(pull, b"")

    def early_check_ended(self, incoming: Incoming, pull: Pull) -> bool:
        """Once the board READ beside the KV READ is over: was the hold there, promised past the KV READ?"""
        agent, landing = self._side.agent, self._side.landing
        status = agent.status(pull.proof.early)
        if status is TransferStatus.IN_PROGRESS:
            return False
        agent.release_transfer(pull.proof.early)
        pull.proof.early = None
        if status is TransferStatus.DONE:
            mask = promise_mask(incoming.ctx_state.hold_key, pull.proof.token)
            until = promised_until(landing.window(pull.proof.landing), pull.proof.token, mask, time.monotonic_ns())
            pull.proof.promised = bool(until) and pull.proof.read_seen_ns < until
        landing.give(pull.proof.landing)
        pull.proof.landing = None
        return True

    def post_check(self, incoming: Incoming, pull: Pull) -> bool:
        """READ the peer's hold board, the ReadDone riding on it (CHECK: True); with no free window, send the
        ReadDone and ask for a verdict instead (False)."""
        pull.proof.landing = self._side.landing.take()
        checks_hold = pull.proof.landing is not None
        notification = self._side.read_done(
            incoming.key,
            incoming.secret,
            pull.transfer_id,
            pull.read.expected_readers,
            True,
            checks_hold,
            pull.proof.token,
        )
        if not checks_hold:
            self._side.agent.notify(pull.rank.agent_name, notification)
            return False
        pull.handle = self.read_board(pull, notification)
        pull.step = Step.CHECK
        return True

    def check_ended(self, pull: Pull) -> bool:
        """The CHECK READ finished: whether the hold token was on the board."""
        landing = self._side.landing
        held = shows_token(landing.window(pull.proof.landing), pull.proof.token)
        landing.give(pull.proof.landing)
        pull.proof.landing = None
        return held

    def read_board(self, pull: Pull, notification: bytes) -> Any:
        """READ the hold's board window of the peer into the pull's landing window."""
        side = self._side
        landing = np.array([pull.proof.landing], dtype=np.int32)
        board = side.peers.board(pull.rank)
        return self._reads.to_peer(
            pull.rank, side.agent.read, side.windows, landing, board, pull.board_index, notification
        )

    def release_hold(self, incoming: Incoming, pull: Pull) -> None:
        """After a pull the promise covered: the ReadDone that releases the blocks. Nothing waits on it (the
        promise holds the blocks meanwhile), so the loop thread sends it at its next tick, within its idle wait
        (2 ms): woken for it, it would take the GIL from the caller just as the caller returns."""
        read = pull.read
        notice = ReleaseNotice(
            pull.rank.agent_name,
            incoming.key,
            pull.transfer_id,
            read.expected_readers,
            pull.proof.token,
            incoming.secret,
        )
        self._notices.append(notice)

    @property
    def notices_queued(self) -> bool:
        return bool(self._notices)

    def send_release_notices(self) -> None:
        while self._notices:
            notice = self._notices.popleft()
            message = self._side.read_done(
                notice.key, notice.secret, notice.transfer_id, notice.readers, True, True, notice.token
            )
            try:
                self._side.agent.notify(notice.peer, message)
            except AgentError as exc:  # the peer releases at its lease end
                log.info("could not tell %s that request %s was read: %s", notice.peer, notice.key, exc)
