"""The NIXL agent on its own: two real agents in one process, DRAM over UCX loopback."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from nixl_kv.agents.nixl_agent import NixlAgent
from nixl_kv.errors import AgentError
from nixl_kv.interfaces import TransferStatus
from nixl_kv.layout import MemoryKind, MemoryRegion


def _region(array: np.ndarray) -> MemoryRegion:
    return MemoryRegion(array.ctypes.data, array.nbytes, 0, MemoryKind.DRAM)


def _wait(agent: NixlAgent, transfer: object, other: NixlAgent, timeout_s: float = 10.0) -> TransferStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = agent.status(transfer)
        if status is not TransferStatus.IN_PROGRESS:
            return status
        other.poll_notifications()  # target-side progress, as the transceiver's loop does
    return TransferStatus.IN_PROGRESS


def _notifications(agent: NixlAgent, count: int, sender: NixlAgent, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
    """Poll ``agent`` for ``count`` notifications while the sender makes progress too (no progress thread)."""
    found: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(found) < count and time.monotonic() < deadline:
        found += agent.poll_notifications()
        sender.poll_notifications()
    return found


@pytest.fixture
def agents():
    ctx, gen = NixlAgent("test-ctx"), NixlAgent("test-gen")
    yield ctx, gen
    for agent in (ctx, gen):
        agent.close()
        assert agent.live_handles == {"transfers": 0, "prepared": 0, "remotes": 0, "registrations": 0}


def test_read_moves_exact_bytes_and_notifies(agents: tuple[NixlAgent, NixlAgent]) -> None:
    ctx, gen = agents
    segment, count = 4096, 32
    source = np.random.default_rng(1).integers(0, 256, segment * count, dtype=np.uint8)
    target = np.zeros_like(source)
    ctx.register([_region(source)])
    gen.register([_region(target)])
    gen.load_remote(ctx.metadata(), "test-ctx")
    rows = lambda a: np.array([[a.ctypes.data, segment, 0, segment, count]], dtype=np.uint64)  # noqa: E731
    remote = gen.prepare("test-ctx", rows(source), MemoryKind.DRAM)
    local = gen.prepare(None, rows(target), MemoryKind.DRAM)
    # scattered entries: remote segment i lands in local segment perm[i]
    perm = np.random.default_rng(2).permutation(count).astype(np.int32)
    transfer = gen.read(local, perm, remote, np.arange(count, dtype=np.int32), b"done-1")
    assert _wait(gen, transfer, ctx) is TransferStatus.DONE
    assert gen.release_transfer(transfer)
    expected = np.empty_like(source)
    for i, j in enumerate(perm):
        expected[j * segment : (j + 1) * segment] = source[i * segment : (i + 1) * segment]
    assert np.array_equal(target, expected)
    assert _notifications(ctx, 1, gen) == [("test-gen", b"done-1")]


def test_reply_needs_the_readers_metadata(agents: tuple[NixlAgent, NixlAgent]) -> None:
    ctx, gen = agents
    gen.load_remote(ctx.metadata(), "test-ctx")
    gen.notify("test-ctx", b"hello")
    assert _notifications(ctx, 1, gen) == [("test-gen", b"hello")]
    with pytest.raises(AgentError, match="notify test-gen"):
        ctx.notify("test-gen", b"reply")
    ctx.load_remote(gen.metadata(), "test-gen")
    ctx.notify("test-gen", b"reply")
    assert _notifications(gen, 1, ctx) == [("test-ctx", b"reply")]


def test_garbage_metadata_and_unregistered_memory_are_agent_errors(agents: tuple[NixlAgent, NixlAgent]) -> None:
    ctx, gen = agents
    from nixl_kv.agents.nixl_agent import seal_metadata

    with pytest.raises(AgentError, match="damaged: its checksum fails"):
        gen.load_remote(b"not metadata at all" * 4, "test-ctx")
    with pytest.raises(AgentError, match="load remote metadata"):  # what a sender that seals garbage gets
        gen.load_remote(seal_metadata(b"not metadata at all" * 4), "test-ctx")
    source = np.ones(4096, dtype=np.uint8)
    ctx.register([_region(source)])
    gen.load_remote(ctx.metadata(), "test-ctx")
    outside = np.array([[source.ctypes.data + source.nbytes, 4096, 0]], dtype=np.uint64)
    with pytest.raises(AgentError, match="prepare descriptors of test-ctx"):
        gen.prepare("test-ctx", outside, MemoryKind.DRAM)


def test_peer_directory_forgets_idle_agents_beyond_its_bound() -> None:
    """Agents loaded only to be notified (NoReaders, refusals) are forgotten too, least recently used first,
    never one an active request reads from."""
    from nixl_kv.layout import KVLayout, LayoutKind
    from nixl_kv.peers import PeerDirectory
    from nixl_kv.state import RankCommInfo

    busy: set[str] = set()
    me = NixlAgent("directory-owner")
    others = [NixlAgent(f"directory-peer-{i}") for i in range(4)]
    layout = KVLayout(LayoutKind.BLOCK_MAJOR, 1, 1, 1, 1, 1, 1, 1, (MemoryRegion(4096, 1, 0, MemoryKind.DRAM),))
    ranks = [RankCommInfo(agent.name, agent.metadata(), layout) for agent in others]
    directory = PeerDirectory(me, max_peers=2, busy_agents=lambda: busy, evict_idle_s=0.0)  # (LRU at once)
    try:
        busy.add(others[0].name)
        for rank in ranks:
            directory.connect(rank)
        assert directory.loaded == 2 and me.live_handles["remotes"] == 2
        assert others[0].name in me._remotes and others[3].name in me._remotes  # busy, and most recent
        directory.connect(ranks[1])  # forgotten before: loaded again
        assert directory.loaded == 2 and others[1].name in me._remotes
    finally:
        for agent in (me, *others):
            agent.close()


def _renamed(metadata: bytes, old: str, new: bytes) -> bytes:
    """Agent metadata with the agent's name replaced (same length: the blob keeps its framing), sealed again (as a
    sender that means it would)."""
    from nixl_kv.agents.nixl_agent import seal_metadata, unseal_metadata

    body = unseal_metadata(metadata)
    assert len(new) == len(old) and body.count(old.encode()) == 1
    return seal_metadata(body.replace(old.encode(), new))


@pytest.mark.parametrize("given", ["not UTF-8", "another new agent"])
def test_metadata_naming_an_unexpected_agent_is_refused_and_unloaded(
    agents: tuple[NixlAgent, NixlAgent], given: str
) -> None:
    """An agent whose name is not text (it once escaped as UnicodeDecodeError and wedged the receiver), or any
    name other than the one the peer's state claims: AgentError, and nothing stays loaded in NIXL."""
    ctx, gen = agents
    real = ctx.metadata()
    name = b"test-ct\xff" if given == "not UTF-8" else b"test-cty"
    with pytest.raises(AgentError, match="metadata given for agent 'test-ctx' describes agent"):
        gen.load_remote(_renamed(real, "test-ctx", name), "test-ctx")
    assert not gen.has_remote(name) and gen.live_handles["remotes"] == 0
    gen.load_remote(real, "test-ctx")  # the real one still loads
    assert gen.has_remote("test-ctx")


