"""A ctx host that dies: its ctx instances hand out params, then the host vanishes (no RST, no ICMP, no ARP).

The host is a network namespace joined to this one by a veth pair, running its process with a hostname and boot id
of its own: UCX on this side then sees another machine. (On one machine UCX notices a dead peer process by its pid
and refuses it at once; a vanished host is the case where READs hang.) ``die`` takes the host's end of the link
down, pins the neighbour entry on this side (so no ARP failure reaches a sender), then SIGKILLs the process: what is
sent to it is dropped silently, as to a host that lost power. Needs root and iproute2; the namespace, the link and
the process are removed by ``close``.

``clone`` makes the params of further dead instances of that host: UCX agents take about 55 ms each to start here
(a minute for 600), so the clones reuse the one dead agent's worker address under other agent names. The gen side
sees distinct ctx instances (instance id, agent name, metadata, secret), each loaded, connected and read on its own.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nixl_kv import wire
from nixl_kv.agents.nixl_agent import seal_metadata, unseal_metadata
from nixl_kv.config import ENV_PREFIX
from nixl_kv.params_seal import encode_params
from nixl_kv.state import ContextPhaseParams, DataTransceiverState

ROOT = Path(__file__).resolve().parents[1]
BOOT_ID = "4a1b2c3d-0000-4000-8000-00000000dead"  # the dead host's own boot id (UCX tells hosts apart by it)
UNREACHABLE_MAC = "02:00:00:00:00:02"


def can_build() -> str:
    """Why a dead host cannot be built here ("" when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = [tool for tool in ("ip", "unshare", "mount") if shutil.which(tool) is None]
    return f"needs {', '.join(missing)}" if missing else ""


_SERIAL = itertools.count(1)


@dataclass
class DeadHost:
    """A namespace ``name`` at ``address``, reached from here through the link ``link``. Each host has names of its
    own: UCX in this process found a link re-made under the name of a deleted one unreachable."""

    serial: int = field(default_factory=lambda: next(_SERIAL) % 200)
    process: subprocess.Popen[str] | None = None
    params: list[bytes] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"nkv22-{os.getpid() % 1000}-{self.serial}"

    @property
    def subnet(self) -> str:
        return f"10.{200 + os.getpid() % 50}.{self.serial}"  # (another process's hosts have other subnets)

    @property
    def link(self) -> str:
        return f"nkv{os.getpid() % 1000}-{self.serial}g"

    @property
    def host_link(self) -> str:
        return f"nkv{os.getpid() % 1000}-{self.serial}h"

    @property
    def address(self) -> str:
        return f"{self.subnet}.2"

    def up(self) -> DeadHost:
        """The namespace and the link, up (before the gen agent starts: UCX lists its TCP devices then)."""
        self.close()
        _ip("netns", "add", self.name)
        _ip("link", "add", self.link, "type", "veth", "peer", "name", self.host_link, "netns", self.name)
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.link)
        _ip("link", "set", self.link, "up")
        _ip("-n", self.name, "addr", "add", f"{self.address}/24", "dev", self.host_link)
        _ip("-n", self.name, "link", "set", self.host_link, "up")
        _ip("-n", self.name, "link", "set", "lo", "up")
        _wait_up(self.link)
        return self

    def prefix(self, boot_id_file: Path) -> list[str]:
        """What runs a command on the host: in its namespace, with its own hostname and boot id."""
        boot_id_file.write_text(BOOT_ID + "\n")
        inside = (
            f'hostname {self.name} && mount --bind {boot_id_file} /proc/sys/kernel/random/boot_id && exec "$0" "$@"'
        )
        reach_me = f"{ENV_PREFIX}MOONCAKE_HOSTNAME={self.address}"  # (a Mooncake agent names 127.0.0.1 otherwise)
        return ["ip", "netns", "exec", self.name, "env", reach_me, "unshare", "--uts", "--mount", "sh", "-c", inside]

    def start(self, arguments: Sequence[str], boot_id_file: Path, timeout_s: float = 60.0) -> list[bytes]:
        """Run ``python -m tests.ctx_host ARGUMENTS`` on the host; returns the params it printed."""
        command = [*self.prefix(boot_id_file), sys.executable, "-m", "tests.ctx_host", *arguments]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        watchdog = threading.Timer(timeout_s, self.process.kill)  # the deadline of the reads below
        watchdog.start()
        try:
            for line in self.process.stdout:
                if line.startswith("READY"):
                    return self.params
                if line.startswith("PARAMS "):  # NIXL logs to stdout too
                    self.params.append(base64.b64decode(line.split()[1]))
        finally:
            watchdog.cancel()
        raise RuntimeError(f"the ctx host did not start within {timeout_s} s")

    def stop(self) -> None:
        """SIGSTOP: the host is up, its process answers nothing (READs from it stay in flight)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def die(self) -> None:
        """The host vanishes: its link down, its neighbour entry pinned here, its process killed."""
        _ip("-n", self.name, "link", "set", self.host_link, "down")
        _ip("neigh", "replace", self.address, "lladdr", UNREACHABLE_MAC, "dev", self.link, "nud", "permanent")
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def clone(params: bytes, index: int) -> bytes:
    """The params of another instance of the same dead host: its own instance id, agent name (as long as the
    original's: NIXL's metadata carries the name once, length-prefixed), metadata under that name, and secret."""
    decoded = wire.decode(params, ContextPhaseParams)
    state = wire.decode(decoded.ctx_state, DataTransceiverState)
    instance = uuid.UUID(int=(index + 1) << 64 | 0xDEAD).hex
    ranks = tuple(_renamed(rank, state.instance_id, instance) for rank in state.comm.ranks)
    state = dataclasses.replace(state, instance_id=instance, comm=dataclasses.replace(state.comm, ranks=ranks))
    secret = index.to_bytes(8, "big") + decoded.secret[8:]
    return encode_params(dataclasses.replace(decoded, ctx_state=wire.encode(state), secret=secret))


def _renamed(rank, old: str, new: str):  # noqa: ANN001, ANN202 - a RankCommInfo
    name = rank.agent_name.replace(old, new)
    metadata = unseal_metadata(rank.agent_metadata)
    if len(name) != len(rank.agent_name) or metadata.count(rank.agent_name.encode()) != 1:
        raise ValueError(f"cannot rename agent {rank.agent_name!r} inside its NIXL metadata")
    metadata = metadata.replace(rank.agent_name.encode(), name.encode())
    return dataclasses.replace(rank, agent_name=name, agent_metadata=seal_metadata(metadata))


def _ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True, text=True)


def _wait_up(link: str, timeout_s: float = 5.0) -> None:
    """UCX skips a TCP device whose carrier is not up yet."""
    deadline = time.monotonic() + timeout_s
    while Path(f"/sys/class/net/{link}/operstate").read_text().strip() not in ("up", "unknown"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{link} did not come up within {timeout_s} s")
        time.sleep(0.02)
