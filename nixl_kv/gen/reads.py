"""Posting READs to a ctx peer and timing them (a peer whose large READs crawl is warned about once); when a request
must start its READs by, and when one still in flight is given up."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from nixl_kv.errors import AgentError
from nixl_kv.gen.pull import Step
from nixl_kv.gen.side import GenSide, Incoming
from nixl_kv.state import RankCommInfo

log = logging.getLogger(__name__)

SLOW_CHECK_BYTES = 64 << 20  # READs at least this large are timed against SLOW_GBPS
# below: a fallback path (DRAM, 128 MiB here: TCP 1.6-2.0 GB/s, shared memory 5.3-5.5; VRAM: cuda_ipc ~390)
SLOW_GBPS = {"DRAM": 3.0, "VRAM": 20.0}
LONG_RUN_BYTES = 1 << 20  # state READs are timed for the transport check only if their rows average this
# A pull whose peer got ready (first contact) this close to its deadline (or within this part of its budget, for short
# ones) fails instead of starting its READ: the READ would outlive its request, its destination poisoned until the
# transport ends it (NIXL: ~1 s, ``ucx_config``).
MIN_READ_BUDGET_S = 0.2
MIN_READ_BUDGET_PART = 0.25
GIVE_UP_AHEAD_S = 0.02  # a READ still in flight is given up this long before its deadline (or this part of the budget)
GIVE_UP_AHEAD_PART = 0.01


class Reads:
    def __init__(self, side: GenSide) -> None:
        self._side = side
        self.slow_peers: dict[str, float] = {}  # peers whose large READs ran below SLOW_GBPS (warned once)
        self._warmed: set[str] = set()
        self.posts = 0  # READs posted, ever: a READ timed while another started is no clean measurement

    def to_peer(self, rank: RankCommInfo, call: Callable[..., Any], *args: Any) -> Any:
        """An agent call that posts a READ to the peer. If the agent refuses it, the connection may be broken (NIXL
        refuses a peer whose endpoint failed): the peer is closed once no request is engaged with it, and the next
        request that needs it loads it again."""
        try:
            return call(*args)
        except AgentError:
            self._side.stuck.close_when_free({rank.agent_name})
            raise

    def measurable(self, agent_name: str, nbytes: int, long_runs: bool) -> int:
        """Bytes to time for the transport check, or 0: only long runs (scattered head slabs are slow on any
        path), only READs alone in flight (concurrent ones share the link), never a peer's first (warm-up)."""
        self.posts += 1
        first = agent_name not in self._warmed
        self._warmed.add(agent_name)
        alone = len(self._side.requests) <= 1  # this request only: its READ is alone unless it reads several peers
        return nbytes if long_runs and alone and not first else 0

    def transport_check(self, agent_name: str, nbytes: int, posted_at: float, posts_before: int, now: float) -> None:
        """Warn once per peer when large READs crawl: UCX fell back to a host-staged or TCP path."""
        memory = self._side.cache.layout.pools[0].memory
        seconds = now - posted_at
        shared = self.posts != posts_before  # another READ started meanwhile: not a clean measurement
        if nbytes < SLOW_CHECK_BYTES or seconds <= 0 or shared or agent_name in self.slow_peers:
            return
        gbps = nbytes / seconds / 1e9
        if gbps < SLOW_GBPS[memory.value]:
            self.slow_peers[agent_name] = gbps
            log.warning(
                "READs from %s run at %.2f GB/s (%d MiB in %.1f ms) on %s: UCX is likely staging through host memory "
                "or using TCP; check UCX_TLS (cuda_ipc for NVLink, rc/dc with GPUDirect RDMA across hosts, cma/sm "
                "within a host; between processes on one GPU, or GPUs without NVLink, UCX's cuda_ipc serves READs "
                "only with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on, which nixl_kv sets unless you set it)",
                agent_name, gbps, nbytes >> 20, seconds * 1e3, memory.value,
            )  # fmt: skip


def start_by(incoming: Incoming) -> float:
    """After this, no READ of the request starts (it would outlive its request)."""
    budget = incoming.deadline - incoming.request.transfer_start
    return incoming.deadline - min(MIN_READ_BUDGET_S, MIN_READ_BUDGET_PART * budget)


def give_up_at(incoming: Incoming) -> float:
    """When a READ still in flight is given up: a little before the deadline, so that the request is reported ended
    by its deadline even when the thread that ends it was kept from the CPU or the GIL for a while."""
    budget = incoming.deadline - incoming.request.transfer_start
    return incoming.deadline - min(GIVE_UP_AHEAD_S, GIVE_UP_AHEAD_PART * budget)


def too_late_to_start(incoming: Incoming, now: float) -> bool:
    return now > start_by(incoming)


def why_expired(incoming: Incoming, now: float) -> str | None:
    """Why the request must end now, or None: past ``give_up_at``; or past ``start_by`` with a pull still waiting
    for its peer (it could not start its READ any more, so it ends now rather than at the deadline)."""
    if now > give_up_at(incoming):
        prefix = "deadline passed"
    elif now > start_by(incoming) and any(pull.step is Step.CONNECT for pull in incoming.pulls):
        prefix = "too close to the deadline to start a READ"
    else:
        return None
    waiting = [f"{p.rank.agent_name} ({p.step.value})" for p in incoming.pulls if p.step is not Step.DONE]
    return f"{prefix} waiting for {', '.join(waiting)}"
