"""The two extension points of nixl_kv: transfer agents and cache formatters (DESIGN §2, §6).

The transceiver layer sees agents and formatters only through these interfaces and the registry (entry point
groups ``nixl_kv.agents`` and ``nixl_kv.formatters``); the implementations (``nixl_kv.agents``,
``nixl_kv.formatters``, kept in the repository's ``agents/`` and ``formatters/``, and third-party plug-ins) import
the data model from ``nixl_kv``, never the reverse.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from nixl_kv.layout import KVLayout, MemoryKind, MemoryRegion, Parts, RnnLayout
from nixl_kv.state import CacheState, DataTransceiverState


class TransferStatus(str, Enum):
    IN_PROGRESS = "in_progress"
    DONE = "done"
    FAILED = "failed"


class TransferAgent(ABC):
    """Moves bytes between registered memory of two processes with one-sided READs.

    Descriptor lists are prepared once (``prepare``) and transfers pick entries by index. ``close`` releases
    every handle, list, remote agent and registration the agent still holds.
    """

    name: str

    @abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this agent (small enough to carry inline in a CommState)."""

    @abstractmethod
    def register(self, regions: Sequence[MemoryRegion]) -> None: ...

    @abstractmethod
    def load_remote(self, metadata: bytes, name: str) -> None:
        """Make the peer ``name`` reachable from its metadata. Loading the same peer twice is harmless. Metadata
        that describes another agent (or one whose name is not text) raises AgentError and leaves every agent
        loaded before as it was: a peer's state is untrusted, and must never unload a live peer."""

    def connect(self, name: str) -> None:  # noqa: B027 - optional: agents that connect lazily keep it
        """Set up the connection to a loaded peer now rather than at the first READ (optional)."""

    @abstractmethod
    def forget_remote(self, name: str) -> None: ...

    def close_peer(self, name: str) -> bool:
        """Close the peer and forget it (``load_remote`` makes it reachable again; lists prepared for it are not
        usable after): for a peer whose READs outlived their requests (it died or hangs), and one whose connection
        broke. READs from it still in flight end FAILED, and nothing of them lands afterwards, where the agent can
        end them; where it cannot, they go on and their status stays true. Returns False, changing nothing, when
        forgetting the peer now would make the status of its READs in flight lie (NIXL): close it again once they
        ended. This default forgets the peer (for agents whose READs report truly without it; they say why they
        cannot end them)."""
        self.forget_remote(name)
        return True

    @abstractmethod
    def prepare(self, owner: str | None, descriptors: np.ndarray, memory: MemoryKind) -> Any:
        """Prepare a descriptor list: Nx3 (address, length, device) or strided Nx5 (.., stride, count) rows.

        ``owner`` None means local memory; otherwise the peer agent whose memory the rows describe.
        """

    @abstractmethod
    def release_prepared(self, prepared: Any) -> None: ...

    @abstractmethod
    def read(
        self,
        local: Any,
        local_indices: np.ndarray,
        remote: Any,
        remote_indices: np.ndarray,
        notification: bytes,
    ) -> Any:
        """Post a READ of remote entries into local entries; the peer gets ``notification`` when it is done
        (none when empty)."""

    @abstractmethod
    def read_ranges(
        self,
        peer: str,
        local_rows: np.ndarray,
        local_memory: MemoryKind,
        remote_rows: np.ndarray,
        remote_memory: MemoryKind,
        notification: bytes,
    ) -> Any:
        """Post a READ of Nx3 (address, length, device) remote rows into local rows, without prepared lists."""

    @abstractmethod
    def status(self, transfer: Any) -> TransferStatus: ...

    @abstractmethod
    def release_transfer(self, transfer: Any) -> bool:
        """Release a transfer handle, cancelling it if still active; False if it could not be cancelled."""

    @abstractmethod
    def notify(self, peer: str, message: bytes) -> None: ...

    @abstractmethod
    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived since the last call, as (sender agent name, message)."""

    @abstractmethod
    def close(self) -> None: ...


@dataclass(frozen=True)
class Box:
    """A slice of one request's KV in global coordinates: layers, kv heads, block positions in the request.

    Where the ctx and gen blocks hold different numbers of tokens, a staged piece counts whole ctx blocks (the ctx
    packs it knowing only its own size): ``tokens_per_block`` says how many tokens one of ``blocks`` holds (0: the
    holder's own), and ``tokens`` which global tokens of them the reader takes (None: all)."""

    layers: range
    heads: range
    blocks: range
    tokens_per_block: int = 0
    tokens: range | None = None


@dataclass(frozen=True)
class LocalBox:
    """A box in one rank's own terms: its block ids and its local layer and head indices; ``parts``: entry i is only
    a token run of block ``block_ids[i]`` (the peer's blocks hold another number of tokens)."""

    block_ids: np.ndarray
    layers: range
    heads: range
    parts: Parts | None = None


@dataclass(frozen=True)
class RangeRead:
    """A direct READ of explicit Nx3 (address, length, device) rows, entry i of the remote rows into entry i of
    the local ones: state beside the paged KV (Mamba state, the indexer-K cache), read after the KV."""

    what: str
    local_rows: np.ndarray
    remote_rows: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.local_rows[:, 1].sum())

    @staticmethod
    def joined(reads: Sequence[RangeRead]) -> RangeRead:
        """One READ of all of them (one notification, one confirmation)."""
        return RangeRead(
            " + ".join(read.what for read in reads),
            np.concatenate([read.local_rows for read in reads]),
            np.concatenate([read.remote_rows for read in reads]),
        )


