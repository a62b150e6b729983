"""The peer directory: the remote agents a rank talks to, on both sides. The ctx ranks a gen rank reads from have
their metadata loaded once and descriptor lists prepared once and reused; the gen ranks a ctx rank answers are loaded
from their own messages (``reachable``).

Slow work happens on the directory's own worker thread, never on a thread that posts READs: loading a peer's
metadata, connecting to it and preparing its lists (~20 ms at first contact here; to a peer across hosts a TCP
connect, and NIXL holds its agent's lock meanwhile), closing peers and forgetting idle ones. A request asks ``ready``
(a lookup) before it posts to a peer; when the peer is not ready, its loading is queued once and the request waits,
bounded by its deadline, while requests to peers already loaded go on. ``warm`` queues the same and waits for it
(``connect_to``, and callers that must reach a peer now). The worker does one thing at a time, in order, so the
agent's peers and lists change on that thread only, but for agents met by their own messages (``reachable``, and
``forget`` when an answer cannot reach one): the thread that answers them loads them, since the answer is due now.

Beyond ``max_peers`` prepared lists, the least recently used ones that no active request reads are released;
beyond ``max_peers`` loaded agents, the least recently used ones that no active request reads and no kept list
belongs to are forgotten (also agents loaded only to be notified), and any agent no request used for ``idle_s``
is forgotten with its lists (``forget_idle``, from the progress loop), so a long-lived gen instance serving ctx
instances that come and go (or die) does not accumulate remote agents. A newly loaded peer is connected at once
(UCX would otherwise connect at the first READ).

A peer whose READs outlive their requests, or whose connection broke, is held back (``hold_back``: no new READ is
posted to it) and, once no request still reads from it, closed (``close_peer``, see ``nixl_kv.gen.stuck``); the next
request that needs the peer loads it again from its params.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from nixl_kv.errors import AgentError
from nixl_kv.holds import board_rows
from nixl_kv.interfaces import TransferAgent
from nixl_kv.layout import MemoryKind
from nixl_kv.state import RankCommInfo

log = logging.getLogger(__name__)

PEER_IDLE_S = 120.0  # a loaded agent no request used for this long is forgotten (a dead or departed instance)
PEER_SWEEP_S = 1.0  # how often the progress loop looks for such agents (gen side: forget_idle; ctx side: readers)
WARM_TIMEOUT_S = 30.0  # the longest ``warm`` waits for the worker
# After each loading it started itself, the worker rests as long as it took (at most MAX_PACE_S): it holds the agent's
# lock (NIXL's is one per agent) for most of a loading, and back to back, 600 loadings of dead peers held it for most
# of a flood, so that every call for a live request waited behind one. PACE: half the agent's time, at most.
MAX_PACE_S = 0.01
# FRESH: at most MAX_FRESH peers are in first contact at once (loaded, no READ from them done yet); other new peers
# wait their turn. A flood of 600 dead peers put 600 connections in UCX's worker at once, which made every progress
# call (every status check and notification poll, under the agent's lock) 5 times dearer for live requests. The limit
# bounds work, never liveness: a fresh peer gives its slot back when a READ from it completes, when it is closed or
# forgotten, when no active request needs it any more (its requests ended: ``ended``), or FRESH_S after its loading
# (a live peer proves itself in milliseconds; one that hangs must not hold a slot for its requests' whole lease). A
# slot given back starts the newest loading kept for later first: in a flood the oldest ones belong to requests
# closest to their deadline (a flood of hung peers once held every slot for good, and no new ctx was ever reached).
MAX_FRESH = 32
FRESH_S = 1.0
UNWANTED_CHECK_S = 0.1  # a loading queued longer than this is skipped if no active request needs the peer any more
EVICT_IDLE_S = 5.0  # beyond max_peers, only lists and agents no request used for this long are released
CLOSE_TIMEOUT_S = 5.0  # the longest ``close`` waits for the job the worker is running
FINE, COARSE, BOARD = b"fine", b"coarse", b"board"  # the lists a peer may need: pool units, pool segments, board
URGENT, NORMAL = 0, 1  # the worker's job priorities
Job = tuple[Future, Callable[..., Any], tuple[Any, ...]]


def kv_list(coarse: bool) -> bytes:
    return COARSE if coarse else FINE


class PeerDirectory:
    def __init__(
        self,
        agent: TransferAgent,
        max_peers: int,
        busy_agents: Callable[[], set[str]],
        idle_s: float = PEER_IDLE_S,
        on_change: Callable[[str], None] = lambda name: None,
        evict_idle_s: float = EVICT_IDLE_S,
    ) -> None:
        """``on_change(name)`` runs on the worker after each job about a peer (it got ready, failed or was closed):
        the receiver wakes the requests waiting for it, which poll nothing meanwhile."""
        self._agent = agent
        self._max_peers = max_peers
        self._busy_agents = busy_agents
        self._idle_s = idle_s
        self._evict_idle_s = evict_idle_s
        self._on_change = on_change
        self._prepared: OrderedDict[tuple[str, bytes], tuple[Any, object]] = OrderedDict()  # list, what it describes
        self._loaded: OrderedDict[str, float] = OrderedDict()  # agent -> last use (monotonic), least recent first
        self._queued: dict[str, float] = {}  # agents whose loading ``ready`` queued (not yet done) -> when
        self._failed: dict[str, tuple[float, str]] = {}  # agent -> (when, why) its last loading failed
        self._held_back: set[str] = set()
        self._unclosed: set[str] = set()  # held back; the agent could not close them yet
        self._closing: set[str] = set()  # a close is queued
        self._fresh: dict[str, float] = {}  # loaded, no READ from it done yet -> when it was loaded (see FRESH)
        self._deferred: collections.deque[tuple[RankCommInfo, tuple[bytes, ...]]] = collections.deque()
        self._wanting: collections.Counter[str] = collections.Counter()  # gen requests admitted, not ended, per peer
        self._lock = threading.RLock()
        self._jobs: queue.PriorityQueue[tuple[int, int, Job | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._stopping = False
        self._worker = threading.Thread(target=self._serve, name="nixl_kv-peers", daemon=True)
        self._worker.start()

    # --- the request path: lookups only ---------------------------------------------------------------------
    def ready(self, rank: RankCommInfo, lists: Iterable[bytes]) -> bool:
        """Whether the rank is loaded with ``lists`` prepared, so posting to it does no slow work now. If not, its
        loading is queued (once; never for a peer held back) and False returned: ask again later."""
        name, lists = rank.agent_name, tuple(lists)
        with self._lock:
            if name in self._held_back:
                return False
            if name in self._loaded and all(self._cached(rank, what) is not None for what in lists):
                self._touch(name)
                return True
            if name not in self._queued:
                self._queued[name] = time.monotonic()
                self._submit(self._warm_in_background, rank, lists)
        return False

    def failure(self, name: str, since: float) -> str:
        """Why loading ``name`` failed, if it failed after ``since`` (monotonic); "" otherwise."""
        with self._lock:
            when, why = self._failed.get(name, (0.0, ""))
        return why if when >= since else ""

    def loaded_now(self, name: str) -> bool:
        with self._lock:
            return name in self._loaded

    def held_back(self, name: str) -> bool:
        with self._lock:
            return name in self._held_back

    @property
    def loaded(self) -> int:
        return len(self._loaded)

    def descriptors(self, rank: RankCommInfo, coarse: bool) -> Any:
        """The rank's pool descriptors at the given granularity (prepared now, on the worker, if not yet)."""
        return self._list(rank, kv_list(coarse))

    def board(self, rank: RankCommInfo) -> Any:
        """The windows of the rank's hold board (prepared now, on the worker, if not yet)."""
        return self._list(rank, BOARD)

    def connect(self, rank: RankCommInfo) -> None:
        """Make the rank's agent reachable (READs and notifications) now; its metadata is loaded only once."""
        with self._lock:
            if rank.agent_name in self._loaded:
                self._touch(rank.agent_name)
                return
        self.warm(rank, ())

    def warm(self, rank: RankCommInfo, lists: Iterable[bytes], timeout_s: float = WARM_TIMEOUT_S) -> None:
        """Load the rank and prepare ``lists`` now (on the worker, waiting for it); AgentError if that fails."""
        future: Future = self._submit(self._warm, rank, tuple(lists))
        try:
            future.result(timeout=timeout_s)
        except FutureTimeout:
            raise AgentError(f"loading agent {rank.agent_name} took longer than {timeout_s:.0f} s") from None

    # --- agents met by their own messages: the ctx side's readers -------------------------------------------
    def reachable(self, name: str, metadata: bytes) -> bool:
        """An agent whose (proven) message needs an answer now: loaded on the calling thread from the metadata the
        message carries (a NIXL agent can only notify agents it loaded); False if that metadata is unusable. It is
        forgotten like any other agent (idle, or beyond ``max_peers``): its next message carries its metadata again."""
        with self._lock:
            if name in self._loaded:
                self._touch(name)
                return True
        try:
            self._agent.load_remote(metadata, name)
        except AgentError as exc:
            log.warning("reader %s sent unusable metadata: %s", name, exc)
            return False
        with self._lock:
            self._loaded[name] = time.monotonic()  # (never fresh: no READ from it will prove it)
            crowded = len(self._loaded) > self._max_peers
        if crowded:
            self._submit(self._evict, urgent=True)
        return True

    def forget(self, name: str) -> None:
        """Unload an agent a notification could not reach (its connection may have broken), unless a list of it is
        kept or a request reads from it (the gen side's own failure handling closes those)."""
        with self._lock:
            if name not in self._loaded or any(agent == name for agent, _ in self._prepared):
                return
            if name in self._busy_agents():
                return
            del self._loaded[name]
            freed = self._fresh.pop(name, None) is not None
            try:
                self._agent.forget_remote(name)
            except AgentError as exc:
                log.info("could not forget agent %s: %s", name, exc)
        if freed and self._deferred:
            self._submit(self._resume)

    # --- changes: queued on the worker ------------------------------------------------------------------
    def when_loaded(self, rank: RankCommInfo, send: Callable[[], None]) -> None:
        """Queue ``send`` (a notification) to run on the worker once the rank is loaded: a peer met only to be told
        something costs no thread that posts READs. Best effort: a failure is logged."""
        self._submit(self._load_then, rank, send)

    def hold_back(self, names: Iterable[str]) -> None:
        """No new READ to these peers until they are closed."""
        with self._lock:
            self._held_back.update(names)

    def close_peer(self, name: str) -> None:
        """Queue closing the peer: the agent closes it (ending its READs in flight where it can), its lists are
        released and it is forgotten; it stays held back until then. An agent that cannot close it yet (READs in
        flight it cannot end) leaves it loaded and held back: ``unclosed``, to be closed again later."""
        with self._lock:
            self._held_back.add(name)
            if name in self._closing:
                return
            self._closing.add(name)
        self._submit(self._close, name, urgent=True)

    def unclosed(self) -> set[str]:
        with self._lock:
            return set(self._unclosed)

    def forget_idle(self, now: float) -> None:
        """Queue forgetting the agents (and their lists) no request used for ``idle_s``."""
        self._submit(self._forget_idle, now, urgent=True)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the worker: queued jobs are dropped, the running one is waited for (bounded: a load blocked in the
        transport must not hang the close)."""
        self._stopping = True
        self._jobs.put((URGENT, -1, None))
        self._worker.join(timeout_s)
        if self._worker.is_alive():
            log.warning("the peer directory's worker is still busy after %.0f s (blocked in the transport)", timeout_s)

    # --- the worker -------------------------------------------------------------------------------------
    def _submit(self, function: Callable[..., Any], *args: Any, urgent: bool = False) -> Future:
        """Queue a job; ``urgent`` ones (closing a peer ends READs that hold the gen's memory) go before loadings."""
        future: Future = Future()
        if self._stopping:
            future.set_exception(AgentError("the peer directory is closed"))
        else:
            self._jobs.put((URGENT if urgent else NORMAL, next(self._order), (future, function, args)))
        return future

    def _serve(self) -> None:
        while (job := self._next_job()) is not None:
            future, function, args = job
            if self._stopping or not future.set_running_or_notify_cancel():
                future.cancel()
                continue
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)

    def _next_job(self) -> Job | None:
        """The next job; while loadings are kept for later, waiting no longer than until the oldest first contact
        gives its slot back (FRESH_S), and then resuming them."""
        while True:
            with self._lock:
                wait = None
                if self._deferred:
                    oldest = min(self._fresh.values()) if len(self._fresh) >= MAX_FRESH else 0.0
                    wait = max(0.0, oldest + FRESH_S - time.monotonic() + 0.001)
            try:
                return self._jobs.get(timeout=wait)[2]
            except queue.Empty:
                self._resume()

    def _warm_in_background(self, rank: RankCommInfo, lists: tuple[bytes, ...]) -> None:
        """A loading ``ready`` queued; skipped once no active request needs the peer any more (``wanting``): after a
        flood of requests to dead peers failed at their deadline, the loadings still queued for them cost nothing."""
        name = rank.agent_name
        with self._lock:
            waited = time.monotonic() - self._queued.get(name, 0.0)
            if waited > UNWANTED_CHECK_S and name not in self._wanting:
                self._queued.pop(name, None)  # (a request that asked since queues it again at its next look)
                return
        if self._defer(rank, lists):
            return
        started = time.monotonic()
        try:
            self._warm(rank, lists)
            with self._lock:
                self._failed.pop(name, None)
        except Exception as exc:  # noqa: BLE001 - requests waiting for the peer fail with it instead of timing out
            if not isinstance(exc, AgentError):
                log.exception("loading agent %s failed unexpectedly", name)
            with self._lock:
                self._failed[name] = (time.monotonic(), str(exc))
        finally:
            with self._lock:
                self._queued.pop(name, None)
            self._on_change(name)
            time.sleep(min(MAX_PACE_S, time.monotonic() - started))  # see PACE

    def _defer(self, rank: RankCommInfo, lists: tuple[bytes, ...]) -> bool:
        """Keep a new peer's loading for later while MAX_FRESH loaded peers are in first contact (see FRESH); True
        if it was kept."""
        with self._lock:
            if rank.agent_name in self._loaded or self._room():
                return False
            self._deferred.append((rank, lists))
            return True

    def _room(self) -> bool:
        """Under the lock: whether a first-contact slot is free (those FRESH_S old given back first)."""
        stale = time.monotonic() - FRESH_S
        for name in [name for name, loaded in self._fresh.items() if loaded < stale]:  # (at most MAX_FRESH)
            del self._fresh[name]
        return len(self._fresh) < MAX_FRESH

    def _resume(self) -> None:
        """Start the loadings kept for later, newest first, as far as there is room (and as still wanted)."""
        while True:
            with self._lock:
                if not self._deferred or not self._room():
                    return
                rank, lists = self._deferred.pop()
            self._warm_in_background(rank, lists)

    @property
    def first_contacts(self) -> int:
        """Peers holding a first-contact slot now (at most MAX_FRESH)."""
        with self._lock:
            self._room()
            return len(self._fresh)

    def proven(self, name: str) -> None:
        """A READ from the peer completed: it is no longer a first contact (see FRESH)."""
        if name in self._fresh:  # (read without the lock: the common case costs nothing)
            with self._lock:
                freed = self._fresh.pop(name, None) is not None
            if freed and self._deferred:
                self._submit(self._resume)

    def wanting(self, names: Iterable[str]) -> None:
        """A gen request admitted that reads (or will read) from these peers (until ``ended``)."""
        with self._lock:
            self._wanting.update(names)

    def ended(self, names: Iterable[str]) -> None:
        """A request ``wanting`` these peers ended: a fresh one no other active request needs gives its slot back."""
        freed = False
        with self._lock:
            for name in names:
                self._wanting[name] -= 1
                if self._wanting[name] <= 0:
                    del self._wanting[name]
                    freed = self._fresh.pop(name, None) is not None or freed
        if freed and self._deferred:
            self._submit(self._resume, urgent=True)

    def _load_then(self, rank: RankCommInfo, send: Callable[[], None]) -> None:
        try:
            self._load(rank)
            send()
        except Exception as exc:  # noqa: BLE001 - best effort (the peer's own deadline or lease still applies)
            log.info("could not notify %s: %s", rank.agent_name, exc)

    def _warm(self, rank: RankCommInfo, lists: tuple[bytes, ...]) -> None:
        self._load(rank)
        for what in lists:
            self._prepare(rank, what)

    def _load(self, rank: RankCommInfo) -> None:
        name = rank.agent_name
        with self._lock:
            if name in self._loaded:
                self._touch(name)
                return
        self._agent.load_remote(rank.agent_metadata, name)  # outside the lock: lookups go on meanwhile
        with self._lock:
            self._loaded[name] = self._fresh[name] = time.monotonic()
        with contextlib.suppress(AgentError):  # the first READ connects instead
            self._agent.connect(name)
        with self._lock:
            self._evict_idle()

    def _prepare(self, rank: RankCommInfo, what: bytes) -> None:
        with self._lock:
            if self._cached(rank, what) is not None:
                return
        memory = MemoryKind.DRAM if what == BOARD else rank.layout.pools[0].memory
        rows = board_rows(rank.board) if what == BOARD else rank.layout.unit_descriptors(what == COARSE)
        prepared = self._agent.prepare(rank.agent_name, rows, memory)
        with self._lock:
            self._prepared[(rank.agent_name, what)] = (prepared, _described(rank, what))
            self._evict_idle()

    def _evict(self) -> None:
        with self._lock:
            self._evict_idle()

    def _close(self, name: str) -> None:
        closed = True
        try:
            closed = self._agent.close_peer(name)  # first: an agent may refuse, and then nothing changes
            if closed:
                with self._lock:
                    lists = [self._prepared.pop(key)[0] for key in [key for key in self._prepared if key[0] == name]]
                    self._loaded.pop(name, None)
                    self._fresh.pop(name, None)
                for prepared in lists:
                    self._agent.release_prepared(prepared)
        except AgentError as exc:
            log.warning("closing agent %s: %s", name, exc)
        finally:
            with self._lock:
                self._closing.discard(name)
                if closed:
                    self._held_back.discard(name)
                    self._unclosed.discard(name)
                else:
                    self._unclosed.add(name)
            self._on_change(name)
            self._resume()

    def _forget_idle(self, now: float) -> int:
        with self._lock:
            busy = self._busy_agents()
            idle = [name for name, used in self._loaded.items() if now - used > self._idle_s and name not in busy]
            for name in idle:
                for key in [key for key in self._prepared if key[0] == name]:
                    self._agent.release_prepared(self._prepared.pop(key)[0])
                del self._loaded[name]
                self._fresh.pop(name, None)
                with contextlib.suppress(AgentError):  # it is no longer ours either way
                    self._agent.forget_remote(name)
        self._resume()  # (also loadings kept for later whose fresh peers went stale)
        return len(idle)

    # --- under the lock ---------------------------------------------------------------------------------
    def _list(self, rank: RankCommInfo, what: bytes) -> Any:
        with self._lock:
            cached = self._cached(rank, what)
        if cached is None:  # not asked for through ``ready`` (or evicted since): prepare it now
            self.warm(rank, (what,))
            with self._lock:
                cached = self._cached(rank, what)
        if cached is None:
            raise AgentError(f"the {what.decode()} list of agent {rank.agent_name} was released while in use")
        return cached

    def _cached(self, rank: RankCommInfo, what: bytes) -> Any:
        """The kept list, or None. A state is untrusted: one that names an agent we hold a list for but describes
        its memory otherwise is refused, never served the other state's list."""
        cached = self._prepared.get((rank.agent_name, what))
        if cached is None:
            return None
        prepared, known = cached
        described = _described(rank, what)
        if known is not described and known != described:
            raise AgentError(f"a second state names agent {rank.agent_name!r} with other memory")
        self._prepared.move_to_end((rank.agent_name, what))
        self._touch(rank.agent_name)
        return prepared

    def _touch(self, name: str) -> None:
        if name in self._loaded:
            self._loaded[name] = time.monotonic()
            self._loaded.move_to_end(name)

    def _evict_idle(self) -> None:
        """Beyond ``max_peers``, release the least recently used lists and agents that no active request needs and
        none used for ``evict_idle_s``: a flood of requests to new (dead) peers must not evict the lists of a live
        peer between two of its requests (it did: the next one waited 1.9 s behind the flood's loads)."""
        if len(self._prepared) <= self._max_peers and len(self._loaded) <= self._max_peers:
            return  # (the busy set costs a walk over every active request)
        busy = self._busy_agents()
        recent = time.monotonic() - self._evict_idle_s
        idle = lambda name: name not in busy and self._loaded.get(name, 0.0) < recent  # noqa: E731
        excess = max(0, len(self._prepared) - self._max_peers)
        for key in [k for k in self._prepared if idle(k[0])][:excess]:
            self._agent.release_prepared(self._prepared.pop(key)[0])
        with_lists = {agent for agent, _ in self._prepared}
        excess = max(0, len(self._loaded) - self._max_peers)
        for name in [a for a in self._loaded if idle(a) and a not in with_lists][:excess]:
            del self._loaded[name]
            self._fresh.pop(name, None)
            self._agent.forget_remote(name)


def _described(rank: RankCommInfo, what: bytes) -> object:
    return rank.board if what == BOARD else rank.layout
