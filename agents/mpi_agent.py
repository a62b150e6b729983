"""The MPI transfer agent: one-sided READs as MPI_Rget on a dynamic window, notifications as point-to-point messages.

Why it is built this way (mpi4py 4.1 over MPICH 5.0, ch4:ucx, as the ``mpich`` wheel ships it):

- **One window per process, over COMM_WORLD.** Window creation is collective, registration must not be: the first
  agent a process builds creates a dynamic window (``MPI_Win_create_dynamic``) and a duplicate of COMM_WORLD for
  notifications, and every later agent of the process shares them. So **every rank of the world must build its
  first MPI agent at the same time**, as the transceivers of a ctx and a gen instance launched as one MPMD job do at
  start-up (``nixl-kv pair --backend mpi``); a rank that does not arrive within ``WORLD_TIMEOUT_S`` makes the others
  fail with AgentError instead of hanging (a non-blocking barrier first). The window and the communicator live until
  the process exits (see Exit). The window stays in one passive epoch (``MPI_Win_lock_all``, NOCHECK) for its
  life: a READ is an ``MPI_Rget``, complete when its request is, and no unlock can hang on a dead peer.
- **register = MPI_Win_attach** (local, any time), refcounted per process, since agents of one process share the
  window; displacements are absolute addresses, so a peer's descriptor rows are used as they are. The metadata
  (msgpack, a few dozen bytes plus 16 per region) carries the agent name, its world rank, an id of its MPI world
  (from a broadcast at window creation: metadata of another world is refused, since its rank numbers mean other
  processes) and its registered regions. MPI checks nothing on the target: a Get of an address not attached there
  crashed the target (SIGSEGV, measured), so every remote entry is checked here against the regions the peer's
  metadata listed, and every local entry against this agent's registrations. Regions registered after a peer loaded
  the metadata are not readable by it until it loads the metadata again; memory deregistered (or an agent closed)
  after a peer loaded its metadata is no longer checked by anyone: free it only when no peer will read it.
- **A READ** is one ``MPI_Rget`` with two ``hindexed`` datatypes (absolute local addresses from ``MPI_BOTTOM``;
  remote displacements from the lowest remote address), after merging runs that continue on both sides: a 4096-entry
  scattered READ is one request. Within one process (two agents, or a one-rank world) it is a Get on self.
- **Progress: MPICH's progress thread (``MPIR_CVAR_ASYNC_PROGRESS=1``), set by the agent before MPI starts unless
  the variable is set or MPI started already** (``nixl-kv pair`` sets it for its MPI job, whose workers start MPI
  before their agent). The dynamic window's Gets are served by active messages, so they complete only while the
  *target* process makes MPI progress: a Get to a target sleeping outside MPI waited until it woke. With the thread,
  the ctx rank's Python does nothing per READ; the price is one core spinning per process. Measured (2-core VM, two
  ranks, 64 MiB, median of 5): one run 2.3 GB/s with the target asleep, 3.2 GB/s with it polling; 8192 scattered
  8 KiB entries 1.2 GB/s either way. Without the thread, progress rests on the target's polling (the transceiver's
  progress loop probes at least every 2 ms): a 64 MiB READ did not finish in 8 s against a target polling every
  2 ms, and ``nixl-kv pair --busy-thread`` lost 2 of 6 requests to the deadline.
- **Exit.** MPI serves a Get from whatever the address holds; once Python freed the pools, a Get still in flight
  crashed the target (SIGSEGV, measured). At exit the agent waits until every rank arrived (bounded), then unlocks
  and frees the window: that returns only when no Get targets the process any more.
- **Notifications** are messages on the duplicated communicator, tag ``NOTIFY_TAG``, msgpack of (sender name,
  receiver name, bytes); one process-wide inbox (matched probes, so threads cannot steal each other's message) sorts
  them by receiver. A READ's notification is sent by ``status`` once the READ's request completed, so only after
  the bytes landed, and never for a failed READ: a READ whose status is never checked notifies nobody.
- **A dead or stopped peer.** MPI cannot report it: a Get to a rank killed with SIGKILL never completes (and
  ``MPI_Win_unlock`` on it hangs). A READ therefore ends FAILED once its deadline passed
  (``NIXL_KV_MPI_READ_TIMEOUT_S``, default 20 s, plus 1 ns per byte). An Rget cannot be cancelled:
  ``release_transfer`` of one still outstanding returns False (its destination must stay poisoned), and ``close``
  hands such requests to the process, which keeps them until exit. ``close_peer`` cannot end one either (it only
  forgets the peer): MPI has no per-peer connection to close, every rank shares the one window. What MPI
  cannot recover: the outstanding Rget
  (its destination stays poisoned), the world (it cannot be shrunk; whether the window still serves the living ranks
  is MPICH's business, not tested here), and the job: mpiexec (hydra) ends the whole job when one rank dies, and
  with ``-disable-auto-cleanup`` it still killed the survivor in 4 of 6 runs here. A process whose peer died waits
  ``EXIT_TIMEOUT_S`` at exit for ranks that never come, and leaves the window open.
- DRAM only: the PyPI ``mpich`` is not GPU-aware, so VRAM raises NotSupportedError.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from nixl_kv.agents.descriptors import checked, located, runs, table
from nixl_kv.agents.flat_agent import FlatAgent, FlatPrepared
from nixl_kv.config import ENV_PREFIX
from nixl_kv.errors import AgentError, NixlKvError, NotSupportedError
from nixl_kv.interfaces import TransferStatus
from nixl_kv.layout import MemoryKind, MemoryRegion

log = logging.getLogger(__name__)

READ_TIMEOUT_ENV = f"{ENV_PREFIX}MPI_READ_TIMEOUT_S"
ASYNC_PROGRESS_ENV = "MPIR_CVAR_ASYNC_PROGRESS"
ASYNC_PROGRESS_DEFAULT = "1"
READ_TIMEOUT_S = 20.0
WORLD_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 10.0
NOTIFY_TAG = 7
_FORMAT = "nixl_kv.mpi/1"
_FIELDS = {"format", "agent", "world", "rank", "regions"}
_MAX_METADATA_BYTES = 1 << 20
_MAX_NOTIFICATION_BYTES = 1 << 20
_MAX_RUN_BYTES = 1 << 30  # an hindexed block length is a C int


@dataclass(frozen=True)
class MpiMetadata:
    """What a peer needs to read an agent: its name, its MPI world and rank there, and its registered regions."""

    agent: str
    world: str
    rank: int
    regions: tuple[tuple[int, int], ...]  # (address, nbytes), sorted

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "format": _FORMAT,
                "agent": self.agent,
                "world": self.world,
                "rank": self.rank,
                "regions": [list(region) for region in self.regions],
            }
        )

    @staticmethod
    def decode(data: bytes) -> MpiMetadata:
        """Validate untrusted bytes; AgentError names what is wrong."""
        if not isinstance(data, bytes) or not 0 < len(data) <= _MAX_METADATA_BYTES:
            raise AgentError(f"MPI metadata must be 1 to {_MAX_METADATA_BYTES} bytes")
        try:
            fields = msgpack.unpackb(data, raw=False)
        except Exception as exc:  # msgpack raises several types (and UnicodeDecodeError for a non-text name)
            raise AgentError(f"MPI metadata is not valid msgpack: {type(exc).__name__}: {exc}") from exc
        if not isinstance(fields, dict) or set(fields) != _FIELDS or fields["format"] != _FORMAT:
            raise AgentError(f"MPI metadata is not a {_FORMAT} map")
        agent, world, rank, regions = fields["agent"], fields["world"], fields["rank"], fields["regions"]
        if not isinstance(agent, str) or not agent:
            raise AgentError("MPI metadata: agent must be a non-empty string")
        if not isinstance(world, str) or not isinstance(rank, int) or rank < 0:
            raise AgentError("MPI metadata: world must be a string and rank a non-negative integer")
        if not isinstance(regions, list) or not all(_valid_region(region) for region in regions):
            raise AgentError("MPI metadata: regions must be [address, nbytes] pairs of positive 64-bit integers")
        return MpiMetadata(agent, world, rank, tuple(sorted((int(a), int(n)) for a, n in regions)))


def _valid_region(region: object) -> bool:
    return (
        isinstance(region, list)
        and len(region) == 2
        and all(isinstance(value, int) and 0 < value < 1 << 64 for value in region)
        and region[0] + region[1] <= 1 << 64
    )


@dataclass(eq=False)
class MpiTransfer:
    """One posted READ: its Rget request (None when it had no bytes), its deadline and its notification."""

    peer: str
    rank: int
    nbytes: int
    request: Any
    deadline: float
    notification: bytes
    state: TransferStatus = TransferStatus.IN_PROGRESS


@dataclass
class _World:
    """What the agents of one process share: the dynamic window, the notification communicator, the memory attached
    to the window (refcounted), the inbox by receiver name, and requests nobody may free yet."""

    mpi: Any
    window: Any
    notes: Any
    world_id: str
    rank: int
    size: int
    lock: threading.RLock = field(default_factory=threading.RLock)
    attached: dict[tuple[int, int], int] = field(default_factory=dict)
    inbox: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)
    sends: list[tuple[Any, bytes]] = field(default_factory=list)
    abandoned: list[Any] = field(default_factory=list)  # Rgets outstanding when their agent closed

    def attach(self, address: int, nbytes: int) -> None:
        with self.lock:
            key = (address, nbytes)
            if key not in self.attached:
                for start, size in self.attached:
                    if start < address + nbytes and address < start + size:
                        raise AgentError(
                            f"MPI could not register memory: {address:#x} ({nbytes} bytes) overlaps memory another "
                            f"agent of this process registered ({start:#x}, {size} bytes); MPI cannot attach it twice"
                        )
                self.window.Attach(self.mpi.memory.fromaddress(address, nbytes))
            self.attached[key] = self.attached.get(key, 0) + 1

    def detach(self, address: int, nbytes: int) -> None:
        with self.lock:
            key = (address, nbytes)
            self.attached[key] -= 1
            if not self.attached[key]:
                del self.attached[key]
                self.window.Detach(self.mpi.memory.fromaddress(address, nbytes))

    def join(self, name: str) -> None:
        with self.lock:
            if name in self.inbox:
                raise AgentError(f"an MPI agent named {name!r} already lives in this process")
            self.inbox[name] = []

    def leave(self, name: str) -> None:
        with self.lock:
            self.inbox.pop(name, None)

    def post(self, rank: int, sender: str, receiver: str, message: bytes) -> None:
        """Send a notification without waiting; the buffer is kept until MPI is done with it."""
        data = msgpack.packb([sender, receiver, bytes(message)])
        with self.lock:
            self.sends.append((self.notes.Isend([data, self.mpi.BYTE], rank, NOTIFY_TAG), data))

    def collect(self, name: str) -> list[tuple[str, bytes]]:
        """Receive every notification that arrived (for any agent of the process); return and forget ``name``'s."""
        with self.lock:
            self.sends = [(request, data) for request, data in self.sends if not request.Test()]
            status = self.mpi.Status()
            while (message := self.notes.Improbe(self.mpi.ANY_SOURCE, NOTIFY_TAG, status)) is not None:
                self._sort(message, status.Get_source(), status.Get_count(self.mpi.BYTE))
            found, self.inbox[name] = self.inbox.get(name, []), []
            return found

    def shutdown(self, timeout_s: float = EXIT_TIMEOUT_S) -> None:
        """At exit, before Python frees the memory of the pools: once every rank got here (within ``timeout_s``; a
        dead or busy rank makes it give up), complete every Get (unlock) and free the window, which returns only when
        no Get of any rank targets this process any more. A Get served after its memory was freed crashed the
        target (measured)."""
        arrived, deadline = self.notes.Ibarrier(), time.monotonic() + timeout_s
        while not arrived.Test():
            if time.monotonic() > deadline:
                log.error("MPI agent at exit: not every rank arrived within %.0f s; the window stays open", timeout_s)
                return
            time.sleep(1e-3)
        with self.lock:
            self.window.Unlock_all()
            self.window.Free()
            self.abandoned.clear()

    def _sort(self, message: Any, source: int, nbytes: int) -> None:
        """File one matched message under its receiver; drop (and log) what no agent of this process can take."""
        if nbytes > _MAX_NOTIFICATION_BYTES:
            with contextlib.suppress(self.mpi.Exception):  # received into nothing: MPI reports the truncation
                message.Recv([bytearray(0), self.mpi.BYTE])
            log.warning(
                "dropped a notification of %d bytes from rank %d (over %d)", nbytes, source, _MAX_NOTIFICATION_BYTES
            )
            return
        data = bytearray(nbytes)
        message.Recv([data, self.mpi.BYTE])
        try:
            sender, receiver, payload = msgpack.unpackb(bytes(data), raw=False)
            if not (isinstance(sender, str) and isinstance(receiver, str) and isinstance(payload, bytes)):
                raise ValueError("not (sender, receiver, bytes)")
        except Exception as exc:
            log.warning("dropped a malformed notification from rank %d: %s", source, exc)
            return
        if receiver not in self.inbox:
            log.warning("dropped a notification from %s to %s: no such agent in this process", sender, receiver)
            return
        self.inbox[receiver].append((sender, payload))


