"""The ctx ranks a gen rank reads from: metadata loaded once, descriptor lists prepared once and reused.

Beyond ``max_peers`` prepared lists, the least recently used ones that no active request reads are released;
beyond ``max_peers`` loaded agents, the least recently used ones that no active request reads and no kept list
belongs to are forgotten (also agents loaded only to be notified), and any agent no request used for ``idle_s``
is forgotten with its lists (``forget_idle``, from the progress loop), so a long-lived gen instance serving ctx
instances that come and go (or die) does not accumulate remote agents. Thread-safe: the caller's thread and the progress
loop both reach peers. A newly loaded peer is connected at once (UCX would otherwise connect at the first READ).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from nixl_kv.errors import AgentError
from nixl_kv.holds import board_rows
from nixl_kv.interfaces import TransferAgent
from nixl_kv.layout import MemoryKind
from nixl_kv.state import RankCommInfo

PEER_IDLE_S = 120.0  # a loaded agent no request used for this long is forgotten (a dead or departed instance)
PEER_SWEEP_S = 1.0  # how often the progress loop looks for such agents (gen side: forget_idle; ctx side: readers)


class PeerDirectory:
    def __init__(
        self, agent: TransferAgent, max_peers: int, busy_agents: Callable[[], set[str]], idle_s: float = PEER_IDLE_S
    ) -> None:
        self._agent = agent
        self._max_peers = max_peers
        self._busy_agents = busy_agents
        self._idle_s = idle_s
        self._prepared: OrderedDict[tuple[str, bytes], Any] = OrderedDict()
        self._loaded: OrderedDict[str, float] = OrderedDict()  # agent -> last use (monotonic), least recent first
        self._lock = threading.RLock()

    def connect(self, rank: RankCommInfo) -> None:
        """Make the rank's agent reachable (READs and notifications); its metadata is loaded only once."""
        with self._lock:
            if rank.agent_name in self._loaded:
                self._touch(rank.agent_name)
                return
            self._agent.load_remote(rank.agent_metadata, rank.agent_name)
            self._loaded[rank.agent_name] = time.monotonic()
            with contextlib.suppress(AgentError):  # the first READ connects instead
                self._agent.connect(rank.agent_name)
            self._evict_idle()

    @property
    def loaded(self) -> int:
        return len(self._loaded)

    def descriptors(self, rank: RankCommInfo, coarse: bool) -> Any:
        """The rank's pool descriptors at the given granularity, prepared on first use."""
        return self._prepared_for(rank, ("coarse" if coarse else "fine").encode(), rank.layout.pools[0].memory)

    def board(self, rank: RankCommInfo) -> Any:
        """The windows of the rank's hold board, prepared on first use."""
        return self._prepared_for(rank, b"board", MemoryKind.DRAM)

    def _prepared_for(self, rank: RankCommInfo, what: bytes, memory: MemoryKind) -> Any:
        """Lists are kept by agent name and what they describe. A state is untrusted: one that names an agent we
        hold a list for but describes its memory otherwise is refused, never served the other state's list."""
        key = (rank.agent_name, what)
        described = rank.board if what == b"board" else rank.layout
        with self._lock:
            cached = self._prepared.get(key)
            if cached is not None:
                prepared, known = cached
                if known is not described and known != described:
                    raise AgentError(f"a second state names agent {rank.agent_name!r} with other memory")
                self._prepared.move_to_end(key)
                self._touch(rank.agent_name)
                return prepared
            self.connect(rank)
            rows = board_rows(rank.board) if what == b"board" else rank.layout.unit_descriptors(what == b"coarse")
            prepared = self._agent.prepare(rank.agent_name, rows, memory)
            self._prepared[key] = (prepared, described)
            self._evict_idle()
            return prepared

    def _touch(self, name: str) -> None:  # under the lock
        if name in self._loaded:
            self._loaded[name] = time.monotonic()
            self._loaded.move_to_end(name)

    def forget_idle(self, now: float) -> int:
        """Forget the agents (and their lists) no request used for ``idle_s``; returns how many."""
        with self._lock:
            busy = self._busy_agents()
            idle = [name for name, used in self._loaded.items() if now - used > self._idle_s and name not in busy]
            for name in idle:
                for key in [key for key in self._prepared if key[0] == name]:
                    self._agent.release_prepared(self._prepared.pop(key)[0])
                del self._loaded[name]
                with contextlib.suppress(AgentError):  # it is no longer ours either way
                    self._agent.forget_remote(name)
            return len(idle)

    def _evict_idle(self) -> None:  # under the lock
        busy = self._busy_agents()
        excess = max(0, len(self._prepared) - self._max_peers)
        for key in [k for k in self._prepared if k[0] not in busy][:excess]:
            self._agent.release_prepared(self._prepared.pop(key)[0])
        with_lists = {agent for agent, _ in self._prepared}
        excess = max(0, len(self._loaded) - self._max_peers)
        for name in [a for a in self._loaded if a not in busy and a not in with_lists][:excess]:
            del self._loaded[name]
            self._agent.forget_remote(name)