def test_metadata_of_a_live_peer_under_another_name_leaves_the_peer_loaded(
    agents: tuple[NixlAgent, NixlAgent],
) -> None:
    """A state that claims agent X but carries the metadata of Y, a peer in use: refused, and Y stays loaded and
    readable (it was once forgotten, cutting this agent off a live peer)."""
    ctx, gen = agents
    source = np.arange(4096, dtype=np.uint8)
    target = np.zeros_like(source)
    ctx.register([_region(source)])
    gen.register([_region(target)])
    gen.load_remote(ctx.metadata(), "test-ctx")
    with pytest.raises(AgentError, match="describes agent 'test-ctx'"):
        gen.load_remote(ctx.metadata(), "someone-else")
    assert gen.has_remote("test-ctx") and gen.live_handles["remotes"] == 1
    rows = lambda a: np.array([[a.ctypes.data, a.nbytes, 0]], dtype=np.uint64)  # noqa: E731
    remote, local = (
        gen.prepare("test-ctx", rows(source), MemoryKind.DRAM),
        gen.prepare(None, rows(target), MemoryKind.DRAM),
    )
    transfer = gen.read(local, np.array([0], np.int32), remote, np.array([0], np.int32), b"")
    assert _wait(gen, transfer, ctx) is TransferStatus.DONE and gen.release_transfer(transfer)
    assert np.array_equal(target, source)


