"""The ctx ranks a gen rank reads from: metadata loaded once, descriptor lists prepared once and reused.

Beyond ``max_peers`` prepared lists, the least recently used ones that no active request reads are released,
and an agent none of the kept lists belongs to is forgotten, so a long-lived gen instance serving ctx instances
that come and go does not accumulate remote agents.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from nixl_kv.errors import AgentError
from nixl_kv.interfaces import TransferAgent
from nixl_kv.state import RankCommInfo


class PeerDirectory:
    def __init__(self, agent: TransferAgent, max_peers: int, busy_agents: Callable[[], set[str]]) -> None:
        self._agent = agent
        self._max_peers = max_peers
        self._busy_agents = busy_agents
        self._prepared: OrderedDict[tuple[str, bytes], Any] = OrderedDict()
        self._loaded: set[str] = set()

    def connect(self, rank: RankCommInfo) -> None:
        """Make the rank's agent reachable (READs and notifications); its metadata is loaded only once."""
        if rank.agent_name in self._loaded:
            return
        loaded = self._agent.load_remote(rank.agent_metadata)
        if loaded != rank.agent_name:
            self._agent.forget_remote(loaded)
            raise AgentError(f"metadata of {rank.agent_name!r} describes agent {loaded!r}")
        self._loaded.add(loaded)

    def descriptors(self, rank: RankCommInfo, coarse: bool) -> Any:
        """The rank's pool descriptors at the given granularity, prepared on first use."""
        rows = rank.layout.unit_descriptors(coarse)
        key = (rank.agent_name, rows.tobytes())
        prepared = self._prepared.get(key)
        if prepared is not None:
            self._prepared.move_to_end(key)
            return prepared
        self.connect(rank)
        prepared = self._agent.prepare(rank.agent_name, rows, rank.layout.pools[0].memory)
        self._prepared[key] = prepared
        self._evict_idle()
        return prepared

    def _evict_idle(self) -> None:
        busy = self._busy_agents()
        excess = max(0, len(self._prepared) - self._max_peers)
        for key in [k for k in self._prepared if k[0] not in busy][:excess]:
            self._agent.release_prepared(self._prepared.pop(key))
            if all(agent != key[0] for agent, _ in self._prepared):
                self._loaded.discard(key[0])
                self._agent.forget_remote(key[0])