_WORLD: _World | None = None
_WORLD_ERROR: AgentError | None = None
_WORLD_LOCK = threading.Lock()


def _mpi() -> Any:
    """mpi4py's MPI, started with ``ASYNC_PROGRESS_ENV`` set to the default unless the user chose it."""
    if "mpi4py.MPI" not in sys.modules:
        os.environ.setdefault(ASYNC_PROGRESS_ENV, ASYNC_PROGRESS_DEFAULT)
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise NotSupportedError(f"the MPI agent needs mpi4py and an MPI (pip install mpich): {exc}") from exc
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise NotSupportedError("the MPI agent needs MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level = 'multiple')")
    return MPI


def _world(timeout_s: float = WORLD_TIMEOUT_S) -> _World:
    """The process's window and notification communicator, created (collectively, over COMM_WORLD) on first use."""
    global _WORLD, _WORLD_ERROR
    with _WORLD_LOCK:
        if _WORLD is not None:
            return _WORLD
        if _WORLD_ERROR is not None:
            raise _WORLD_ERROR
        mpi = _mpi()
        world = mpi.COMM_WORLD
        agreed, deadline = world.Ibarrier(), time.monotonic() + timeout_s
        while not agreed.Test():
            if time.monotonic() > deadline:
                _WORLD_ERROR = AgentError(
                    f"MPI could not create its window: not every one of the {world.Get_size()} ranks of the MPI world "
                    f"built an MPI agent within {timeout_s:.0f} s (window creation is collective: every rank must "
                    "build its first MPI agent at the same time)"
                )
                raise _WORLD_ERROR
            time.sleep(1e-4)
        notes = world.Dup()
        window = mpi.Win.Create_dynamic(comm=world)
        window.Set_errhandler(mpi.ERRORS_RETURN)
        window.Lock_all(mpi.MODE_NOCHECK)
        world_id = notes.bcast(secrets.token_hex(8) if world.Get_rank() == 0 else None, root=0)
        if os.environ.get(ASYNC_PROGRESS_ENV) != "1":
            log.info("MPI without async progress: READs from this process complete only while it polls MPI")
        _WORLD = _World(mpi, window, notes, world_id, world.Get_rank(), world.Get_size())
        atexit.register(_WORLD.shutdown)  # runs before mpi4py finalizes MPI and Python frees the pools
        return _WORLD