def test_a_notification_from_an_agent_whose_name_is_not_text_is_dropped_not_raised(
    agents: tuple[NixlAgent, NixlAgent],
) -> None:
    """NIXL's binding fails the whole poll on such a sender (and loses that batch): the agent returns nothing for
    it, and notifications sent afterwards arrive."""
    from nixl._api import nixl_agent, nixl_agent_config

    ctx, gen = agents
    hostile = nixl_agent(b"hostile-\xff", nixl_agent_config(backends=["UCX"]))
    try:
        hostile.add_remote_agent(ctx._agent.metadata())  # (a raw NIXL agent: unsealed)
        hostile.send_notif("test-ctx", b"from a bad name")
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            assert ctx.poll_notifications() == []
        gen.load_remote(ctx.metadata(), "test-ctx")
        gen.notify("test-ctx", b"after")
        assert _notifications(ctx, 1, gen) == [("test-gen", b"after")]
    finally:
        hostile.remove_remote_agent("test-ctx")


def test_ucx_skips_its_ib_modules_only_without_an_rdma_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nixl_kv.agents import nixl_agent

    monkeypatch.setattr(nixl_agent, "RDMA_DEVICES", tmp_path / "infiniband")
    environ: dict[str, str] = {}
    assert nixl_agent.skip_ucx_ib_without_rdma_devices(environ) and environ == {"UCX_MODULES": "^ib"}
    chosen = {"UCX_MODULES": "ib"}
    assert not nixl_agent.skip_ucx_ib_without_rdma_devices(chosen) and chosen == {"UCX_MODULES": "ib"}
    (tmp_path / "infiniband" / "mlx5_0").mkdir(parents=True)
    environ = {}
    assert not nixl_agent.skip_ucx_ib_without_rdma_devices(environ) and environ == {}


def test_ucx_gets_cuda_ipc_reads_by_default_on_a_gpu_host_unless_the_user_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on (cuda_ipc turns GET off without NVLink; READs then crawl over TCP), set only
    where unset, and only with an NVIDIA driver (elsewhere UCX warns of an unused variable)."""
    from nixl_kv.agents import nixl_agent, ucx_agent, ucx_config

    name = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    monkeypatch.setattr(ucx_config, "NVIDIA_CONTROL_DEVICE", tmp_path / "nvidiactl")
    environ: dict[str, str] = {}
    assert name not in ucx_config.apply_ucx_defaults(environ) and environ == ucx_config.TCP_DEFAULTS  # no driver
    (tmp_path / "nvidiactl").touch()
    environ = {}
    assert name in ucx_config.apply_ucx_defaults(environ) and environ == {**ucx_config.TCP_DEFAULTS, name: "on"}
    chosen = {name: "off", "UCX_TCP_CONN_NB": "n"}
    assert ucx_config.bound_tcp_failures(chosen) == [n for n in ucx_config.TCP_DEFAULTS if n != "UCX_TCP_CONN_NB"]
    assert chosen[name] == "off" and chosen["UCX_TCP_CONN_NB"] == "n"  # the user's choices stand
    # both UCX-based agents call this entry point before UCX starts; a NIXL agent applies it
    assert nixl_agent.bound_tcp_failures is ucx_agent.bound_tcp_failures is ucx_config.bound_tcp_failures
    monkeypatch.delenv(name, raising=False)
    NixlAgent(f"test-defaults-{time.time_ns()}").close()
    assert ucx_config.os.environ[name] == "on"
