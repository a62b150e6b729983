"""The same-host path of a READ of explicit rows: one CUDA IPC gather kernel instead of a NIXL READ (issue 33).

Why: through UCX's cuda_ipc transport every descriptor of a READ costs about 10 µs whatever its size, so a READ of
many rows (mismatched layouts: a row per layer, K/V, head slice and run of blocks; vLLM's per-layer pools) moves at a
fraction of the copy engine's rate. Between processes of one host, the gen can map the ctx's VRAM pools once per peer
(``nixl_kv.ipc_gather``) and copy every row of a READ with one kernel launch.

How it fits (a narrow interface, nothing else changes):
- ``export_blob``: the ctx rank's VRAM regions as CUDA IPC handles, with its host's boot id and a token of its
  process; it travels
  in ``RankCommInfo.ipc_pools`` (sealed with the rest of the ctx state).
- ``IpcAgent`` wraps the rank's ``TransferAgent``. ``offer`` tells it a peer's blob (the planner, per pull);
  ``read_ranges`` of a peer it could map, VRAM to VRAM, without a notification and with at least ``min_rows``
  rows, launches the gather and returns an ``IpcTransfer``; anything else goes to NIXL unchanged. ``status``,
  ``statuses`` and ``release_transfer`` answer for both kinds, so the pull polls, proves and abandons a gather
  exactly as a READ: the kernel's completion event stands for the READ's completion, and the hold proof (the
  params' promise, or the ctx's board read after it) is the one a READ gets. A gather never starts past the
  request's start-by time (the caller's check, as for a READ), and one seen finished after the hold ended fails
  the request as such a READ does.
- Fallback to NIXL, per peer and remembered: no blob (the ctx has no VRAM or could not export), another host
  (boot ids differ), handles refused by the driver (another container, no peer access), an exported region that
  is not one of the rank's registered ones; per READ: a row outside the exported regions, a notification to
  carry, DRAM on either side.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import secrets
import struct
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from nixl_kv.errors import IncompatibleStateError
from nixl_kv.interfaces import TransferStatus
from nixl_kv.ipc_gather import PoolHandle, export_pools, gather_sources, translate
from nixl_kv.layout import MemoryKind, MemoryRegion
from nixl_kv.memory import array_module
from nixl_kv.state import RankCommInfo

log = logging.getLogger(__name__)

VERSION = 1
_HEADER = struct.Struct("<B16s8sH")  # version, boot id, process token, pools
_POOL = struct.Struct("<64sQQQQ")  # handle, offset, address, nbytes, device
MAX_POOLS = 1024
# A READ of fewer rows goes to NIXL: one descriptor moves at the copy engine's rate for about the fixed cost of a
# kernel launch with its table; from a few descriptors on (about 10 µs each through cuda_ipc) the kernel is cheaper.
MIN_ROWS = 4
# Off unless NIXL_KV_IPC_GATHER=1: its GPU tests (tests/test_gpu_ipc.py) passed on one H200, but on that H200 it
# was faster than NIXL's READs in only one of three TP pairings (BENCHMARKS.md, issue 33), so none takes it by default.
ENV_SWITCH = "NIXL_KV_IPC_GATHER"
# Runs at least this long are read directly (as rows, one gather) from peers whose pools are mapped, where NIXL READs
# need runs of 1 MiB (``config.DIRECT_MIN_RUN_BYTES``) to beat staging: a TP or head-slice mismatch is then one
# kernel over its head slabs instead of a staged or gathered piece per slot. Shorter runs (a head's 256 bytes of one
# token) would make a table of millions of tiles: those pairings keep staging.
MIN_RUN_BYTES = 4096
# Tells a peer in this very process (its addresses are ours) from one in another: pids repeat across containers.
PROCESS_TOKEN = secrets.token_bytes(8)


def boot_id() -> bytes:
    """This host's boot id (16 bytes; zeros where it cannot be read: such a host never maps a peer)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return uuid.UUID(handle.read().strip()).bytes
    except (OSError, ValueError):
        return bytes(16)


def rank_regions(rank: RankCommInfo) -> tuple[MemoryRegion, ...]:
    """The regions of a rank a READ of rows may address: its KV pools and its state pools."""
    regions = list(rank.layout.pools)
    if rank.indexer is not None:
        regions += rank.indexer.pools
    if rank.rnn is not None:
        regions += rank.rnn.regions
    return tuple(regions)


