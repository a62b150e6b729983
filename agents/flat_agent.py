"""The base of the agents whose transport takes flat (address, length) entries rather than NIXL's prepared lists:
the Mooncake, MPI and UCX agents. It keeps their prepared-list bookkeeping once: rows checked and expanded into
one entry per unit (``descriptors``), the prepared handle, the set of live lists, their release, the entries a READ
picks by index, and the counts ``live_handles`` reports. Each agent supplies only its own: ``_check_memory`` (or
``DRAM_ONLY`` for the default), ``_admit`` (where the entries must lie, what it attaches to a list) and
``_read_lists`` (its READ of the picked entries)."""

from __future__ import annotations

import contextlib
import dataclasses
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from nixl_kv.agents.descriptors import checked, expand, picked
from nixl_kv.errors import AgentError, NotSupportedError
from nixl_kv.interfaces import TransferAgent
from nixl_kv.layout import MemoryKind


@dataclass(eq=False)
class FlatPrepared:
    """A prepared descriptor list: one entry per unit, the row each entry came from, and what the agent attached."""

    agent: str  # the kind of agent that prepared it (``FlatAgent.LABEL``)
    owner: str | None
    memory: MemoryKind
    addresses: np.ndarray  # uint64
    lengths: np.ndarray  # uint64
    rows: np.ndarray  # int64: the descriptor row of each entry
    peer: Any = None  # what the agent attached for the owner (UCX: its loaded peer)
    regions: np.ndarray | None = None  # int64: the region of each entry, for agents that find it (UCX)

    def take(self, at: np.ndarray) -> FlatPrepared:
        """The entries ``at`` (checked indices) as a list of their own, not kept by the agent."""
        regions = None if self.regions is None else self.regions[at]
        picked_rows = {"addresses": self.addresses[at], "lengths": self.lengths[at], "rows": self.rows[at]}
        return dataclasses.replace(self, **picked_rows, regions=regions)


class FlatAgent(TransferAgent):
    """Prepared lists and the counts of what an agent holds; the agent keeps ``_transfers``, ``_remotes`` and
    ``_registrations`` (counted by ``live_handles``) and drops them, and ``_prepared``, at ``close``."""

    LABEL: ClassVar[str]  # the agent's name in its errors: "<LABEL> could not ..."
    FOREIGN: ClassVar[str | None] = None  # why a list another kind of agent prepared is refused; None: not checked
    DRAM_ONLY: ClassVar[str] = ""  # why the agent moves DRAM only (the default ``_check_memory``)

    _transfers: set[Any]
    _remotes: dict[str, Any]
    _registrations: list[Any]

    def __init__(self, lock: contextlib.AbstractContextManager[Any] | None = None) -> None:
        """``lock``: the agent's own lock, taken around the bookkeeping (and ``_admit``); None: none."""
        self._books = lock if lock is not None else contextlib.nullcontext()
        self._prepared: set[FlatPrepared] = set()

    def _check_memory(self, memory: MemoryKind) -> None:
        """NotSupportedError for memory the agent cannot move: by default any but DRAM, ``DRAM_ONLY`` saying why."""
        if memory is not MemoryKind.DRAM:
            raise NotSupportedError(self.DRAM_ONLY)

    @abstractmethod
    def _admit(
        self, owner: str | None, addresses: np.ndarray, lengths: np.ndarray, what: str
    ) -> tuple[Any, np.ndarray | None]:
        """Check the entries of a list being prepared (``what``: "prepare descriptors of ..."), under the lock;
        return what the list carries besides them: the peer and the region of each entry (None, None: neither)."""

    @abstractmethod
    def _read_lists(self, local: FlatPrepared, remote: FlatPrepared, notification: bytes) -> Any:
        """Post a READ of the remote entries picked into the local ones (as many of each, in order)."""

    def prepare(self, owner: str | None, descriptors: np.ndarray, memory: MemoryKind) -> Any:
        what = f"prepare descriptors of {owner or 'local memory'}"
        self._check_memory(memory)
        addresses, lengths, rows = checked(expand, f"{self.LABEL} could not {what}", descriptors)
        with self._books:
            peer, regions = self._admit(owner, addresses, lengths, what)
            prepared = FlatPrepared(self.LABEL, owner, memory, addresses, lengths, rows, peer, regions)
            self._prepared.add(prepared)
        return prepared

    def release_prepared(self, prepared: Any) -> None:
        with self._books:
            self._prepared.discard(prepared)

    def read(
        self,
        local: Any,
        local_indices: np.ndarray,
        remote: Any,
        remote_indices: np.ndarray,
        notification: bytes,
    ) -> Any:
        what = f"{self.LABEL} could not create READ"
        if self.FOREIGN is not None and not all(_made_by(self.LABEL, lists) for lists in (local, remote)):
            raise AgentError(f"{what}: {self.FOREIGN}")
        if local.owner is not None or remote.owner is None:
            raise AgentError(f"{what}: needs a local and a remote descriptor list")
        local_at = checked(picked, what, local_indices, len(local.addresses))
        remote_at = checked(picked, what, remote_indices, len(remote.addresses))
        return self._read_lists(local.take(local_at), remote.take(remote_at), notification)

    @property
    def live_handles(self) -> dict[str, int]:
        """What the agent still holds (tests assert it is all zero after close)."""
        return {
            "transfers": len(self._transfers),
            "prepared": len(self._prepared),
            "remotes": len(self._remotes),
            "registrations": len(self._registrations),
        }


def _made_by(label: str, prepared: Any) -> bool:
    return isinstance(prepared, FlatPrepared) and prepared.agent == label
