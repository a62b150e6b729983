"""The NIXL transfer agent (UCX backend by default): one-sided READs with completion notifications."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

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


_STATUS = {"DONE": TransferStatus.DONE, "PROC": TransferStatus.IN_PROGRESS, "ERR": TransferStatus.FAILED}


class NixlAgent(TransferAgent):
    """A ``nixl_agent`` plus the bookkeeping that lets ``close`` release everything it created.

    Thread-safe: NIXL's strict synchronization mode serializes calls into the agent, so the caller's thread can
    post and check READs while the progress loop polls notifications.
    """

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",), progress_thread: bool = False) -> None:
        """``progress_thread`` starts NIXL's own busy-polling thread; off by default, because the transceiver's
        progress loop already polls the agent while transfers are pending, and a second spinning thread per
        agent halved throughput on a 2-core machine."""
        skip_ucx_ib_without_rdma_devices()  # before UCX starts
        bound_tcp_failures()
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.name = name
        config = nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=list(backends),
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent = nixl_agent(name, config)
        self._registrations: list[Any] = []
        self._prepared: dict[int, tuple[Any, str | None]] = {}  # by id: the list and the peer it describes
        self._transfers: dict[Any, str] = {}  # not yet released -> the peer it reads from
        self._remotes: set[str] = set()
        self._closed = False

    def metadata(self) -> bytes:
        return seal_metadata(bytes(self._agent.get_agent_metadata()))

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        by_kind: dict[MemoryKind, list[tuple[int, int, int, str]]] = {}
        for region in regions:
            by_kind.setdefault(region.memory, []).append((region.address, region.nbytes, region.device_id, ""))
        for memory, rows in by_kind.items():
            self._registrations.append(self._call("register memory", self._agent.register_memory, rows, memory.value))

    def load_remote(self, metadata: bytes, name: str) -> None:
        if not isinstance(metadata, bytes):
            raise AgentError(f"NIXL metadata must be bytes, not {type(metadata).__name__}")
        loaded = self._call("load remote metadata", self._agent.add_remote_agent, unseal_metadata(metadata))
        try:  # NIXL returns the name the metadata holds, as bytes
            described = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        except UnicodeDecodeError:
            described = None
        if described == name:
            self._remotes.add(name)
            return
        if described not in self._remotes:  # loaded by this call alone (a name loaded before stays as it was)
            self._call("remove remote agent", self._agent.remove_remote_agent, loaded)
        shown = repr(described) if described is not None else f"{bytes(loaded)[:64]!r} (not UTF-8)"
        raise AgentError(f"metadata given for agent {name!r} describes agent {shown}")

    def connect(self, name: str) -> None:
        self._call(f"connect to {name}", self._agent.make_connection, name)

    def forget_remote(self, name: str) -> None:
        if name in self._remotes:
            self._remotes.discard(name)
            self._call("remove remote agent", self._agent.remove_remote_agent, name)

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
        prepared = self._call(
            f"prepare descriptors of {owner or 'local memory'}",
            self._agent.prep_xfer_dlist,
            owner or "NIXL_INIT_AGENT",
            rows,
            memory.value,
        )
        self._prepared[id(prepared)] = (prepared, owner)
        return prepared

    def release_prepared(self, prepared: Any) -> None:
        if self._prepared.pop(id(prepared), None) is not None:
            prepared.release()

    def read(
        self,
        local: Any,
        local_indices: np.ndarray,
        remote: Any,
        remote_indices: np.ndarray,
        notification: bytes,
    ) -> Any:
        transfer = self._call(
            "create READ",
            self._agent.make_prepped_xfer,
            "READ",
            local,
            np.ascontiguousarray(local_indices, dtype=np.int32),
            remote,
            np.ascontiguousarray(remote_indices, dtype=np.int32),
            notification,
        )
        return self._post(transfer, self._prepared.get(id(remote), (None, ""))[1] or "")

    def _post(self, transfer: Any, peer: str) -> Any:
        self._transfers[transfer] = peer
        try:
            state = self._call("post READ", self._agent.transfer, transfer)
        except AgentError:
            self.release_transfer(transfer)
            raise
        if state == "ERR":
            self.release_transfer(transfer)
            raise AgentError("NIXL refused to post the READ")
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
        local = self._call("describe local ranges", self._agent.get_xfer_descs, _rows(local_rows), local_memory.value)
        remote = self._call(
            "describe remote ranges", self._agent.get_xfer_descs, _rows(remote_rows), remote_memory.value
        )
        transfer = self._call(
            f"create READ from {peer}", self._agent.initialize_xfer, "READ", local, remote, peer, notification
        )
        return self._post(transfer, peer)

    def status(self, transfer: Any) -> TransferStatus:
        try:
            return _STATUS[self._agent.check_xfer_state(transfer)]
        except Exception as exc:  # NIXL raises its own types for a broken connection
            log.warning("transfer state check failed: %s", exc)
            return TransferStatus.FAILED

    def release_transfer(self, transfer: Any) -> bool:
        try:
            transfer.release()
        except Exception as exc:
            log.warning("NIXL could not release (cancel) a transfer: %s", exc)
            return False
        self._transfers.pop(transfer, None)
        return True

    def notify(self, peer: str, message: bytes) -> None:
        self._call(f"notify {peer}", self._agent.send_notif, peer, message)

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        try:
            found = self._agent.get_new_notifs()
        except UnicodeDecodeError:  # NIXL's binding cannot name a sender whose name is not text: it drops the
            log.warning("dropped a batch of notifications: a sender's agent name is not UTF-8")  # whole batch
            return []
        return [
            (sender.decode() if isinstance(sender, bytes) else sender, bytes(message))
            for sender, messages in found.items()
            for message in messages
        ]

    def close(self) -> None:
        """Release transfers, descriptor lists, remote agents and registrations, in that order."""
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
        for registration in self._registrations:
            try:
                self._agent.deregister_memory(registration)
            except Exception as exc:
                log.warning("deregistration failed: %s", exc)
        self._registrations.clear()

    @property
    def live_handles(self) -> dict[str, int]:
        """What the agent still holds (tests assert it is all zero after close)."""
        return {
            "transfers": len(self._transfers),
            "prepared": len(self._prepared),
            "remotes": len(self._remotes),
            "registrations": len(self._registrations),
        }

    @staticmethod
    def _call(what: str, function: Any, *args: Any) -> Any:
        try:
            return function(*args)
        except Exception as exc:  # NIXL's binding raises one class per status code
            raise AgentError(f"NIXL could not {what}: {type(exc).__name__}: {exc}") from exc


def _rows(rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows, dtype=np.uint64).reshape(-1, 3)
