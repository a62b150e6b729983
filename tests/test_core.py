"""The compiled core (``nixl_kv._core`` over NIXL's C API): what the NIXL agent stands on, checked byte for byte with
real NIXL agents over UCX loopback (DRAM)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from nixl_kv.agents.nixl_agent import NixlAgent
from nixl_kv.agents.nixl_core import capi_path, core
from nixl_kv.errors import AgentError
from nixl_kv.interfaces import TransferStatus
from nixl_kv.layout import MemoryKind, MemoryRegion

UNIT = 1024


@pytest.fixture
def agents() -> Iterator[tuple[NixlAgent, NixlAgent, np.ndarray, np.ndarray]]:
    """A target with a known pattern and a reader with zeros, the reader knowing the target."""
    source = (np.arange(64 * UNIT, dtype=np.uint64) * 2654435761 >> 11).astype(np.uint8)
    target = np.zeros_like(source)
    ctx, gen = NixlAgent("core-ctx"), NixlAgent("core-gen")
    ctx.register([MemoryRegion(source.ctypes.data, source.nbytes, 0, MemoryKind.DRAM)])
    gen.register([MemoryRegion(target.ctypes.data, target.nbytes, 0, MemoryKind.DRAM)])
    gen.load_remote(ctx.metadata(), "core-ctx")
    yield ctx, gen, source, target
    for agent in (gen, ctx):
        agent.close()
        assert agent.live_handles == {"transfers": 0, "prepared": 0, "remotes": 0, "registrations": 0}


def wait(ctx: NixlAgent, gen: NixlAgent, transfers: list, timeout_s: float = 10.0) -> list[TransferStatus]:
    """Every transfer's final status, polled as a batch (the target progressed meanwhile, as the loop does)."""
    deadline = time.monotonic() + timeout_s
    while TransferStatus.IN_PROGRESS in (found := gen.statuses(transfers)):
        assert time.monotonic() < deadline, "READs did not end"
        ctx.poll_notifications()
    return found