@dataclass(frozen=True)
class PeerRead:
    """What one gen rank takes from one ctx rank.

    Direct mode: one READ of remote descriptor entries into local ones (``local_indices``/``remote_indices``).
    Staged mode: ``pieces``, each packed by the ctx rank into a staging slot, read as one run, then unpacked.
    ``gathered`` staged mode: each piece covers whole segments of a block-major ctx rank (all its layers and
    heads), so the reader READs those segments into its own slot and unpacks them: no claim, no ctx packing.
    ``state`` is read after the KV, as one READ of explicit rows (``has_kv`` False: only it comes from this
    peer; the receiver also folds a direct KV part into it, one READ instead of two, and then ``nbytes`` is 0).
    ``expected_readers`` is how many gen ranks read this request from that ctx rank, whatever part; 0 means none
    does, and this gen rank (the request's first) tells the ctx rank so (``NoReaders``).
    """

    peer_rank: int
    expected_readers: int
    nbytes: int  # of the KV part
    layers: range = range(0)  # the global layers this read covers
    local_indices: np.ndarray | None = None
    remote_indices: np.ndarray | None = None
    coarse: bool = False  # the indices address whole segments (``KVLayout.unit_descriptors(coarse=True)``)
    pieces: tuple[Box, ...] = ()
    gathered: bool = False  # staged pieces are whole ctx segments: the reader READs them and unpacks, no ctx packing
    state: RangeRead | None = None  # per-request state beside the paged KV: indexer-K, Mamba state

    @property
    def staged(self) -> bool:
        return bool(self.pieces)

    @property
    def has_kv(self) -> bool:
        return self.local_indices is not None or self.staged

    @property
    def total_bytes(self) -> int:
        return self.nbytes + (self.state.nbytes if self.state is not None else 0)


@dataclass(frozen=True)
class ReadRequest:
    """What a formatter needs to plan one gen rank's reads of one request."""

    self_state: DataTransceiverState
    self_rank: int
    self_layout: KVLayout
    peer_state: DataTransceiverState
    peer_block_ids: tuple[tuple[int, ...], ...]
    local_block_ids: np.ndarray
    num_tokens: int
    peer_dp_rank: int = 0
    first_block: int = 0  # blocks before it are not read (already held: prefix reuse; outside the window)
    layers: range | None = None  # plan only these global layers (a layer-wise step: the KV part only)
    only_peer: int | None = None  # plan only the reads from this ctx rank
    stage_bytes: int = 0  # the largest piece both sides' staging slots hold
    direct_min_run_bytes: int = 8192  # shorter runs of partial slices are staged (see CacheTransceiverConfig)
    layerwise: bool = False  # the ctx announces layers as they are ready: the KV is read layer range by range
    self_indexer: KVLayout | None = None  # the gen rank's indexer-K pools (MLA with DSA)
    self_rnn: RnnLayout | None = None  # the gen rank's Mamba state pools
    self_rnn_slot: int | None = None  # the request's Mamba state slot here and on the ctx side
    peer_rnn_slot: int | None = None


class StatePlanner(ABC):
    """Plans the direct reads of one kind of per-request state kept beside the paged KV (Mamba state)."""

    @abstractmethod
    def inquire_support(self, self_state: CacheState, peer_state: CacheState) -> None: ...

    @abstractmethod
    def reads(self, request: ReadRequest) -> dict[int, RangeRead]:
        """What this gen rank reads, by ctx rank."""

    @abstractmethod
    def readers(self, request: ReadRequest, peer_rank: int) -> frozenset[int]:
        """The gen ranks that read this state from ``peer_rank``."""


class Formatter(ABC):
    """Decides which ctx ranks a gen rank reads from, which bytes land where, and packs what must be staged."""

    @abstractmethod
    def inquire_support(self, self_state: CacheState, peer_state: CacheState) -> None:
        """Raise IncompatibleStateError or NotSupportedError, naming the difference, before any byte moves."""

    @abstractmethod
    def plan(self, request: ReadRequest) -> list[PeerRead]: ...

    @abstractmethod
    def localize(self, state: CacheState, rank: int, box: Box, num_blocks: int, block_ids: np.ndarray) -> LocalBox:
        """Translate a global box into ``rank``'s own block ids and local layer/head indices."""

    @abstractmethod
    def box_bytes(self, state: CacheState, box: Box) -> int: ...

    @abstractmethod
    def pack(self, layout: KVLayout, views: list[Any], box: LocalBox, out: Any) -> int:
        """Copy the box into the flat byte array ``out`` (one vectorised pass); returns the bytes written."""

    @abstractmethod
    def unpack(self, layout: KVLayout, views: list[Any], box: LocalBox, data: Any, segments: bool = False) -> None:
        """Write packed bytes (as produced by the peer's ``pack``) into the local pools; ``segments``: ``data`` is
        whole block-major segments ``[block, layer, kv, head, token, dim]`` instead (a gathered READ)."""