def enabled() -> bool:
    """Whether this process gathers and exports (``NIXL_KV_IPC_GATHER=1``; off by default, see ENV_SWITCH)."""
    return os.environ.get(ENV_SWITCH, "0") == "1"


def export_blob(regions: tuple[MemoryRegion, ...]) -> bytes:
    """The ctx side, once at start-up: the VRAM regions' IPC handles, or b"" where there are none, the driver
    refuses, or the gather is off (the peers then read through NIXL; an empty blob is left out of the ctx state, so
    peers of earlier versions read that state as before)."""
    vram = tuple(region for region in regions if region.memory is MemoryKind.VRAM)
    if not vram or len(vram) > MAX_POOLS or not enabled():
        return b""
    try:
        handles = export_pools(vram)
    except Exception as exc:  # noqa: BLE001 - no CUDA, pools the driver cannot export (VMM, async pools)
        log.info("CUDA IPC export refused (%s): peers read through NIXL", exc)
        return b""
    header = _HEADER.pack(VERSION, boot_id(), PROCESS_TOKEN, len(handles))
    return header + b"".join(_POOL.pack(h.handle, h.offset, *h.to_wire()[2:]) for h in handles)


@dataclass(frozen=True)
class Exported:
    """A decoded blob."""

    boot_id: bytes
    process: bytes  # the exporter's PROCESS_TOKEN
    pools: tuple[PoolHandle, ...]


def decode_blob(blob: bytes) -> Exported:
    """Decode and check a peer's blob (untrusted: any malformed one is an IncompatibleStateError)."""
    if len(blob) < _HEADER.size:
        raise IncompatibleStateError("a CUDA IPC blob shorter than its header")
    version, boot, process, count = _HEADER.unpack_from(blob)
    if version != VERSION or count > MAX_POOLS or len(blob) != _HEADER.size + count * _POOL.size:
        raise IncompatibleStateError("a CUDA IPC blob of another version or size")
    pools = tuple(PoolHandle.from_wire(_POOL.unpack_from(blob, _HEADER.size + i * _POOL.size)) for i in range(count))
    return Exported(boot, process, pools)


class Mapping:
    """A peer's exported regions as this process sees them: mapped through CUDA IPC, or, for a peer in this very
    process, at their own addresses. ``close`` unmaps."""

    def __init__(self, exported: Exported, device_id: int) -> None:
        cupy = array_module(MemoryKind.VRAM)
        self.device_id = device_id
        self.regions = tuple(pool.region for pool in exported.pools)
        self._opened: list[int] = []
        if exported.process == PROCESS_TOKEN:  # (a peer in this process: its pools must be on our device)
            if any(region.device_id != device_id for region in self.regions):
                raise IncompatibleStateError("a peer in this process with pools on another device")
            self.mapped = np.array([region.address for region in self.regions], dtype=np.int64)
            return
        bases: dict[bytes, int] = {}  # one mapping per allocation (pools may share one)
        with cupy.cuda.Device(device_id):
            try:
                for pool in exported.pools:
                    if pool.handle not in bases:
                        bases[pool.handle] = cupy.cuda.runtime.ipcOpenMemHandle(pool.handle, 1)
                        self._opened.append(bases[pool.handle])
                    _check_inside(bases[pool.handle], pool)
            except Exception:
                self.close()
                raise
        self.mapped = np.array([bases[pool.handle] + pool.offset for pool in exported.pools], dtype=np.int64)

    def close(self) -> None:
        cupy = array_module(MemoryKind.VRAM)
        with cupy.cuda.Device(self.device_id):
            while self._opened:
                cupy.cuda.runtime.ipcCloseMemHandle(self._opened.pop())


@functools.cache
def _cuda_driver() -> ctypes.CDLL:
    """The CUDA driver library, opened once (every pool of every peer mapped is checked through it)."""
    return ctypes.CDLL("libcuda.so.1")


def _check_inside(base: int, pool: PoolHandle) -> None:
    """The pool the peer claims lies inside the allocation its handle maps (never a copy past its end)."""
    driver = _cuda_driver()
    start, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = driver.cuMemGetAddressRange_v2(ctypes.byref(start), ctypes.byref(size), ctypes.c_uint64(base))
    if status != 0 or pool.offset + pool.region.nbytes > start.value + size.value - base:
        raise IncompatibleStateError("an exported pool does not lie inside the allocation its handle maps")


