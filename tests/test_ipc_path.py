"""The same-host gather path's choices (``nixl_kv.ipc_path``) where no GPU is needed: the blob a ctx rank exports, when
a peer is refused (another host, regions it did not register, malformed blobs), and that every READ the gather does
not take goes to the wrapped NIXL agent unchanged (real agents, DRAM over UCX loopback). The gather itself runs in
tests/test_gpu_ipc.py."""

from __future__ import annotations

import struct
import time
import uuid

import numpy as np
import pytest

from nixl_kv import ipc_path
from nixl_kv.agents.nixl_agent import NixlAgent
from nixl_kv.errors import IncompatibleStateError
from nixl_kv.interfaces import TransferStatus
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind, MemoryRegion
from nixl_kv.state import RankCommInfo

POOL = MemoryRegion(0x7F00_0000_0000, 1 << 20, 0, MemoryKind.VRAM)


def _layout(pool: MemoryRegion = POOL) -> KVLayout:
    return KVLayout(LayoutKind.BLOCK_MAJOR, 64, 2, 2, 2, 16, 64, 2, (pool,))  # 64 blocks of 16 KiB


def _blob(boot: bytes, process: bytes, pools: tuple[MemoryRegion, ...], version: int = ipc_path.VERSION) -> bytes:
    header = struct.pack("<B16s8sH", version, boot, process, len(pools))
    return header + b"".join(struct.pack("<64sQQQQ", b"\x07" * 64, 0, p.address, p.nbytes, p.device_id) for p in pools)


def _rank(blob: bytes, layout: KVLayout | None = None) -> RankCommInfo:
    return RankCommInfo("ctx-0", b"", layout or _layout(), ipc_pools=blob)


def test_blobs_decode_and_malformed_ones_are_refused() -> None:
    boot = uuid.uuid4().bytes
    exported = ipc_path.decode_blob(_blob(boot, b"process1", (POOL,)))
    assert (exported.boot_id, exported.process, [p.region for p in exported.pools]) == (boot, b"process1", [POOL])
    good = _blob(boot, b"process1", (POOL,))
    for bad in (good[:10], good[:-1], good + b"\0", _blob(boot, b"process1", (POOL,), version=2)):
        with pytest.raises(IncompatibleStateError):
            ipc_path.decode_blob(bad)


def test_dram_pools_export_nothing_and_keep_their_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    dram = MemoryRegion(0x1000, 4096, 0, MemoryKind.DRAM)
    assert ipc_path.export_blob((dram,)) == b""
    agent = object()
    assert ipc_path.wrap(agent, (dram,)) is agent
    monkeypatch.delenv(ipc_path.ENV_SWITCH, raising=False)
    assert ipc_path.wrap(agent, (POOL,)) is agent and ipc_path.export_blob((POOL,)) == b""  # off by default
    monkeypatch.setenv(ipc_path.ENV_SWITCH, "0")
    assert ipc_path.wrap(agent, (POOL,)) is agent  # switched off: NIXL only
    monkeypatch.setenv(ipc_path.ENV_SWITCH, "1")
    assert isinstance(ipc_path.wrap(agent, (POOL,)), ipc_path.IpcAgent)
    assert not ipc_path.offer(agent, _rank(b""))  # an agent that is no IpcAgent never gathers


def test_peers_that_cannot_be_mapped_read_through_nixl() -> None:
    agent = ipc_path.IpcAgent(object(), 0)
    here = ipc_path.boot_id()
    assert here != bytes(16)
    assert not agent.offer(_rank(b""))  # the ctx exported nothing
    assert not agent.offer(_rank(_blob(uuid.uuid4().bytes, b"process1", (POOL,))))  # another host
    other = MemoryRegion(POOL.address + (1 << 30), 1 << 20, 0, MemoryKind.VRAM)
    assert not agent.offer(_rank(_blob(here, b"process1", (other,))))  # a region the rank did not register
    assert not agent.offer(_rank(b"garbage"))
    assert ipc_path.label(agent, _rank(b""), None) == ""