def strided(array: np.ndarray) -> np.ndarray:
    return np.array([[array.ctypes.data, UNIT, 0, UNIT, array.nbytes // UNIT]], dtype=np.uint64)


def test_the_agent_runs_on_the_core_loaded_from_the_picked_nixl_package() -> None:
    assert capi_path().name == "libnixl_capi.so" and capi_path().is_file()
    assert core().loaded() == str(capi_path())
    assert ".nixl_cu1" in capi_path().parent.name


def test_strided_lists_and_scattered_indices_read_exact_bytes(agents) -> None:
    """Strided Nx5 rows expand to one entry a unit; a READ of scattered entries lands each where it was asked."""
    ctx, gen, source, target = agents
    local = gen.prepare(None, strided(target), MemoryKind.DRAM)
    remote = gen.prepare("core-ctx", strided(source), MemoryKind.DRAM)
    picked = np.array([3, 17, 5, 63, 0], dtype=np.int32)
    into = np.array([9, 1, 40, 2, 63], dtype=np.int32)
    transfer = gen.read(local, into, remote, picked, b"read done")
    assert wait(ctx, gen, [transfer]) == [TransferStatus.DONE] and gen.release_transfer(transfer)
    expected = np.zeros_like(target)
    for src, dst in zip(picked, into, strict=True):
        expected[dst * UNIT : (dst + 1) * UNIT] = source[src * UNIT : (src + 1) * UNIT]
    assert np.array_equal(target, expected)
    deadline = time.monotonic() + 5
    notes: list = []
    while not notes and time.monotonic() < deadline:
        notes = ctx.poll_notifications()
    assert notes == [("core-gen", b"read done")]


def test_a_batch_of_reads_is_polled_in_one_call_and_ranges_read_without_lists(agents) -> None:
    ctx, gen, source, target = agents
    local = gen.prepare(None, strided(target), MemoryKind.DRAM)
    remote = gen.prepare("core-ctx", strided(source), MemoryKind.DRAM)
    transfers = [
        gen.read(local, np.array([i], dtype=np.int32), remote, np.array([i + 32], dtype=np.int32), b"")
        for i in range(8)
    ]
    rows = lambda base, i: np.array([[base + i * UNIT, UNIT, 0]], dtype=np.uint64)  # noqa: E731
    transfers.append(
        gen.read_ranges(
            "core-ctx",
            rows(target.ctypes.data, 20),
            MemoryKind.DRAM,
            rows(source.ctypes.data, 50),
            MemoryKind.DRAM,
            b"",
        )
    )
    assert wait(ctx, gen, transfers) == [TransferStatus.DONE] * 9
    assert all(gen.release_transfer(transfer) for transfer in transfers)
    assert np.array_equal(target[: 8 * UNIT], source[32 * UNIT : 40 * UNIT])
    assert np.array_equal(target[20 * UNIT : 21 * UNIT], source[50 * UNIT : 51 * UNIT])


def test_bad_reads_are_refused_with_agent_errors_before_nixl_sees_them(agents) -> None:
    ctx, gen, source, target = agents
    local = gen.prepare(None, strided(target), MemoryKind.DRAM)
    remote = gen.prepare("core-ctx", strided(source), MemoryKind.DRAM)
    one = np.array([0], dtype=np.int32)
    with pytest.raises(AgentError, match="remote entry 64 is outside the prepared list of 64"):
        gen.read(local, one, remote, np.array([64], dtype=np.int32), b"")
    with pytest.raises(AgentError, match="local entry -1 is outside"):
        gen.read(local, np.array([-1], dtype=np.int32), remote, one, b"")
    with pytest.raises(AgentError, match="as many remote entries as local ones"):
        gen.read(local, one, remote, np.array([0, 1], dtype=np.int32), b"")
    with pytest.raises(AgentError, match="expected Nx3 or Nx5"):
        gen.prepare(None, np.zeros((2, 4), dtype=np.uint64), MemoryKind.DRAM)
    gen.release_prepared(remote)
    with pytest.raises(AgentError, match="released descriptor list"):
        gen._agent.read(local, one, remote, one)
    assert gen.live_handles["transfers"] == 0 and not target.any()


def test_the_c_loop_of_the_floor_reads_exact_bytes(agents) -> None:
    """With nothing progressing the target (one process), a round ends at its deadline with an AgentError; with a
    progress thread there, every round lands the bytes."""
    ctx, gen, source, target = agents
    local = gen.prepare(None, strided(target), MemoryKind.DRAM)
    remote = gen.prepare("core-ctx", strided(source), MemoryKind.DRAM)
    indices = np.arange(64, dtype=np.int32)
    with pytest.raises(AgentError, match="could not run the floor loop"):
        gen._agent.floor(local, remote, indices, 5, 0.2)
    target[:] = 0
    helper = NixlAgent("core-ctx-progressed", progress_thread=True)
    try:
        helper.register([MemoryRegion(source.ctypes.data, source.nbytes, 0, MemoryKind.DRAM)])
        gen.load_remote(helper.metadata(), "core-ctx-progressed")
        remote = gen.prepare("core-ctx-progressed", strided(source), MemoryKind.DRAM)
        micros = gen._agent.floor(local, remote, indices, 5)
        assert len(micros) == 5 and (micros > 0).all()
        assert np.array_equal(target, source)
    finally:
        gen.close_peer("core-ctx-progressed")
        helper.close()


def test_a_nixl_without_its_c_api_is_refused_at_start_naming_what_is_missing(tmp_path) -> None:
    """In a fresh process whose nixl package lacks ``libnixl_capi.so``: the first agent raises AgentError saying so."""
    script = f"""
import pathlib, sys
import nixl_kv.agents.nixl_core as nixl_core
nixl_core.capi_path = lambda: pathlib.Path({str(tmp_path)!r}) / "libnixl_capi.so"
from nixl_kv.agents.nixl_agent import NixlAgent
from nixl_kv.errors import AgentError
try:
    NixlAgent("no-capi")
except AgentError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"nixl_kv needs NIXL's C API, libnixl_capi.so, beside libnixl.so in {tmp_path}" in out.stdout
