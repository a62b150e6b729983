"""The NIXL transfer agent (UCX backend by default): one-sided READs with completion notifications, through the
compiled core (``nixl_kv._core`` over NIXL's C API; ``nixl_core`` finds and loads it)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nixl_kv.agents.nixl_core import core
from nixl_kv.agents.ucx_config import bound_tcp_failures
from nixl_kv.errors import AgentError
from nixl_kv.interfaces import TransferAgent, TransferStatus
from nixl_kv.layout import MemoryKind, MemoryRegion

log = logging.getLogger(__name__)

RDMA_DEVICES = Path("/sys/class/infiniband")
SEAL_BYTES = 8


def seal_metadata(metadata: bytes) -> bytes:
    """NIXL's agent metadata followed by a checksum of it: NIXL and UCX parse the blob in C, and about 1 in 9,000
    damaged blobs aborted or crashed the whole process there (scripts/fuzz.sh), so a blob whose checksum fails is
    refused before NIXL sees it. It catches damage, not forgery (docs/trust_model.md)."""
    return metadata + _metadata_digest(metadata)


def unseal_metadata(sealed: bytes) -> bytes:
    """The NIXL metadata inside ``sealed``; AgentError if the blob is too short or its checksum fails."""
    body, digest = sealed[:-SEAL_BYTES], sealed[-SEAL_BYTES:]
    if len(sealed) <= SEAL_BYTES or _metadata_digest(body) != digest:
        raise AgentError(f"NIXL metadata ({len(sealed)} bytes) is damaged: its checksum fails")
    return body


def _metadata_digest(metadata: bytes) -> bytes:
    return hashlib.blake2b(metadata, digest_size=SEAL_BYTES, person=b"nixl_kv-agentmd").digest()


def skip_ucx_ib_without_rdma_devices(environ: dict[str, str] = os.environ) -> bool:
    """On a host with the RDMA libraries (libibverbs, as Mooncake's engine needs) but no RDMA device, the UCX that
    nixl 1.5.1 bundles loads its IB modules and the process segfaults at exit. Without a device they have nothing
    to do: unless the user chose ``UCX_MODULES``, skip them. True if it did."""
    if "UCX_MODULES" in environ or (RDMA_DEVICES.is_dir() and any(RDMA_DEVICES.iterdir())):
        return False
    environ["UCX_MODULES"] = "^ib"
    return True


_MEMORY = {MemoryKind.DRAM: 0, MemoryKind.VRAM: 1}  # NIXL's memory types (nixl_kv/csrc/nixl_capi.h)


class NixlAgent(TransferAgent):
    """A NIXL agent through the compiled core (``nixl_kv._core``, NIXL's C API), plus the bookkeeping that lets
    ``close`` release everything it created.

    Two NIXL agents of one name stand behind it: the data agent posts READs and receives notifications; the control
    agent, with a UCX worker and endpoints of its own, sends every notification. A notification sent on the READ's
    endpoint slowed the next READ to that peer 4-5x (``scripts/bench_notify_taint.py``); peers see one name, and
    answer it on the data agent, whose metadata is the one they load.

    Thread-safe: NIXL's strict synchronization mode serializes calls into each agent, so the caller's thread can
    post and check READs while the progress loop polls notifications. Each call releases the GIL once.
    """

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",), progress_thread: bool = False) -> None:
        """``progress_thread`` starts NIXL's own busy-polling thread; off by default, because the transceiver's
        progress loop already polls the agent while transfers are pending, and a second spinning thread per
        agent halved throughput on a 2-core machine."""
        skip_ucx_ib_without_rdma_devices()  # before UCX starts
        bound_tcp_failures()
        self.name = name
        self._agent = core().Agent(name, tuple(backends), progress_thread)
        self._control = core().Agent(name, tuple(backends), False)
        self._prepared: dict[int, tuple[Any, str | None]] = {}  # by id: the list and the peer it describes
        self._transfers: dict[Any, str] = {}  # not yet released -> the peer it reads from
        self._remotes: set[str] = set()
        self._closed = False

    def metadata(self) -> bytes:
        return seal_metadata(self._agent.metadata())

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        by_kind: dict[MemoryKind, list[tuple[int, int, int]]] = {}
        for region in regions:
            by_kind.setdefault(region.memory, []).append((region.address, region.nbytes, region.device_id))
        for memory, rows in by_kind.items():
            self._agent.register(_MEMORY[memory], _rows(np.array(rows, dtype=np.uint64)))

    def load_remote(self, metadata: bytes, name: str) -> None:
        if not isinstance(metadata, bytes):
            raise AgentError(f"NIXL metadata must be bytes, not {type(metadata).__name__}")
        body = unseal_metadata(metadata)
        loaded = self._agent.load_remote(body)  # the name the metadata holds, as bytes
        try:
            described = loaded.decode()
        except UnicodeDecodeError:
            described = None
        if described == name:
            try:
                self._control.load_remote(body)
            except AgentError:
                if name not in self._remotes:
                    self._agent.invalidate_remote(loaded)
                raise
            with contextlib.suppress(AgentError):  # now, so the first notification to it does not wait for UCX's
                self._control.connect(name)  # wire-up (the peer's answers must not miss short deadlines)
            self._remotes.add(name)
            return
        if described not in self._remotes:  # loaded by this call alone (a name loaded before stays as it was)
            self._agent.invalidate_remote(loaded)
        shown = repr(described) if described is not None else f"{loaded[:64]!r} (not UTF-8)"
        raise AgentError(f"metadata given for agent {name!r} describes agent {shown}")

    def has_remote(self, name: str | bytes) -> bool:
        """Whether NIXL holds metadata of the agent ``name`` (a name need not be text)."""
        return self._agent.has_remote(name if isinstance(name, bytes) else name.encode())

    def connect(self, name: str) -> None:
        self._agent.connect(name)
        self._control.connect(name)

    def forget_remote(self, name: str) -> None:
        if name in self._remotes:
            self._remotes.discard(name)
            self._agent.invalidate_remote(name.encode())
            self._control.invalidate_remote(name.encode())

    def close_peer(self, name: str) -> bool:
        """NIXL can only remove the remote agent, and that closes its UCX endpoints gracefully: READs in flight then
        read FAILED, yet a peer that answers later still writes their bytes (measured: a stopped peer resumed after
        the removal, and the READ's destination filled). So while a READ from the peer is in flight nothing is done
        (False): the transport ends it itself when the peer's host is gone (``ucx_config``: about a second), or the
        peer answers it. With none in flight, its lists are released and the remote agent removed (True)."""
        if any(self.status(transfer) is TransferStatus.IN_PROGRESS for transfer in self._from(name)):
            return False
        for prepared in [prepared for prepared, owner in list(self._prepared.values()) if owner == name]:
            self.release_prepared(prepared)
        self.forget_remote(name)
        return True

    def _from(self, name: str) -> list[Any]:
        return [transfer for transfer, peer in list(self._transfers.items()) if peer == name]

    def prepare(self, owner: str | None, descriptors: np.ndarray, memory: MemoryKind) -> Any:
        rows = np.ascontiguousarray(descriptors, dtype=np.uint64)
        if rows.ndim != 2:
            raise AgentError(f"descriptor rows of shape {rows.shape}, expected Nx3 or Nx5")
        prepared = self._agent.prepare(owner, _MEMORY[memory], rows)
        self._prepared[id(prepared)] = (prepared, owner)
        return prepared

    def release_prepared(self, prepared: Any) -> None:
        if self._prepared.pop(id(prepared), None) is not None:
            self._agent.release_prepared(prepared)

    def read(
        self,
        local: Any,
        local_indices: np.ndarray,
        remote: Any,
        remote_indices: np.ndarray,
        notification: bytes,
    ) -> Any:
        transfer = self._agent.read(
            local,
            np.ascontiguousarray(local_indices, dtype=np.int32),
            remote,
            np.ascontiguousarray(remote_indices, dtype=np.int32),
            notification,
        )
        self._transfers[transfer] = transfer.peer
        return transfer

    def read_ranges(
        self,
        peer: str,
        local_rows: np.ndarray,
        local_memory: MemoryKind,
        remote_rows: np.ndarray,
        remote_memory: MemoryKind,
        notification: bytes,
    ) -> Any:
        transfer = self._agent.read_rows(
            peer, _MEMORY[local_memory], _rows(local_rows), _MEMORY[remote_memory], _rows(remote_rows), notification
        )
        self._transfers[transfer] = peer
        return transfer

    def status(self, transfer: Any) -> TransferStatus:
        return _status(self._agent.status(transfer))

    def statuses(self, transfers: Sequence[Any]) -> list[TransferStatus]:
        """The status of each transfer, in one call into the core."""
        return [_status(code) for code in self._agent.statuses(transfers)]

    def release_transfer(self, transfer: Any) -> bool:
        code = self._agent.release_transfer(transfer)
        if code != 0:
            log.warning("NIXL could not release (cancel) a transfer (status %d)", code)
            return False
        self._transfers.pop(transfer, None)
        return True

    def notify(self, peer: str, message: bytes) -> None:
        """Through the control agent: never on the endpoint the READs from ``peer`` use."""
        self._control.notify(peer, message)

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """The data agent's notifications (the control agent is polled too: its sends complete as it progresses,
        and nothing is addressed to it)."""
        found = []
        for sender, message in self._agent.notifications() + self._control.notifications():
            try:
                found.append((sender.decode(), message))
            except UnicodeDecodeError:  # no peer of ours has such a name: nothing could answer it
                log.warning("dropped a notification: its sender's agent name is not UTF-8")
        return found

    def close(self) -> None:
        """Release transfers, descriptor lists, remote agents and registrations, in that order, then both agents."""
        if self._closed:
            return
        self._closed = True
        for transfer in list(self._transfers):
            self.release_transfer(transfer)
        for prepared, _ in list(self._prepared.values()):
            self.release_prepared(prepared)
        for name in list(self._remotes):
            try:
                self.forget_remote(name)
            except AgentError as exc:
                log.warning("%s", exc)
        try:
            self._agent.deregister_all()
        except AgentError as exc:
            log.warning("deregistration failed: %s", exc)
        self._agent.close()  # the NIXL agents themselves: each holds a UCX worker and its file descriptors
        self._control.close()

    @property
    def live_handles(self) -> dict[str, int]:
        """What the agent still holds (tests assert it is all zero after close)."""
        return {
            "transfers": len(self._transfers),
            "prepared": len(self._prepared),
            "remotes": len(self._remotes),
            "registrations": self._agent.registration_count,
        }


def _status(code: int) -> TransferStatus:
    if code == 1:
        return TransferStatus.IN_PROGRESS
    return TransferStatus.DONE if code == 0 else TransferStatus.FAILED


def _rows(rows: np.ndarray) -> np.ndarray:
    """Nx3 (address, length, device) rows as the core takes them; AgentError for anything else."""
    table = np.ascontiguousarray(rows, dtype=np.uint64)
    if table.ndim != 2 or table.shape[1] != 3:
        raise AgentError(f"descriptor rows of shape {table.shape}, expected Nx3")
    return table