@dataclass(eq=False)  # a handle: hashed by identity, as the agent's own
class IpcTransfer:
    """A gather in flight: its completion event is what a READ's completion is to the pull."""

    peer: str
    event: Any
    failed: str = ""

    def status(self) -> TransferStatus:
        if self.failed:
            return TransferStatus.FAILED
        try:
            return TransferStatus.DONE if self.event.done else TransferStatus.IN_PROGRESS
        except Exception as exc:  # noqa: BLE001 - a CUDA error in the kernel: the gather failed
            self.failed = str(exc)
            return TransferStatus.FAILED


class IpcAgent:
    """A ``TransferAgent`` whose READs of rows between same-host VRAM pools are CUDA IPC gathers (module docstring);
    everything else is the wrapped agent's."""

    def __init__(self, inner: Any, device_id: int, min_rows: int = MIN_ROWS) -> None:
        self._inner = inner
        self.device_id = device_id
        self.min_rows = min_rows
        self._boot_id = boot_id()
        self._lock = threading.Lock()
        self._blobs: dict[str, bytes] = {}  # peer -> its blob, as offered
        self._mappings: dict[str, Mapping | None] = {}  # peer -> its mapping (None: it reads through NIXL)
        self._in_flight: dict[str, list[IpcTransfer]] = {}
        self._stream: Any = None
        self.gathers = 0  # READs made gathers
        self.fallbacks = 0  # READs of rows from an offered peer that went to NIXL

    def __getattr__(self, name: str) -> Any:
        """Everything not overridden is the wrapped agent's (bound methods cached: no cost per call after)."""
        if name == "_inner":  # (not set yet)
            raise AttributeError(name)
        value = getattr(self._inner, name)
        if callable(value):
            setattr(self, name, value)
        return value

    # --- peers --------------------------------------------------------------------------------------------
    def offer(self, rank: RankCommInfo) -> bool:
        """A peer's blob (its sealed comm info); whether its rows are gathered. Maps it the first time."""
        name, blob = rank.agent_name, rank.ipc_pools
        with self._lock:
            if self._blobs.get(name) == blob and name in self._mappings:
                return self._mappings[name] is not None
            self._unmap(name)
            self._blobs[name] = blob
            self._mappings[name] = self._map(rank)
            return self._mappings[name] is not None

    def _map(self, rank: RankCommInfo) -> Mapping | None:
        if not rank.ipc_pools:
            return None
        try:
            exported = decode_blob(rank.ipc_pools)
            if exported.boot_id != self._boot_id or exported.boot_id == bytes(16):
                return None  # another host: NIXL
            registered = set(rank_regions(rank))
            if any(pool.region not in registered for pool in exported.pools):
                raise IncompatibleStateError("an exported region is not one the rank registered")
            return Mapping(exported, self.device_id)
        except Exception as exc:  # noqa: BLE001 - refused by the driver or malformed: this peer reads through NIXL
            log.info("CUDA IPC mapping of %s refused (%s): its READs go through NIXL", rank.agent_name, exc)
            return None

    def _unmap(self, name: str) -> None:
        """Under the lock: gathers from the peer end first (a kernel always ends), then its mapping closes."""
        for transfer in self._in_flight.pop(name, ()):
            try:
                transfer.event.synchronize()
            except Exception as exc:  # noqa: BLE001 - a kernel that failed has ended too
                log.warning("a CUDA IPC gather from %s ended in error: %s", name, exc)
        mapping = self._mappings.pop(name, None)
        self._blobs.pop(name, None)
        if mapping is not None:
            mapping.close()

    # --- reads ----------------------------------------------------------------------------------------------
    def read_ranges(
        self,
        peer: str,
        local_rows: np.ndarray,
        local_memory: MemoryKind,
        remote_rows: np.ndarray,
        remote_memory: MemoryKind,
        notification: bytes,
    ) -> Any:
        mapping = self._mappings.get(peer)
        if (
            mapping is None
            or notification
            or local_memory is not MemoryKind.VRAM
            or remote_memory is not MemoryKind.VRAM
            or len(local_rows) < self.min_rows
        ):
            return self._nixl(peer, local_rows, local_memory, remote_rows, remote_memory, notification, mapping)
        try:
            sources = translate(remote_rows, mapping.regions, mapping.mapped)
        except IncompatibleStateError:  # a row outside the exported regions
            return self._nixl(peer, local_rows, local_memory, remote_rows, remote_memory, notification, mapping)
        with self._lock:
            if self._mappings.get(peer) is not mapping:  # closed meanwhile
                return self._nixl(peer, local_rows, local_memory, remote_rows, remote_memory, notification, None)
            event = gather_sources(local_rows, remote_rows, sources, self.device_id, self._gather_stream())
            transfer = IpcTransfer(peer, event)
            flights = self._in_flight.setdefault(peer, [])
            flights[:] = [t for t in flights if not t.event.done]
            flights.append(transfer)
            self.gathers += 1
        return transfer

    def _nixl(self, peer: str, *args: Any) -> Any:
        *args, mapping = args
        if mapping is not None:
            self.fallbacks += 1
        return self._inner.read_ranges(peer, *args)

    def _gather_stream(self) -> Any:
        """One non-blocking stream for every gather (ordered among themselves, never behind the null stream)."""
        if self._stream is None:
            cupy = array_module(MemoryKind.VRAM)
            with cupy.cuda.Device(self.device_id):
                self._stream = cupy.cuda.Stream(non_blocking=True)
        return self._stream

    def status(self, transfer: Any) -> TransferStatus:
        if type(transfer) is IpcTransfer:
            return transfer.status()
        return self._inner.status(transfer)

    def statuses(self, transfers: Any) -> list[TransferStatus]:
        if not any(type(t) is IpcTransfer for t in transfers):
            return self._inner.statuses(transfers)
        return [self.status(t) for t in transfers]

    def release_transfer(self, transfer: Any) -> bool:
        """A gather is let go of once its kernel ended (until then its destination may still change)."""
        if type(transfer) is IpcTransfer:
            return transfer.status() is not TransferStatus.IN_PROGRESS
        return self._inner.release_transfer(transfer)

    def close_peer(self, name: str) -> bool:
        closed = self._inner.close_peer(name)
        if closed:
            with self._lock:
                self._unmap(name)
        return closed

    def forget_remote(self, name: str) -> None:
        with self._lock:
            self._unmap(name)
        self._inner.forget_remote(name)

    def close(self) -> None:
        with self._lock:
            for name in list(self._mappings):
                self._unmap(name)
        self._inner.close()


