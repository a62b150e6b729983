"""Issue 33 on a GPU: READs of rows between processes of one host become CUDA IPC gathers (``nixl_kv.ipc_path``),
end to end through ctx and gen transceivers in separate processes (``nixl-kv pair``), every element verified; with
``NIXL_KV_IPC_GATHER=0`` the same runs take NIXL READs; faults (cancels racing the gather, forged messages, corrupt
params) end as they must; handles the driver refuses fall back to NIXL.

Run on the GPU machine after ``source scripts/_gpu_env.sh`` (its environment: the pair's MPI ranks run as root
there); skipped where cupy or a GPU is missing.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu_pair import cupy, run_pair

pytestmark = pytest.mark.gpu

SMALL = ("--layers", "4", "--kv-heads", "8", "--head-dim", "64", "--tokens-per-block", "16")


def _pair(*args: str, gather: bool = True) -> dict:
    return run_pair(*args, env={"NIXL_KV_IPC_GATHER": "1" if gather else "0"})


def _ipc_paths(summary: dict) -> set[str]:
    return {path for path in summary["paths"] if path.startswith("ipc ")}


@pytest.mark.parametrize(
    "flags",
    [
        ("--ctx=tp=4", "--gen=tp=2", "--placement", "split"),
        ("--ctx=tp=2", "--gen=tp=4", "--placement", "split"),
        ("--ctx=layout=nhd", "--gen=layout=nhd"),
    ],
)
def test_mismatched_pairings_are_gathered_byte_exact(flags: tuple[str, ...]) -> None:
    summary = _pair(*SMALL, *flags, "--requests", "1,33,700", "--rounds", "2")
    assert summary["verified"] == summary["requests"], summary
    assert _ipc_paths(summary), summary["paths"]  # the gather took them (fast pulls of enough rows)
    before = _pair(*SMALL, *flags, "--requests", "1,33,700", "--rounds", "2", gather=False)
    assert before["verified"] == before["requests"] and not _ipc_paths(before), before["paths"]


def test_faults_end_as_they_must_on_the_gather_path() -> None:
    """Cancels on either side racing the gathers, forged control messages, corrupt params: every request ends as its
    fault allows (the pair exits 0 only then) and none with wrong bytes."""
    requests = ("--requests", "40,300,40,300", "--rounds", "4")
    summary = _pair(*SMALL, "--ctx=tp=2", "--gen=tp=1", *requests, "--faults", "0.5")
    assert summary["mismatched_elements"] == 0 and _ipc_paths(summary), summary


def test_handles_the_driver_refuses_fall_back_to_nixl_and_a_gather_is_polled_like_a_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A blob of this host whose handle names no allocation: that peer is read through NIXL. A peer in this process
    (its own addresses): a READ of rows is one gather, polled, released and byte-exact like a READ."""
    import time

    from nixl_kv import ipc_path
    from nixl_kv.cache import PagedKVCache
    from nixl_kv.dtypes import DataType
    from nixl_kv.interfaces import TransferStatus
    from nixl_kv.layout import MemoryKind
    from nixl_kv.state import RankCommInfo

    monkeypatch.setenv(ipc_path.ENV_SWITCH, "1")  # export_blob exports nothing while the gather is off (default)
    source, target = (PagedKVCache(8, 2, 2, 16, 64, DataType.BFLOAT16, memory=MemoryKind.VRAM) for _ in range(2))
    exported = ipc_path.export_blob(source.layout.pools)
    assert exported  # this process could export its pool
    version, boot, _, count = ipc_path._HEADER.unpack_from(exported)
    pool = exported[ipc_path._HEADER.size :]
    forged = ipc_path._HEADER.pack(version, boot, b"another", count) + b"\x55" * 64 + pool[64:]
    agent = ipc_path.IpcAgent(object(), source.layout.pools[0].device_id, min_rows=2)
    assert not agent.offer(RankCommInfo("peer", b"", source.layout, ipc_pools=forged))
    assert agent.offer(RankCommInfo("self", b"", source.layout, ipc_pools=exported))

    fill = ((cupy.arange(source.layout.pools[0].nbytes, dtype=cupy.uint64) * 2654435761) >> 13).astype(cupy.uint8)
    cupy.cuda.runtime.memcpy(source.layout.pools[0].address, fill.data.ptr, fill.nbytes, 3)
    block = source.layout.block_bytes
    order = [5, 0, 7, 2]  # target block i <- source block order[i]
    rows = lambda pool, blocks: np.array([[pool.address + b * block, block, 0] for b in blocks], np.uint64)  # noqa: E731
    local, remote = rows(target.layout.pools[0], range(4)), rows(source.layout.pools[0], order)
    transfer = agent.read_ranges("self", local, MemoryKind.VRAM, remote, MemoryKind.VRAM, b"")
    assert type(transfer) is ipc_path.IpcTransfer and agent.gathers == 1
    deadline = time.monotonic() + 10
    while agent.status(transfer) is TransferStatus.IN_PROGRESS and time.monotonic() < deadline:
        time.sleep(0.001)
    assert agent.statuses([transfer]) == [TransferStatus.DONE] and agent.release_transfer(transfer)
    got = cupy.empty(4 * block, dtype=cupy.uint8)
    cupy.cuda.runtime.memcpy(got.data.ptr, target.layout.pools[0].address, got.nbytes, 3)
    want = cupy.concatenate([fill[b * block : (b + 1) * block] for b in order])
    assert bool((got == want).all())
    outside = remote.copy()
    outside[0, 0] = source.layout.pools[0].address + source.layout.pools[0].nbytes  # past the pool: never gathered
    with pytest.raises(AttributeError):  # handed to the wrapped agent (here none)
        agent.read_ranges("self", local, MemoryKind.VRAM, outside, MemoryKind.VRAM, b"")
    assert (agent.gathers, agent.fallbacks) == (1, 1)
