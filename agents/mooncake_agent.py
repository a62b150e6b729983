"""The Mooncake transfer-engine agent: one-sided READs over Mooncake's TCP transport, without a metadata server.

Why it is built this way (``mooncake.engine`` of mooncake-transfer-engine 0.3.13):

- Each engine runs in P2P-handshake mode (metadata server ``"P2PHANDSHAKE"``): it listens on an RPC port of its
  own, and a peer fetches its segment (registered buffers, TCP data port) from that port on first use. The engine's
  session id is ``"<hostname>:<rpc port>"``; ``metadata()`` is msgpack of the agent name and that session id (a
  few dozen bytes), so no etcd or HTTP metadata server is involved.
- The binding has no non-blocking status for a batch of several entries (``transfer_check_status`` looks at entry 0
  only and frees the batch; ``get_batch_transfer_status`` blocks), so each READ runs as one ``batch_transfer_sync``
  on a small thread pool and ``status`` looks at its future. A running READ cannot be cancelled; the engine ends
  one that cannot finish after ``MC_TRANSFER_TIMEOUT`` seconds (default 30, at least 5) plus 1 ns per byte: a
  dead peer fails at once (connection refused), a stopped one (SIGSTOP) at that timeout.
- Notifications are the engine's own (``TransferNotify``, ``get_notifies``): the engine sends a READ's notification
  when the READ's batch status turns COMPLETED, so only after its bytes landed, and never for a failed READ. The
  binding has no standalone send, so ``notify`` queues, on a notifier thread of the agent's, a zero-length READ
  that carries the notification (the TCP transport completes it without a round trip). A READ's notification has
  gone out before its status reads DONE, so whatever is notified after that arrives after it. Messages travel
  base64-encoded (the engine carries them as JSON text); the notification's name is the sender's agent name, as
  untrusted as NIXL's.
- The TCP server checks every remote range against its own registered buffers (an unregistered range fails the
  READ); local ranges are checked here, at ``prepare`` and ``read_ranges``, because the TCP client copies into
  local addresses unchecked.
- Entries that continue each other on both sides, within one descriptor row, are merged into one request: the TCP
  transport sends every entry as a request of its own. Merging stops at row boundaries, because the server accepts
  a range only inside one registered buffer, and the buffers of the peer are not known here. Runs longer than
  4 MiB are cut, so that they travel on several of the transport's connections at once.
- The TCP transport fails (it does not wait for) entries beyond its queue per peer (1024,
  ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``), so a READ is posted in pieces of at most that queue over the pool's
  workers, one piece after the other; the notification rides on the last.
- A READ reads FAILED as soon as one of its entries failed, while others may still be landing (the engine gives
  no way to wait for them): like a READ NIXL cannot cancel, its destination must be treated as poisoned.
- The non-CUDA build (``mooncake-transfer-engine-non-cuda``) moves DRAM only: VRAM raises NotSupportedError.
- The engine picks its transport from the environment when it initialises, not from ``initialize``'s protocol
  (which only picks an allocator): left alone, the CUDA build on a host without RDMA devices asks for the
  multi-node NVLink transport, which the wheel does not build, and fails. So the agent sets, for the engine's
  initialisation only, the variable that names its protocol (``NIXL_KV_MOONCAKE_PROTOCOL``): ``tcp`` (the
  default, ``MC_FORCE_TCP``: any memory, VRAM staged through the host), ``nvlink_intra`` or ``auto`` (the engine's
  own choice, RDMA where it finds a device).
- ``nvlink_intra`` (``MC_INTRANODE_NVLINK``: CUDA IPC between processes of one host) registers VRAM only, and
  nixl_kv's hold board is DRAM. So that agent runs two engines: a TCP one for DRAM and for every notification, and
  an NVLink one for VRAM-to-VRAM READs, whose notification follows its last piece as a zero-length READ on the TCP
  engine (so notifications keep one order, and one queue to poll). Its metadata names both sessions.

``forget_remote`` only drops the name: the binding cannot close the engine's cached segment of that peer. So
``close_peer`` cannot end READs in flight either (it only forgets the peer; their status stays true): the binding has
no call that cancels a batch or closes one peer's connections. A READ from a dead peer fails at once (connection
refused); one from a stopped peer runs until ``MC_TRANSFER_TIMEOUT`` (at least 5 s) and one whose first contact is a
host that vanished waits for the engine's handshake (measured over 30 s), its destination poisoned meanwhile, and
holding one of the ``max_inflight`` pool workers, so READs from live peers queue behind it.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from nixl_kv.agents.descriptors import checked, located, runs, table
from nixl_kv.agents.flat_agent import FlatAgent, FlatPrepared
from nixl_kv.config import ENV_PREFIX
from nixl_kv.errors import AgentError, NotSupportedError
from nixl_kv.interfaces import TransferStatus
from nixl_kv.layout import MemoryKind, MemoryRegion

log = logging.getLogger(__name__)

HOSTNAME_ENV = f"{ENV_PREFIX}MOONCAKE_HOSTNAME"
PROTOCOL_ENV = f"{ENV_PREFIX}MOONCAKE_PROTOCOL"
PROTOCOLS = {"tcp": {"MC_FORCE_TCP": "1"}, "nvlink_intra": {"MC_INTRANODE_NVLINK": "1"}, "auto": {}}
_FORMAT = "nixl_kv.mooncake/1"
_FIELDS = {"format", "agent", "session"}
_VRAM_FIELD = "vram"  # only in the metadata of an nvlink_intra agent
_MAX_METADATA_BYTES = 1024
_MAX_ENTRY_BYTES = 4 << 20  # loopback DRAM, 64 MiB: 0.8 GB/s as one entry, 1.6 GB/s as 4 MiB pieces
_QUEUED_PER_PEER = 1024  # the TCP transport's default; it fails (not waits for) entries beyond its queue
_SESSION = re.compile(r"[A-Za-z0-9._\-\[\]:]{1,253}:[0-9]{1,5}")


@dataclass(frozen=True)
class MooncakeMetadata:
    """What a peer needs to reach an agent: its name and its engines' session ids (``host:rpc_port``): the one for
    DRAM and notifications, and an nvlink_intra agent's one for VRAM."""

    agent: str
    session: str
    vram_session: str | None = None

    def encode(self) -> bytes:
        fields = {"format": _FORMAT, "agent": self.agent, "session": self.session}
        if self.vram_session is not None:
            fields[_VRAM_FIELD] = self.vram_session
        return msgpack.packb(fields)

    @staticmethod
    def decode(data: bytes) -> MooncakeMetadata:
        """Validate untrusted bytes; AgentError names what is wrong."""
        if not isinstance(data, bytes) or not 0 < len(data) <= _MAX_METADATA_BYTES:
            raise AgentError(f"Mooncake metadata must be 1 to {_MAX_METADATA_BYTES} bytes")
        try:
            fields = msgpack.unpackb(data, raw=False)
        except Exception as exc:  # msgpack raises several types (and UnicodeDecodeError for a non-text name)
            raise AgentError(f"Mooncake metadata is not valid msgpack: {type(exc).__name__}: {exc}") from exc
        if not isinstance(fields, dict) or set(fields) - {_VRAM_FIELD} != _FIELDS or fields["format"] != _FORMAT:
            raise AgentError(f"Mooncake metadata is not a {_FORMAT} map")
        agent, session, vram_session = fields["agent"], fields["session"], fields.get(_VRAM_FIELD)
        if not isinstance(agent, str) or not agent:
            raise AgentError("Mooncake metadata: agent must be a non-empty string")
        for value in (session,) if vram_session is None else (session, vram_session):
            if not _valid_session(value):
                raise AgentError(f"Mooncake metadata: session {value!r} is not host:port")
        return MooncakeMetadata(agent, session, vram_session)