def wrap(agent: Any, regions: tuple[MemoryRegion, ...]) -> Any:
    """The agent a rank with these pools should use: an ``IpcAgent`` for VRAM pools where the gather is on
    (``enabled``), the agent itself otherwise (every READ through NIXL)."""
    if not regions or regions[0].memory is not MemoryKind.VRAM or not enabled():
        return agent
    return IpcAgent(agent, regions[0].device_id)


def offer(agent: Any, rank: RankCommInfo) -> bool:
    """Tell the agent a peer's blob where it gathers (the planner's hook); whether that peer's rows are gathered."""
    return isinstance(agent, IpcAgent) and agent.offer(rank)


def min_run_bytes(agent: Any, ctx_state: Any, layerwise: bool, configured: int) -> int:
    """The planner's hook: the shortest run read directly. At most MIN_RUN_BYTES where every ctx rank's rows would be
    gathered (a fast pull: not layer-wise, the ctx keeps a hold board), else the configured threshold."""
    if layerwise or not ctx_state.hold_key or not isinstance(agent, IpcAgent):
        return configured
    return min(configured, MIN_RUN_BYTES) if all(agent.offer(rank) for rank in ctx_state.comm.ranks) else configured


def label(agent: Any, rank: RankCommInfo, read: Any) -> str:
    """``"ipc "`` where the pull's READs from this peer are gathers (``nixl-kv pair``'s ``paths``), else ``""``."""
    if not offer(agent, rank):
        return ""
    rows = len(read.state.local_rows) if read.state is not None and read.local_indices is None else 0
    return "ipc " if rows >= agent.min_rows else ""  # (a gathered piece is one row a run of ctx blocks: NIXL's)