class MpiAgent(FlatAgent):
    """An MPI rank's agent: READs on the process's dynamic window, notifications on its communicator.

    Thread-safe: MPI runs with MPI_THREAD_MULTIPLE, and the agent's own books are under a lock.
    """

    LABEL = "MPI"
    DRAM_ONLY = "the MPI agent moves DRAM only: the mpich wheel is not GPU-aware"
    FOREIGN = "descriptor lists must come from this agent's prepare"

    def __init__(self, name: str, progress_thread: bool = False, read_timeout_s: float | None = None) -> None:
        """``progress_thread`` is accepted for the registry's call and ignored (see the module: progress).
        ``read_timeout_s``: how long a READ may take before it reads FAILED (and 1 ns per byte more); by default
        ``NIXL_KV_MPI_READ_TIMEOUT_S``, else 20 s."""
        self.name = name
        self._timeout_s = read_timeout_s if read_timeout_s is not None else _read_timeout_s()
        self._world = self._call("create its window", _world)
        self._world.join(name)
        self._lock = threading.RLock()
        super().__init__(self._lock)
        self._registrations: list[tuple[int, int]] = []  # (address, nbytes), sorted
        self._transfers: set[MpiTransfer] = set()
        self._remotes: dict[str, MpiMetadata] = {}
        self._closed = False

    def metadata(self) -> bytes:
        world = self._world
        return MpiMetadata(self.name, world.world_id, world.rank, tuple(self._registrations)).encode()

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        for region in regions:
            self._check_memory(region.memory)
        with self._lock:
            self._check_open("register memory")
            for region in regions:
                if region.nbytes:
                    self._call("register memory", self._world.attach, region.address, region.nbytes)
                    self._registrations = sorted([*self._registrations, (region.address, region.nbytes)])

    def load_remote(self, metadata: bytes, name: str) -> None:
        described = MpiMetadata.decode(metadata)
        if described.agent != name:
            raise AgentError(f"metadata given for agent {name!r} describes agent {described.agent!r}")
        if described.world != self._world.world_id or described.rank >= self._world.size:
            raise AgentError(
                f"metadata of agent {name!r} describes rank {described.rank} of another MPI world: an MPI agent reads "
                "only ranks of its own world (one mpiexec job)"
            )
        with self._lock:
            self._remotes[name] = described

    def forget_remote(self, name: str) -> None:
        with self._lock:
            self._remotes.pop(name, None)

    def read_ranges(
        self,
        peer: str,
        local_rows: np.ndarray,
        local_memory: MemoryKind,
        remote_rows: np.ndarray,
        remote_memory: MemoryKind,
        notification: bytes,
    ) -> Any:
        for memory in (local_memory, remote_memory):
            self._check_memory(memory)
        local, remote = (
            checked(table, "MPI could not describe ranges", rows, (3,)) for rows in (local_rows, remote_rows)
        )
        self._check_inside(None, local[:, 0], local[:, 1], "describe local ranges")
        self._check_inside(peer, remote[:, 0], remote[:, 1], f"describe ranges of {peer}")
        return self._post(peer, (local[:, 0], local[:, 1]), (remote[:, 0], remote[:, 1]), notification)

    def status(self, transfer: Any) -> TransferStatus:
        with self._lock:
            if transfer.state is TransferStatus.IN_PROGRESS:
                if self._landed(transfer):
                    transfer.state = TransferStatus.DONE
                    if transfer.notification:
                        self._notify(transfer.peer, transfer.rank, transfer.notification)
                elif time.monotonic() > transfer.deadline:
                    log.warning("MPI READ of %d bytes from %s passed its deadline", transfer.nbytes, transfer.peer)
                    transfer.state = TransferStatus.FAILED
            return transfer.state

    def release_transfer(self, transfer: Any) -> bool:
        with self._lock:
            if transfer.request is not None and not self._test(transfer):
                return False  # an Rget cannot be cancelled: its destination may still be written
            self._transfers.discard(transfer)
            return True

    def notify(self, peer: str, message: bytes) -> None:
        with self._lock:
            self._check_open(f"notify {peer}")
            self._notify(peer, self._peer(peer, f"notify {peer}").rank, message)

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        if self._closed:
            return []
        try:
            return self._world.collect(self.name)
        except Exception as exc:  # an MPI error: logged, the next poll tries again
            log.warning("MPI could not get notifications: %s: %s", type(exc).__name__, exc)
            return []

    def close(self) -> None:
        """Drop transfers (handing outstanding Rgets to the process), lists, peers and registrations (detached)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            world = self._world
            for transfer in self._transfers:
                if transfer.request is not None and not self._landed(transfer):
                    with world.lock:
                        world.abandoned.append(transfer.request)
            self._transfers.clear()
            self._prepared.clear()
            self._remotes.clear()
            for address, nbytes in self._registrations:
                try:
                    self._call("deregister memory", world.detach, address, nbytes)
                except AgentError as exc:
                    log.warning("%s", exc)
            self._registrations.clear()
            world.leave(self.name)

    def _admit(self, owner: str | None, addresses: np.ndarray, lengths: np.ndarray, what: str) -> tuple[None, None]:
        self._check_inside(owner, addresses, lengths, what)
        return None, None

    def _read_lists(self, local: FlatPrepared, remote: FlatPrepared, notification: bytes) -> MpiTransfer:
        local_entries, remote_entries = (local.addresses, local.lengths), (remote.addresses, remote.lengths)
        return self._post(remote.owner, local_entries, remote_entries, notification)

    def _post(
        self, peer: str, local: tuple[np.ndarray, np.ndarray], remote: tuple[np.ndarray, np.ndarray], note: bytes
    ) -> MpiTransfer:
        what = f"post READ from {peer}"
        with self._lock:
            self._check_open(what)
            rank = self._peer(peer, what).rank
            runs = _runs(local, remote)
            nbytes = int(runs[2].sum())
            request = self._call(what, self._rget, rank, *runs) if len(runs[2]) else None
            deadline = time.monotonic() + self._timeout_s + nbytes * 1e-9
            transfer = MpiTransfer(peer, rank, nbytes, request, deadline, bytes(note))
            self._transfers.add(transfer)
            return transfer

    def _rget(self, rank: int, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> Any:
        """One Rget of every run: hindexed datatypes on both sides, freed once posted (MPI keeps what it needs)."""
        mpi, base = self._world.mpi, int(remote.min())
        blocks = lengths.astype(np.int64).tolist()
        origin = mpi.BYTE.Create_hindexed(blocks, local.astype(np.int64).tolist()).Commit()
        target = mpi.BYTE.Create_hindexed(blocks, (remote - np.uint64(base)).astype(np.int64).tolist()).Commit()
        try:
            return self._world.window.Rget([mpi.BOTTOM, 1, origin], rank, target=(base, 1, target))
        finally:
            origin.Free()
            target.Free()

    def _landed(self, transfer: MpiTransfer) -> bool:
        try:
            return transfer.request is None or self._test(transfer)
        except AgentError as exc:
            log.warning("%s", exc)
            transfer.state = TransferStatus.FAILED
            return False

    def _test(self, transfer: MpiTransfer) -> bool:
        """Whether the Rget completed (its request then becomes None: MPI freed it)."""
        if transfer.request is None:
            return True
        done = self._call(f"check READ from {transfer.peer}", transfer.request.Test)
        if done:
            transfer.request = None
        return bool(done)

    def _notify(self, peer: str, rank: int, message: bytes) -> None:
        self._call(f"notify {peer}", self._world.post, rank, self.name, peer, message)

    def _peer(self, name: str, what: str) -> MpiMetadata:
        try:
            return self._remotes[name]
        except KeyError:
            raise AgentError(f"MPI could not {what}: agent {name!r} is not loaded") from None

    def _check_inside(self, owner: str | None, addresses: np.ndarray, lengths: np.ndarray, what: str) -> None:
        """Every entry inside one region: this agent's registrations, or those the peer's metadata listed (MPI
        itself checks nothing: a Get outside the target's attached memory crashes the target)."""
        with self._lock:
            regions = self._registrations if owner is None else list(self._peer(owner, what).regions)
        where = "registered memory" if owner is None else f"memory {owner} registered"
        located(f"MPI could not {what}", addresses, lengths, regions, where)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise AgentError(f"MPI could not {what}: the agent is closed")

    @staticmethod
    def _call(what: str, function: Any, *args: Any) -> Any:
        try:
            return function(*args)
        except NixlKvError:  # AgentError, or NotSupportedError from starting MPI
            raise
        except Exception as exc:  # mpi4py raises MPI.Exception; none may escape as such
            raise AgentError(f"MPI could not {what}: {type(exc).__name__}: {exc}") from exc


def _read_timeout_s() -> float:
    try:
        return max(0.0, float(os.environ.get(READ_TIMEOUT_ENV, "")))
    except ValueError:
        return READ_TIMEOUT_S


def _runs(
    local: tuple[np.ndarray, np.ndarray], remote: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pair local and remote entries, merge each run that continues on both sides, drop empty runs and cut runs
    longer than ``_MAX_RUN_BYTES``: (local addresses, remote addresses, lengths)."""
    (local_at, local_len), (remote_at, remote_len) = local, remote
    if len(local_at) != len(remote_at) or not np.array_equal(local_len, remote_len):
        raise AgentError(
            f"MPI could not create READ: {len(local_at)} local and {len(remote_at)} remote entries of other lengths"
        )
    keep = local_len > 0  # an empty run moves nothing
    merged = runs(local_at[keep], remote_at[keep], local_len[keep], max_bytes=_MAX_RUN_BYTES)
    return merged[0], merged[1], merged[2]