def _valid_session(session: object) -> bool:
    return (
        isinstance(session, str)
        and _SESSION.fullmatch(session) is not None
        and 0 < int(session.rsplit(":", 1)[1]) < 65536
    )


@dataclass(eq=False)
class MooncakeTransfer:
    """A READ running on the agent's pool; its future holds the engine's return code."""

    peer: str
    nbytes: int
    future: Future[int]


@dataclass(frozen=True)
class _Batch:
    """The request lists of one READ, after merging."""

    local: list[int]
    remote: list[int]
    lengths: list[int]


class MooncakeAgent(FlatAgent):
    """A Mooncake ``TransferEngine`` (TCP transport, P2P handshake) plus the bookkeeping ``close`` releases.

    Thread-safe as far as the engine is: READs run on the agent's pool, and the progress loop may poll
    notifications while the caller's thread posts and checks READs.
    """

    LABEL = "Mooncake"

    def __init__(
        self,
        name: str,
        progress_thread: bool = False,
        hostname: str | None = None,
        protocol: str | None = None,
        max_inflight: int = 2,
    ) -> None:
        """``hostname``: the address peers reach this engine at; by default ``NIXL_KV_MOONCAKE_HOSTNAME``, else
        127.0.0.1 (one host only). The transceiver passes neither, so across hosts set the variable.
        ``protocol``: one of ``PROTOCOLS``; by default ``NIXL_KV_MOONCAKE_PROTOCOL``, else ``tcp``.
        ``progress_thread`` is accepted for the registry's call and ignored: the engine runs its own threads.
        ``max_inflight``: READs running at once; each waits for its batch in a spinning loop of the engine's,
        so more than the cores available only slows the others down."""
        try:
            import mooncake.engine as engine_module
        except ImportError as exc:
            raise NotSupportedError(
                f"the Mooncake agent needs mooncake-transfer-engine (or -non-cuda): {type(exc).__name__}: {exc}"
            ) from exc
        super().__init__()
        self.name = name
        hostname = hostname or os.environ.get(HOSTNAME_ENV, "127.0.0.1")
        protocol = protocol or os.environ.get(PROTOCOL_ENV, "tcp")
        if protocol not in PROTOCOLS:
            raise NotSupportedError(f"Mooncake protocol {protocol!r} is not one of {sorted(PROTOCOLS)}")
        self._module = engine_module
        self._engine: Any = self._start(hostname, "tcp" if protocol == "nvlink_intra" else protocol)
        self._vram_engine: Any = self._start(hostname, protocol) if protocol == "nvlink_intra" else None
        self._metadata = MooncakeMetadata(
            name,
            f"{hostname}:{self._call('read its RPC port', 'get_rpc_port')}",
            None if self._vram_engine is None else f"{hostname}:{self._vram_engine.get_rpc_port()}",
        )
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix=f"mooncake-{name}")
        self._piece = max(1, _queued_per_peer() // max_inflight)
        self._notifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mooncake-notify-{name}")
        self._registrations: list[tuple[int, int]] = []  # (address, nbytes), kept sorted by address
        self._on_vram_engine: list[int] = []  # addresses registered with the VRAM engine
        self._transfers: set[MooncakeTransfer] = set()
        self._remotes: dict[str, MooncakeMetadata] = {}
        self._closed = False

    def metadata(self) -> bytes:
        return self._metadata.encode()

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        for memory in {region.memory for region in regions}:
            self._check_memory(memory)
        for location, group in _by_location(regions).items():
            addresses, sizes = [r.address for r in group], [r.nbytes for r in group]
            vram_engine = group[0].memory is MemoryKind.VRAM and self._vram_engine is not None
            engine = self._vram_engine if vram_engine else self._engine
            self._check("register memory", "batch_register_memory", addresses, sizes, location, engine=engine)
            self._registrations = sorted([*self._registrations, *zip(addresses, sizes, strict=True)])
            self._on_vram_engine += addresses if vram_engine else []

    def load_remote(self, metadata: bytes, name: str) -> None:
        described = MooncakeMetadata.decode(metadata)
        if described.agent != name:
            raise AgentError(f"metadata given for agent {name!r} describes agent {described.agent!r}")
        self._remotes[name] = described

    def connect(self, name: str) -> None:
        self._check(f"connect to {name}", "send_probe", self._peer(name, f"connect to {name}").session)

    def forget_remote(self, name: str) -> None:
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
        local, remote = _ranges(local_rows), _ranges(remote_rows)
        self._check_local(local[0], local[1], "describe local ranges")
        return self._post(peer, _batch(local, remote), notification, (local_memory, remote_memory))

    def status(self, transfer: Any) -> TransferStatus:
        future = transfer.future
        if not future.done():
            return TransferStatus.IN_PROGRESS
        if future.cancelled():
            return TransferStatus.FAILED
        if (error := future.exception()) is not None:
            log.warning("Mooncake READ from %s raised: %s: %s", transfer.peer, type(error).__name__, error)
            return TransferStatus.FAILED
        return TransferStatus.DONE if future.result() == 0 else TransferStatus.FAILED

    def release_transfer(self, transfer: Any) -> bool:
        if not (transfer.future.done() or transfer.future.cancel()):
            return False  # running in the engine: it cannot be cancelled, only waited for
        self._transfers.discard(transfer)
        return True

    def notify(self, peer: str, message: bytes) -> None:
        """Queued on the agent's notifier thread, in order: the engine's handshake with a peer that stopped (not
        died) blocks for up to 60 s, which must not stall the caller's progress loop. A failed send is logged."""
        what = f"notify {peer}"
        session = self._peer(peer, what).session
        if self._closed:
            raise AgentError(f"Mooncake could not {what}: the agent is closed")
        note = self._module.TransferNotify(self.name, _encode(message))
        self._notifier.submit(self._send, what, session, note)

    def _send(self, what: str, session: str, note: Any) -> None:
        try:
            self._check(what, "batch_transfer_sync", session, [0], [0], [0], self._module.TransferOpcode.Read, note)
        except AgentError as exc:
            log.warning("%s", exc)

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        try:
            found = self._call("get notifications", "get_notifies")
        except AgentError as exc:
            log.warning("%s", exc)
            return []
        return [message for note in found if (message := _decoded(note)) is not None]

    def close(self) -> None:
        """Send queued notifications, wait for running READs (the engine bounds both), then drop transfers, lists,
        peers, registrations and the engine, whose destructor closes its sockets and threads (about a second)."""
        if self._closed:
            return
        self._closed = True
        self._notifier.shutdown(wait=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._transfers.clear()
        self._prepared.clear()
        self._remotes.clear()
        on_vram_engine = set(self._on_vram_engine)
        for engine, addresses in (
            (self._engine, [a for a, _ in self._registrations if a not in on_vram_engine]),
            (self._vram_engine, self._on_vram_engine),
        ):
            try:
                if addresses:
                    self._check("deregister memory", "batch_unregister_memory", addresses, engine=engine)
            except AgentError as exc:
                log.warning("%s", exc)
        self._registrations.clear()
        self._on_vram_engine.clear()
        self._engine = self._vram_engine = None

    def _admit(self, owner: str | None, addresses: np.ndarray, lengths: np.ndarray, what: str) -> tuple[None, None]:
        if owner is None:
            self._check_local(addresses, lengths, what)
        else:
            self._peer(owner, what)
        return None, None

    def _read_lists(self, local: FlatPrepared, remote: FlatPrepared, notification: bytes) -> MooncakeTransfer:
        batch = _batch((local.addresses, local.lengths, local.rows), (remote.addresses, remote.lengths, remote.rows))
        return self._post(remote.owner, batch, notification, (local.memory, remote.memory))

    def _post(
        self, peer: str, batch: _Batch, notification: bytes, memory: tuple[MemoryKind, MemoryKind]
    ) -> MooncakeTransfer:
        what = f"post READ from {peer}"
        described = self._peer(peer, what)
        if self._closed:
            raise AgentError(f"Mooncake could not {what}: the agent is closed")
        note = self._module.TransferNotify(self.name, _encode(notification)) if notification else None
        if self._vram_engine is None:
            job = (self._engine, described.session, batch, note, None)
        elif memory != (MemoryKind.VRAM, MemoryKind.VRAM) or described.vram_session is None:
            raise AgentError(
                f"Mooncake could not {what}: nvlink_intra reads VRAM into VRAM between nvlink_intra agents"
                f" (here {memory[1].name} into {memory[0].name}, peer protocol"
                f" {'nvlink_intra' if described.vram_session else 'not nvlink_intra'})"
            )
        else:
            job = (self._vram_engine, described.vram_session, batch, note, described.session)
        transfer = MooncakeTransfer(peer, sum(batch.lengths), self._pool.submit(self._read, *job))
        self._transfers.add(transfer)
        return transfer

    def _read(self, engine: Any, session: str, batch: _Batch, note: Any, note_session: str | None) -> int:
        """Runs on the pool: the READ in pieces of at most ``_piece`` entries, one after the other. The notification
        rides the last piece, or, on the VRAM engine (``note_session`` given), follows it on the TCP engine. The
        TCP transport fails what exceeds its queue per peer, shared by the pool's workers."""
        read = self._module.TransferOpcode.Read
        inline = note if note_session is None else None
        for start in range(0, len(batch.lengths), self._piece):
            end = start + self._piece
            last = end >= len(batch.lengths)
            pieces = (batch.local[start:end], batch.remote[start:end], batch.lengths[start:end])
            if code := engine.batch_transfer_sync(session, *pieces, read, inline if last else None):
                return code
        if note is not None and note_session is not None:
            return self._engine.batch_transfer_sync(note_session, [0], [0], [0], read, note)
        return 0

    def _start(self, hostname: str, protocol: str) -> Any:
        """An engine initialised for ``protocol`` (whose variables the engine reads while it initialises)."""
        engine = self._module.TransferEngine()
        with _environment(PROTOCOLS[protocol]):
            code = engine.initialize(hostname, "P2PHANDSHAKE", protocol, "")
        if code != 0:
            raise AgentError(f"Mooncake could not initialize a {protocol} engine: initialize returned {code}")
        return engine

    def _peer(self, name: str, what: str) -> MooncakeMetadata:
        try:
            return self._remotes[name]
        except KeyError:
            raise AgentError(f"Mooncake could not {what}: agent {name!r} is not loaded") from None

    def _check_memory(self, memory: MemoryKind) -> None:
        if memory is MemoryKind.VRAM and not self._module.SUPPORT_CUDA:
            raise NotSupportedError("VRAM needs a CUDA build of Mooncake; mooncake-transfer-engine-non-cuda moves DRAM")

    def _check_local(self, addresses: np.ndarray, lengths: np.ndarray, what: str) -> None:
        """Every entry inside one registered region (the TCP client would copy into any address)."""
        located(f"Mooncake could not {what}", addresses, lengths, self._registrations, "registered memory")

    def _call(self, what: str, method: str, *args: Any, engine: Any = None) -> Any:
        engine = engine or self._engine
        if engine is None:
            raise AgentError(f"Mooncake could not {what}: the agent is closed")
        try:
            return getattr(engine, method)(*args)
        except Exception as exc:  # the binding raises TypeError/RuntimeError; none may escape as such
            raise AgentError(f"Mooncake could not {what}: {type(exc).__name__}: {exc}") from exc

    def _check(self, what: str, method: str, *args: Any, engine: Any = None) -> None:
        """Call an engine method (of the TCP engine unless ``engine`` is given) that reports failure as a non-zero
        return code."""
        if (code := self._call(what, method, *args, engine=engine)) != 0:
            raise AgentError(f"Mooncake could not {what}: {method} returned {code}")


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """Set variables for the engine's initialisation (which reads them), then restore what was there."""
    saved = {key: os.environ.get(key) for key in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _queued_per_peer() -> int:
    """The TCP transport's queue of entries per peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, 1024 unless set)."""
    try:
        return max(1, int(os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "")))
    except ValueError:
        return _QUEUED_PER_PEER


def _by_location(regions: Sequence[MemoryRegion]) -> dict[str, list[MemoryRegion]]:
    """Regions grouped by the engine's location string: ``*`` (found by the engine) for DRAM, ``cuda:N`` else."""
    groups: dict[str, list[MemoryRegion]] = {}
    for region in regions:
        location = "*" if region.memory is MemoryKind.DRAM else f"cuda:{region.device_id}"
        groups.setdefault(location, []).append(region)
    return groups


def _ranges(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nx3 rows as (addresses, lengths, row ids): every row is a range of its own (never merged)."""
    rows = checked(table, "Mooncake could not describe ranges", rows, (3,))
    return rows[:, 0], rows[:, 1], np.arange(len(rows))


def _batch(local: tuple[np.ndarray, ...], remote: tuple[np.ndarray, ...]) -> _Batch:
    """Pair local and remote entries, merge each run that continues on both sides within one row, and cut runs
    longer than ``_MAX_ENTRY_BYTES``: one entry travels on one TCP connection, pieces on several at once."""
    (local_at, local_len, local_row), (remote_at, remote_len, remote_row) = local, remote
    if len(local_at) != len(remote_at) or not len(local_at):
        raise AgentError(f"Mooncake could not create READ: {len(local_at)} local and {len(remote_at)} remote entries")
    if not np.array_equal(local_len, remote_len):
        raise AgentError("Mooncake could not create READ: local and remote entry lengths differ")
    local_at, remote_at, lengths, _ = runs(local_at, remote_at, local_len, (local_row, remote_row), _MAX_ENTRY_BYTES)
    return _Batch(local_at.tolist(), remote_at.tolist(), lengths.tolist())


def _encode(message: bytes) -> str:
    return base64.b64encode(bytes(message)).decode("ascii")


def _decoded(note: Any) -> tuple[str, bytes] | None:
    """A received notification, or None (logged) for one this agent's peers cannot have sent."""
    try:
        return note.name, base64.b64decode(note.msg, validate=True)
    except (UnicodeDecodeError, binascii.Error) as exc:
        log.warning("dropped a notification that is not from a Mooncake agent: %s", exc)
        return None
