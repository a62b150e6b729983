"""What every step of the gen side uses: the rank's collaborators (``GenSide``) and its request table."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from nixl_kv.buffers import CacheTransBufferManager
from nixl_kv.cache import CacheManager
from nixl_kv.control import Control
from nixl_kv.gen.pull import Pull
from nixl_kv.gen.stuck import RequestKey, StuckReads
from nixl_kv.holds import LandingRing
from nixl_kv.interfaces import Formatter, ReadRequest, TransferAgent
from nixl_kv.loop import ProgressLoop
from nixl_kv.metrics import TransferMetrics
from nixl_kv.peers import PeerDirectory
from nixl_kv.protocol import ReadDone, ReadVerdict, StageGrant
from nixl_kv.requests import TransferRequest
from nixl_kv.state import ContextPhaseParams, DataTransceiverState

log = logging.getLogger(__name__)


@dataclass
class Incoming:
    """One request being received, from admit to finish."""

    key: RequestKey
    request: TransferRequest
    ctx_state: DataTransceiverState
    num_blocks: int
    deadline: float
    future: Future
    read_request: ReadRequest | None = None  # (plan: the request's reads as planned)
    pulls: list[Pull] = field(default_factory=list)  # one per ctx peer
    fast: bool = False  # its pulls take the fast path (``nixl_kv.gen.direct``), else the stepped one
    secret: bytes = b""  # the request's secret from its params: our proof to the ctx, and the ctx's to us
    params: ContextPhaseParams | None = None  # decoded by admit
    stuck: bool = False  # a READ could not be cancelled: the blocks stay pinned until the agent lets go


def proven_answer(side: GenSide, incoming: Incoming, pull: Pull, sender: str, answer: ReadVerdict | StageGrant) -> bool:
    """The one check of a peer's answer (a verdict, a stage grant) to a pull: from the pull's peer, about its
    request, and proven with the request's secret. A misdirected answer is logged, a forged one counted."""
    if sender != pull.rank.agent_name or answer.request_id != incoming.key[1]:
        log.warning("ignored an answer from %s for transfer %d it does not own", sender, answer.transfer_id)
        return False
    return not side.control.forged(answer, incoming.secret, sender)


class Requests:
    """The requests this rank receives; ``lock`` guards the tables (any thread admits, cancels and ends)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: dict[RequestKey, Incoming] = {}
        self.by_request: dict[int, RequestKey] = {}
        self.stepped: dict[RequestKey, Incoming] = {}  # requests the loop thread advances step by step

    def get(self, key: RequestKey) -> Incoming | None:
        with self.lock:
            return self.active.get(key)

    def find(self, request_id: int) -> Incoming | None:
        with self.lock:
            key = self.by_request.get(request_id)
            return self.active.get(key) if key else None

    def known(self, key: RequestKey, request_id: int) -> bool:
        """Under ``lock``: a retry must not end the original."""
        return key in self.active or request_id in self.by_request

    def add(self, incoming: Incoming) -> None:
        """Under ``lock``."""
        self.active[incoming.key] = incoming
        self.by_request[incoming.request.request_id] = incoming.key
        if not incoming.fast:
            self.stepped[incoming.key] = incoming

    def remove(self, incoming: Incoming) -> None:
        with self.lock:
            self.active.pop(incoming.key, None)
            self.stepped.pop(incoming.key, None)
            self.by_request.pop(incoming.request.request_id, None)

    def all(self) -> list[Incoming]:
        with self.lock:
            return list(self.active.values())

    def all_stepped(self) -> list[Incoming]:
        with self.lock:
            return list(self.stepped.values())

    def __len__(self) -> int:
        return len(self.active)

    def __iter__(self) -> Iterator[Incoming]:
        return iter(self.all())


@dataclass
class GenSide:
    """The gen rank's collaborators, shared by every step (read at call time: tests may swap ``clock_domain``)."""

    loop: ProgressLoop
    cache: CacheManager
    self_state: DataTransceiverState
    self_rank: int
    formatter: Formatter
    staging: CacheTransBufferManager
    metrics: TransferMetrics
    control: Control
    requests: Requests
    landing: LandingRing | None
    views: Any
    metadata: bytes = b""  # this agent's metadata, carried by every message that needs an answer
    local: dict[bool, Any] = field(default_factory=dict)  # our pools' prepared lists, by granularity (coarse)
    windows: Any = None  # our landing ring's prepared list
    peers: PeerDirectory | None = None
    stuck: StuckReads | None = None
    clock_domain: str = ""
    spin_gbps: float = 1.0
    transfer_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def agent(self) -> TransferAgent:
        return self.loop.agent

    def on_our_clock(self, clock_domain: str) -> bool:
        return bool(self.clock_domain) and clock_domain == self.clock_domain

    def read_done(
        self,
        key: RequestKey,
        secret: bytes,
        transfer_id: int,
        expected_readers: int,
        final: bool,
        checks_hold: bool,
        hold_token: int = 0,
        failure: str = "",
    ) -> bytes:
        """A proven ``ReadDone``, encoded; ``failure``: the reader gives up (the ctx rank need not wait its lease)."""
        done = ReadDone(
            ctx_instance_id=key[0],
            request_id=key[1],
            transfer_id=transfer_id,
            reader_metadata=self.metadata,
            expected_readers=expected_readers,
            final=final,
            failed=bool(failure),
            reason=failure[:512],
            checks_hold=checks_hold,
            hold_token=hold_token,
        )
        return self.control.encode(done, secret)