def test_reads_it_does_not_gather_are_the_wrapped_agents() -> None:
    """DRAM on both sides: the wrapper hands the READ to NIXL, whose status and release it answers; bytes exact."""
    ctx, inner = NixlAgent("ipc-test-ctx"), NixlAgent("ipc-test-gen")
    gen = ipc_path.IpcAgent(inner, 0)
    try:
        source = np.random.default_rng(3).integers(0, 256, 64 << 10, dtype=np.uint8)
        target = np.zeros_like(source)
        ctx.register([MemoryRegion(source.ctypes.data, source.nbytes, 0, MemoryKind.DRAM)])
        gen.register([MemoryRegion(target.ctypes.data, target.nbytes, 0, MemoryKind.DRAM)])
        gen.load_remote(ctx.metadata(), "ipc-test-ctx")
        chunk = 4096  # every other chunk, reversed: 8 rows
        offsets = np.arange(0, source.nbytes, 2 * chunk, dtype=np.uint64)[:8]
        local = np.stack([target.ctypes.data + offsets, np.full(8, chunk), np.zeros(8)], 1).astype(np.uint64)
        remote = np.stack([source.ctypes.data + offsets[::-1], np.full(8, chunk), np.zeros(8)], 1).astype(np.uint64)
        transfer = gen.read_ranges("ipc-test-ctx", local, MemoryKind.DRAM, remote, MemoryKind.DRAM, b"")
        assert type(transfer) is not ipc_path.IpcTransfer
        deadline = time.monotonic() + 10
        while gen.status(transfer) is TransferStatus.IN_PROGRESS and time.monotonic() < deadline:
            ctx.poll_notifications()
        assert gen.statuses([transfer]) == [TransferStatus.DONE]
        assert gen.release_transfer(transfer)
        for i, offset in enumerate(offsets.astype(int)):
            source_at = int(offsets[::-1][i])
            assert np.array_equal(target[offset : offset + chunk], source[source_at : source_at + chunk])
        assert (gen.gathers, gen.fallbacks) == (0, 0)
    finally:
        gen.close()  # closes the wrapped agent too
        ctx.close()
        assert inner.live_handles == {"transfers": 0, "prepared": 0, "remotes": 0, "registrations": 0}


def test_short_runs_are_read_directly_only_from_peers_whose_rows_are_gathered() -> None:
    """The planner's threshold: lowered to MIN_RUN_BYTES only where every ctx rank is mapped, for fast pulls."""
    from nixl_kv.state import CommState

    ranks = (_rank(b"one"), RankCommInfo("ctx-1", b"", _layout(), ipc_pools=b"two"))
    state = type("State", (), {"hold_key": b"k" * 32, "comm": CommState(ranks)})()
    configured = 1 << 20
    agent = ipc_path.IpcAgent(object(), 0)
    assert ipc_path.min_run_bytes(object(), state, False, configured) == configured  # no gathers at all
    assert ipc_path.min_run_bytes(agent, state, False, configured) == configured  # blobs it cannot map
    agent._blobs.update({"ctx-0": b"one", "ctx-1": b"two"})  # as if both had been mapped (no GPU here)
    agent._mappings.update({"ctx-0": object(), "ctx-1": object()})
    assert ipc_path.min_run_bytes(agent, state, False, configured) == ipc_path.MIN_RUN_BYTES
    assert ipc_path.min_run_bytes(agent, state, False, 1024) == 1024  # never above what was configured
    assert ipc_path.min_run_bytes(agent, state, True, configured) == configured  # layer-wise: stepped, NIXL
    agent._mappings["ctx-1"] = None  # one rank read through NIXL: the whole request keeps NIXL's threshold
    assert ipc_path.min_run_bytes(agent, state, False, configured) == configured
