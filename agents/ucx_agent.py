"""The UCX transfer agent: one-sided GETs straight through libucp (``ucp_get_nbx``), without NIXL.

Why it is built this way (libucp of the PyPI wheel ``libucx-cu12``, 1.21/1.22, through ``agents/ucp_binding.py``):

- One UCP context and worker per agent. ``register`` maps each region (``ucp_mem_map``) and packs its remote key;
  ``metadata()`` is msgpack of the agent name, the worker address and every region's (base, length, packed rkey):
  a few hundred bytes per region plus the address, carried inline in the CommState.
- ``load_remote`` creates an endpoint to the peer's worker address (connecting without blocking, TCP timeouts
  bounded: ``ucx_config``; this libucp still took 9.7 s to fail a READ from a host that vanished, so the agent's own
  deadline and ``close_peer`` are what end it sooner) and unpacks its rkeys. Remote rows are checked
  against the peer's advertised regions when prepared (a GET outside them would read whatever the peer's process
  holds there: the software RMA over TCP does not check bounds), local rows against this agent's registrations.
- A READ posts one GET per run: entries that continue each other on both sides, inside one remote region, merge.
  Its notification is an active message sent only after every GET of the READ completed, so the peer finds the
  bytes in place; the READ reads DONE once that message is handed to UCX too (what is notified after a READ
  arrives after its notification: active messages on one endpoint are ordered).
- Endpoints use error mode PEER: a dead peer fails the GETs in flight (TCP: connection reset, at once) and
  ``status`` reads FAILED, instead of aborting the process, which is what the cma transport does in mode NONE when
  the peer died. The price: on one host UCX then moves RMA over TCP (measured 1.3 GB/s here) instead of cma
  (process_vm_readv, 5.8 GB/s), because cma cannot report a dead peer.
- GETs over TCP need the target's worker to progress. The ctx side of an instance is idle while it is read, so each
  agent runs a progress thread that sleeps on the worker's event fd (``ucp_worker_arm``, ``poll``) and progresses
  when UCX has work: no core spins, and ctypes releases the GIL inside each UCX call. One lock serializes every call
  into the worker (serialized thread mode), so the caller's thread and the progress loop may call the agent too.
- UCX cannot cancel one GET: ``release_transfer`` of a READ still running returns False and keeps it. What stops
  GETs is force-closing their endpoint (they end CANCELED, and nothing lands after): done to a peer whose READ
  outlived its deadline (``timeout_s``: a stopped peer keeps its TCP connection up, so UCX alone would wait
  forever; a dead one fails at once), to a peer the caller closes (``close_peer``: the receiver does it once every
  READ from that peer is past its request's deadline, long before ``timeout_s``) and, at ``close``, to peers still
  read after ``_CLOSE_S``. A peer's rkeys and endpoint are released only when none of its transfers is left running:
  ``forget_remote`` never pulls a key from under a GET.
- DRAM only: VRAM raises NotSupportedError (UCX's CUDA transports would need the memory type and a CUDA context).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from nixl_kv.agents import descriptors as entries
from nixl_kv.agents import ucp_binding as ucp
from nixl_kv.agents.flat_agent import FlatAgent, FlatPrepared
from nixl_kv.agents.ucx_config import bound_tcp_failures
from nixl_kv.config import ENV_PREFIX
from nixl_kv.errors import AgentError, NotSupportedError
from nixl_kv.interfaces import TransferStatus
from nixl_kv.layout import MemoryKind, MemoryRegion

log = logging.getLogger(__name__)

_FORMAT = "nixl_kv.ucx/1"
_FIELDS = {"format", "agent", "ucx", "address", "regions"}
_MAX_METADATA_BYTES = 1 << 20
_MAX_REGIONS = 4096
_MAX_KEY_BYTES = 4096
_AM_ID = 0x4B56  # the agent's one active message kind: a notification (header: sender name, data: message)
_WAKE_S = 0.1  # the progress thread's longest sleep: a safety net, the event fd wakes it for UCX's work
_TIMEOUT_S = 30.0  # a READ's deadline unless NIXL_KV_UCX_TIMEOUT_S says otherwise
TIMEOUT_ENV = f"{ENV_PREFIX}UCX_TIMEOUT_S"
_CLOSE_S = 5.0  # how long close waits for transfers, notifications and endpoint closes to end
_PROGRESS_ROUNDS = 64  # per advance: a stream of events must not keep the lock from the caller's thread


@dataclass(frozen=True)
class RemoteRegion:
    """A registered region as a peer sees it: where it is and the packed rkey that opens it."""

    address: int
    nbytes: int
    rkey: bytes


@dataclass(frozen=True)
class UcxMetadata:
    """What a peer needs to reach an agent: its name, its worker address and its readable regions."""

    agent: str
    ucx: tuple[int, int]  # the (major, minor) version of the agent's libucp: peers must run the same
    address: bytes
    regions: tuple[RemoteRegion, ...]

    def encode(self) -> bytes:
        regions = [[r.address, r.nbytes, r.rkey] for r in self.regions]
        fields = {"format": _FORMAT, "agent": self.agent, "ucx": list(self.ucx), "address": self.address}
        return msgpack.packb({**fields, "regions": regions})

    @staticmethod
    def decode(data: bytes) -> UcxMetadata:
        """Validate untrusted bytes; AgentError names what is wrong."""
        if not isinstance(data, bytes) or not 0 < len(data) <= _MAX_METADATA_BYTES:
            raise AgentError(f"UCX metadata must be 1 to {_MAX_METADATA_BYTES} bytes")
        try:
            fields = msgpack.unpackb(data, raw=False)
        except Exception as exc:  # msgpack raises several types (and UnicodeDecodeError for a non-text name)
            raise AgentError(f"UCX metadata is not valid msgpack: {type(exc).__name__}: {exc}") from exc
        if not isinstance(fields, dict) or set(fields) != _FIELDS or fields["format"] != _FORMAT:
            raise AgentError(f"UCX metadata is not a {_FORMAT} map")
        agent, ucx, address, regions = fields["agent"], fields["ucx"], fields["address"], fields["regions"]
        if not isinstance(agent, str) or not agent:
            raise AgentError("UCX metadata: agent must be a non-empty string")
        if not (isinstance(ucx, list) and len(ucx) == 2 and all(type(n) is int and 0 <= n < 1 << 16 for n in ucx)):
            raise AgentError("UCX metadata: ucx must be [major, minor]")
        if not isinstance(address, bytes) or not address:
            raise AgentError("UCX metadata: address must be non-empty bytes")
        if not isinstance(regions, list) or len(regions) > _MAX_REGIONS:
            raise AgentError(f"UCX metadata: regions must be a list of at most {_MAX_REGIONS}")
        return UcxMetadata(agent, (ucx[0], ucx[1]), address, tuple(_remote_region(region) for region in regions))


def _remote_region(entry: object) -> RemoteRegion:
    if not (isinstance(entry, list) and len(entry) == 3):
        raise AgentError("UCX metadata: a region must be [address, nbytes, rkey]")
    address, nbytes, rkey = entry
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (address, nbytes)):
        raise AgentError("UCX metadata: a region's address and nbytes must be integers")
    if address < 0 or nbytes <= 0 or address + nbytes >= 1 << 64:
        raise AgentError(f"UCX metadata: region ({address}, {nbytes}) is outside the address space")
    if not isinstance(rkey, bytes) or not 0 < len(rkey) <= _MAX_KEY_BYTES:
        raise AgentError(f"UCX metadata: a region's rkey must be 1 to {_MAX_KEY_BYTES} bytes")
    return RemoteRegion(address, nbytes, rkey)


@dataclass(eq=False)
class _Peer:
    """A loaded peer: its endpoint and unpacked rkeys (one per region), alive until retired and unused."""

    name: str
    metadata: bytes
    regions: tuple[RemoteRegion, ...]
    endpoint: int
    rkeys: list[int] = field(default_factory=list)
    failed: int = 0  # the status UCX reported for the endpoint (0: healthy)
    connected: bool = True  # the endpoint is open (not yet closed by this agent)
    retired: bool = False  # forgotten or replaced: no new transfer; released once ``users`` is 0
    users: int = 0  # transfers of this peer still running

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(r.address, r.nbytes) for r in self.regions]


@dataclass(eq=False)
class UcxTransfer:
    """A READ: its GETs in flight (reaped in order), then its notification, if any."""

    peer: _Peer
    requests: list[int]
    notification: bytes
    deadline: float  # time.monotonic(); past it, the READ fails and its peer's endpoint is force-closed
    reaped: int = 0
    error: str = ""
    sent: bool = False  # the notification is handed to UCX (or there is none)
    note: Any = None  # the notification's request and buffer while it is in flight

    @property
    def running(self) -> bool:
        return self.reaped < len(self.requests) or self.note is not None or not (self.sent or self.error)


@dataclass(frozen=True)
class _Registration:
    address: int
    nbytes: int
    memh: int
    rkey: bytes


class UcxAgent(FlatAgent):
    """A UCP worker with mapped memory and endpoints to loaded peers, plus the bookkeeping ``close`` releases.

    Thread-safe: one lock serializes every call into the worker; the agent's progress thread takes it too.
    """

    LABEL = "UCX"
    DRAM_ONLY = "the UCX agent moves DRAM only; VRAM needs UCX's CUDA transports, not wired in"
    FOREIGN = "the lists were not prepared by a UCX agent"

    def __init__(self, name: str, progress_thread: bool = False, timeout_s: float | None = None) -> None:
        """``progress_thread`` is accepted for the registry's call and ignored: the agent always runs its own
        event-driven progress thread (it sleeps on the worker's event fd, see the module docstring).
        ``timeout_s``: a READ still running after it fails, and its peer's endpoint is force-closed (default
        ``NIXL_KV_UCX_TIMEOUT_S``, else 30): a peer that stopped (SIGSTOP, a hung host) keeps its TCP connection
        up, and UCX would wait for it forever."""
        bound_tcp_failures()  # before UCX reads its configuration
        try:
            self._context = ucp.Context()
        except ImportError as exc:
            raise NotSupportedError(str(exc)) from exc
        self.name = name
        self._timeout_s = timeout_s if timeout_s is not None else _env_timeout()
        self._lock = threading.Lock()
        super().__init__(self._lock)
        self._worker = ucp.Worker(self._context)
        self._address = self._worker.address()
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._worker.set_am_handler(_AM_ID, self._received)
        self._registrations: list[_Registration] = []
        self._transfers: set[UcxTransfer] = set()  # not yet released by the caller
        self._running: set[UcxTransfer] = set()  # with GETs or a notification in flight
        self._remotes: dict[str, _Peer] = {}
        self._retired: list[_Peer] = []
        self._sends: list[tuple[int, ctypes.Array[ctypes.c_char]]] = []  # notify's messages in flight
        self._closing: list[int] = []  # endpoint close requests in flight
        self._closed = False
        self._stopping = False
        self._event_fd = self._worker.event_fd()
        self._thread = threading.Thread(target=self._serve, name=f"ucx-progress-{name}", daemon=True)
        self._thread.start()

    def metadata(self) -> bytes:
        regions = tuple(RemoteRegion(r.address, r.nbytes, r.rkey) for r in self._registrations)
        return UcxMetadata(self.name, ucp.version()[:2], self._address, regions).encode()

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        for region in regions:
            self._check_memory(region.memory)
        with self._lock:
            self._check_open("register memory")
            for region in regions:
                memh = self._context.mem_map(region.address, region.nbytes)
                try:
                    rkey = self._context.rkey_pack(memh)
                except AgentError:
                    self._context.mem_unmap(memh)
                    raise
                self._registrations.append(_Registration(region.address, region.nbytes, memh, rkey))

    def load_remote(self, metadata: bytes, name: str) -> None:
        described = UcxMetadata.decode(metadata)
        if described.agent != name:
            raise AgentError(f"metadata given for agent {name!r} describes agent {described.agent!r}")
        if described.ucx != (mine := ucp.version()[:2]):
            raise AgentError(
                f"agent {name!r} runs UCX {described.ucx[0]}.{described.ucx[1]}, this one {mine[0]}.{mine[1]}: UCX"
                f" peers must run one version (set {ucp.LIBRARY_ENV} to the same libucp in every process)"
            )
        with self._lock:
            self._check_open(f"load agent {name}")
            loaded = self._remotes.get(name)
            if loaded is not None and loaded.metadata == metadata and not loaded.failed:
                return
            peer = self._connect(name, metadata, described)  # the old peer stays until the new one is whole
            if loaded is not None:
                self._retire(loaded)
            self._remotes[name] = peer

    def forget_remote(self, name: str) -> None:
        with self._lock:
            if (peer := self._remotes.pop(name, None)) is not None:
                self._retire(peer)

    def close_peer(self, name: str) -> bool:
        """Force-close the peer's endpoint (its GETs end CANCELED at the next progress), then retire it."""
        with self._lock:
            if (peer := self._remotes.pop(name, None)) is not None:
                self._abort(peer, "the caller closed it")
                self._retire(peer)
        return True

    def read_ranges(
        self,
        peer: str,
        local_rows: np.ndarray,
        local_memory: MemoryKind,
        remote_rows: np.ndarray,
        remote_memory: MemoryKind,
        notification: bytes,
    ) -> Any:
        what = f"UCX could not create READ from {peer}"
        for memory in (local_memory, remote_memory):
            self._check_memory(memory)
        local, remote = (entries.checked(entries.table, what, rows, (3,)) for rows in (local_rows, remote_rows))
        if len(local) != len(remote) or not np.array_equal(local[:, 1], remote[:, 1]):
            raise AgentError(f"{what}: local and remote rows differ in number or length")
        with self._lock:
            target = self._peer(peer, what)
            self._regions(None, local[:, 0], local[:, 1], what)
            regions = self._regions(target, remote[:, 0], remote[:, 1], what)
        return self._post(target, _runs(local[:, 0], remote[:, 0], local[:, 1], regions), notification, what)

    def status(self, transfer: Any) -> TransferStatus:
        with self._lock:
            if not self._closed:
                self._advance()
        if transfer.error:
            return TransferStatus.FAILED
        return TransferStatus.IN_PROGRESS if transfer.running else TransferStatus.DONE

    def release_transfer(self, transfer: Any) -> bool:
        with self._lock:
            if transfer.running and not self._closed:
                self._advance()
            if transfer.running and not self._closed:
                return False  # GETs in flight: UCX cannot cancel them
            self._transfers.discard(transfer)
            return True

    def notify(self, peer: str, message: bytes) -> None:
        what = f"UCX could not notify {peer}"
        with self._lock:
            target = self._peer(peer, what)
            buffer = ctypes.create_string_buffer(bytes(message), len(message))
            if (request := self._send(target, buffer, what)) is not None:
                self._sends.append((request, buffer))

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            if not self._closed:
                self._advance()
        found = []
        while self._inbox:
            found.append(self._inbox.popleft())
        return found

    def close(self) -> None:
        """Stop the progress thread; let READs and notifications in flight end (within ``_CLOSE_S``); then release
        transfers, lists, peers (rkeys, endpoints), registrations, the worker and the context, in that order."""
        with self._lock:
            if self._closed or self._stopping:
                return
            self._stopping = True
            self._worker.signal()
        self._thread.join(_CLOSE_S)
        with self._lock:
            self._progress_until(lambda: not (self._running or self._sends), "READs and notifications to end")
            for transfer in list(self._running):
                self._abort(transfer.peer, "it was still read at close")
            self._progress_until(lambda: not self._running, "READs to be cancelled")
            for transfer in list(self._running):
                self._drop_requests(transfer)
            for request, _ in self._sends:
                ucp.request_free(request)
            self._sends.clear()
            self._transfers.clear()
            self._prepared.clear()
            for peer in list(self._remotes.values()):
                self._retire(peer)
            self._remotes.clear()
            self._progress_until(lambda: not self._closing, "endpoints to close")
            for request in self._closing:
                ucp.request_free(request)
            for registration in self._registrations:
                try:
                    self._context.mem_unmap(registration.memh)
                except AgentError as exc:
                    log.warning("%s", exc)
            self._registrations.clear()
            self._worker.destroy()
            self._context.cleanup()
            self._closed = True

    def _admit(
        self, owner: str | None, addresses: np.ndarray, lengths: np.ndarray, what: str
    ) -> tuple[_Peer | None, np.ndarray]:
        peer = None if owner is None else self._peer(owner, f"UCX could not {what}")
        return peer, self._regions(peer, addresses, lengths, f"UCX could not {what}")  # a peer's: its rkeys' indices

    def _read_lists(self, local: FlatPrepared, remote: FlatPrepared, notification: bytes) -> UcxTransfer:
        what = "UCX could not create READ"
        if len(local.addresses) != len(remote.addresses) or not np.array_equal(local.lengths, remote.lengths):
            raise AgentError(f"{what}: local and remote entries differ in number or length")
        runs = _runs(local.addresses, remote.addresses, local.lengths, remote.regions)
        return self._post(remote.peer, runs, notification, what)

    def _serve(self) -> None:
        """The progress thread: progress while UCX has work, then sleep on the armed event fd."""
        poller = select.poll()
        poller.register(self._event_fd, select.POLLIN)
        while True:
            with self._lock:
                if self._stopping:
                    return
                try:
                    self._advance()
                    armed = self._worker.arm()
                except Exception:  # the thread must outlive a bug; the caller's own calls still progress
                    log.exception("UCX agent %s: progress failed", self.name)
                    armed = True
            if armed:
                poller.poll(_WAKE_S * 1000)

    def _advance(self) -> None:
        """Progress the worker until it is idle, then move every transfer, send and endpoint close along."""
        for _ in range(_PROGRESS_ROUNDS):
            if not self._worker.progress():
                break
        now = time.monotonic()
        for transfer in list(self._running):
            self._reap(transfer)
            if transfer.running and now > transfer.deadline and not transfer.error:
                transfer.error = f"the READ from {transfer.peer.name} did not end within {self._timeout_s:.0f} s"
                self._abort(transfer.peer, transfer.error)
        self._sends = [(request, buffer) for request, buffer in self._sends if not _finished(request, "notify")]
        self._closing = [request for request in self._closing if not _finished(request, "close an endpoint")]

    def _reap(self, transfer: UcxTransfer) -> None:
        while transfer.reaped < len(transfer.requests):
            status = ucp.request_status(transfer.requests[transfer.reaped])
            if status == ucp.INPROGRESS:
                return
            ucp.request_free(transfer.requests[transfer.reaped])
            transfer.reaped += 1
            if status != ucp.OK and not transfer.error:
                transfer.error = f"a GET from {transfer.peer.name} failed: {ucp.status_string(status)} ({status})"
                log.warning("UCX agent %s: %s", self.name, transfer.error)
        if transfer.note is not None:
            request, _ = transfer.note
            status = ucp.request_status(request)
            if status == ucp.INPROGRESS:
                return
            ucp.request_free(request)
            transfer.note = None
            if status != ucp.OK:
                transfer.error = f"the notification to {transfer.peer.name} failed: {ucp.status_string(status)}"
        elif not (transfer.sent or transfer.error):
            self._notify_done(transfer)
        if not transfer.running:
            self._running.discard(transfer)
            self._unuse(transfer.peer)

    def _notify_done(self, transfer: UcxTransfer) -> None:
        """Every GET of the READ completed: send its notification (if any)."""
        transfer.sent = True
        if not transfer.notification:
            return
        buffer = ctypes.create_string_buffer(transfer.notification, len(transfer.notification))
        try:
            if (request := self._send(transfer.peer, buffer, "notify")) is not None:
                transfer.note = (request, buffer)
        except AgentError as exc:
            transfer.error = str(exc)

    def _post(self, peer: _Peer, runs: _Runs, notification: bytes, what: str) -> UcxTransfer:
        with self._lock:
            self._check_open(what)
            self._check_usable(peer, what)
            transfer = UcxTransfer(peer, [], bytes(notification), time.monotonic() + self._timeout_s)
            peer.users += 1
            self._transfers.add(transfer)
            self._running.add(transfer)
            try:
                for local, remote, nbytes, region in zip(*runs, strict=True):
                    request = ucp.get(peer.endpoint, local, nbytes, remote, peer.rkeys[region])
                    if request is not None:
                        transfer.requests.append(request)
            except AgentError as exc:
                transfer.error = str(exc)  # GETs posted before it may still run: the transfer stays until they end
                self._reap(transfer)
                if not transfer.running:
                    self._transfers.discard(transfer)
                raise AgentError(f"{what}: {exc}") from exc
            self._reap(transfer)  # GETs that completed at once: the notification may go now
            return transfer

    def _send(self, peer: _Peer, buffer: ctypes.Array[ctypes.c_char], what: str) -> int | None:
        self._check_usable(peer, what)
        try:
            return ucp.am_send(peer.endpoint, _AM_ID, self.name.encode(), buffer)
        except AgentError as exc:
            raise AgentError(f"{what}: {exc}") from exc

    def _received(self, header: bytes, data: bytes) -> None:
        """Runs inside ``progress``: keep a notification, named by its sender."""
        try:
            self._inbox.append((header.decode(), data))
        except UnicodeDecodeError:
            log.warning("UCX agent %s: dropped a notification whose sender name is not UTF-8", self.name)

    def _connect(self, name: str, metadata: bytes, described: UcxMetadata) -> _Peer:
        endpoint = self._worker.connect(described.address, self._endpoint_failed)
        peer = _Peer(name, metadata, described.regions, endpoint)
        try:
            for region in described.regions:
                peer.rkeys.append(ucp.rkey_unpack(endpoint, region.rkey))
        except AgentError as exc:
            self._release(peer)
            raise AgentError(f"UCX could not load agent {name}: {exc}") from exc
        return peer

    def _endpoint_failed(self, endpoint: int, status: int) -> None:
        """Runs inside ``progress`` when UCX found an endpoint broken (error mode PEER): its peer is failed."""
        for peer in [*self._remotes.values(), *self._retired]:
            if peer.endpoint == endpoint:
                peer.failed = status
                level = logging.WARNING if peer.users else logging.INFO  # a peer that closed first is no news
                reason = ucp.status_string(status)
                log.log(level, "UCX agent %s: endpoint to %s failed: %s", self.name, peer.name, reason)

    def _retire(self, peer: _Peer) -> None:
        peer.retired = True
        self._retired.append(peer)
        self._unuse(peer, 0)

    def _unuse(self, peer: _Peer, count: int = 1) -> None:
        peer.users -= count
        if peer.retired and peer.users == 0:
            self._retired.remove(peer)
            self._release(peer)

    def _release(self, peer: _Peer) -> None:
        """Destroy the peer's rkeys (no GET uses them any more), then close its endpoint."""
        for rkey in peer.rkeys:
            ucp.rkey_destroy(rkey)
        peer.rkeys.clear()
        self._disconnect(peer, force=bool(peer.failed))

    def _abort(self, peer: _Peer, why: str) -> None:
        """Stop every GET of a peer that does not answer: force-close its endpoint. UCX completes the GETs in it
        with UCS_ERR_CANCELED and writes nothing after (the connection is gone); its rkeys wait for ``_release``
        (UCX frees an rkey without touching its endpoint)."""
        log.warning("UCX agent %s: force-closing the endpoint to %s: %s", self.name, peer.name, why)
        peer.failed = peer.failed or ucp.ERR_ENDPOINT_TIMEOUT
        self._disconnect(peer, force=True)

    def _disconnect(self, peer: _Peer, force: bool) -> None:
        if not peer.connected:
            return
        peer.connected = False
        try:
            if (request := ucp.close_endpoint(peer.endpoint, force)) is not None:
                self._closing.append(request)
        except AgentError as exc:
            log.info("UCX agent %s: closing the endpoint to %s: %s", self.name, peer.name, exc)

    def _drop_requests(self, transfer: UcxTransfer) -> None:
        """Close time, even cancelling did not end them: UCX frees the requests when (if ever) they end."""
        log.warning("UCX agent %s: a READ from %s did not end by close", self.name, transfer.peer.name)
        for request in transfer.requests[transfer.reaped :]:
            ucp.request_free(request)
        transfer.reaped = len(transfer.requests)
        if transfer.note is not None:
            ucp.request_free(transfer.note[0])
            transfer.note = None
        transfer.error = transfer.error or "closed"
        self._running.discard(transfer)
        self._unuse(transfer.peer)

    def _progress_until(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + _CLOSE_S
        while not done() and time.monotonic() < deadline:
            self._advance()
        if not done():
            log.warning("UCX agent %s: gave up waiting for %s after %.0f s", self.name, what, _CLOSE_S)

    def _peer(self, name: str, what: str) -> _Peer:
        self._check_open(what)
        try:
            return self._remotes[name]
        except KeyError:
            raise AgentError(f"{what}: agent {name!r} is not loaded") from None

    def _check_usable(self, peer: _Peer, what: str) -> None:
        if peer.retired:
            raise AgentError(f"{what}: agent {peer.name!r} was forgotten or reloaded since the list was prepared")
        if peer.failed:
            raise AgentError(f"{what}: the endpoint to {peer.name!r} failed ({ucp.status_string(peer.failed)})")

    def _check_open(self, what: str) -> None:
        if self._closed or self._stopping:
            raise AgentError(f"{what}: the agent is closed")

    def _regions(self, peer: _Peer | None, addresses: np.ndarray, lengths: np.ndarray, what: str) -> np.ndarray:
        """The region of each entry (the peer's, or this agent's registrations); AgentError for one outside all."""
        spans = peer.spans if peer is not None else [(r.address, r.nbytes) for r in self._registrations]
        owner = f"agent {peer.name}'s" if peer is not None else "this agent's"
        return entries.located(what, addresses, lengths, spans, f"{owner} registered memory")


_Runs = tuple[list[int], list[int], list[int], list[int]]


def _runs(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, regions: np.ndarray) -> _Runs:
    """Entries merged where they continue each other on both sides inside one remote region (one GET each), as
    (local addresses, remote addresses, lengths, remote regions); empty entries are dropped."""
    keep = lengths > 0
    local, remote, merged, first = entries.runs(local[keep], remote[keep], lengths[keep], (regions[keep],))
    return local.tolist(), remote.tolist(), merged.tolist(), regions[keep][first].tolist()


def _finished(request: int, what: str) -> bool:
    """Free a request that ended (logging a failure); False while it runs."""
    status = ucp.request_status(request)
    if status == ucp.INPROGRESS:
        return False
    ucp.request_free(request)
    if status != ucp.OK:  # a closing endpoint whose peer went first: expected, not news
        level = logging.INFO if what == "close an endpoint" else logging.WARNING
        log.log(level, "UCX could not %s: %s (%d)", what, ucp.status_string(status), status)
    return True


def _env_timeout() -> float:
    try:
        return max(0.001, float(os.environ[TIMEOUT_ENV]))
    except (KeyError, ValueError):
        return _TIMEOUT_S
