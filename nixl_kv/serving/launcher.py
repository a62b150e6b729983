"""Starting a router, ctx and gen servers as real processes on free localhost ports, and stopping all of them.

Each server runs in its own process group (an mpiexec job and its ranks together), so ``stop`` (also reached on
Ctrl-C or a failure, as a context manager) leaves nothing behind; ``kill`` and ``pause`` are the faults a test
injects.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 15.0


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel hands out (bind to 0) can be taken by any
    other process's outgoing connection or listener (UCX opens many) before the server binds it."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10_000, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found in 10000-{low - 1}")


def _ephemeral_low() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32_768
    return max(low, 10_001)


@dataclass
class Server:
    role: str
    url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def pause(self) -> None:
        """Freeze the server (SIGSTOP to its process group): alive to its peers, answering nothing."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
            os.killpg(self.process.pid, signal.SIGCONT)  # a paused server acts on it too
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class InstanceArgs:
    """One ctx or gen instance: ``nixl-kv serve`` arguments beyond role, host and port."""

    tp: int = 1
    layout: str = "block_major"
    extra: tuple[str, ...] = ()
    model: Path | None = None  # another checkpoint than the cluster's (an incompatible pair)

    def argv(self, model: Path, dtype: str) -> list[str]:
        model = self.model or model
        return ["--model", str(model), "--dtype", dtype, "--tp", str(self.tp), "--layout", self.layout, *self.extra]


@dataclass
class Cluster:
    """A router over ``ctx`` and ``gen`` instances of one model checkpoint."""

    model: Path
    dtype: str = "float32"
    ctx: list[InstanceArgs] = field(default_factory=lambda: [InstanceArgs()])
    gen: list[InstanceArgs] = field(default_factory=lambda: [InstanceArgs()])
    gen_model: Path | None = None  # a different checkpoint on the gen side (an incompatible pair)
    servers: list[Server] = field(default_factory=list)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="nixl_kv_serve_")))

    @property
    def router(self) -> Server:
        return next(s for s in self.servers if s.role == "router")

    def of(self, role: str) -> list[Server]:
        return [s for s in self.servers if s.role == role]

    def start(self) -> Cluster:
        try:
            for args in self.ctx:
                self._launch("ctx", args.argv(self.model, self.dtype))
            for args in self.gen:
                self._launch("gen", args.argv(self.gen_model or self.model, self.dtype))
            backends = [f"--{s.role}={s.url}" for s in self.servers]
            self._launch("router", backends)
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, role: str, argv: list[str]) -> None:
        port = free_port()
        index = len(self.of(role))
        log = self.log_dir / f"{role}{index}.log"
        command = [sys.executable, "-m", "nixl_kv.serving.serve", role, "--port", str(port), *argv]
        with open(log, "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.servers.append(Server(role, f"http://127.0.0.1:{port}", process, log))

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(self.servers)
        while waiting:
            server = waiting[0]
            if server.process.poll() is not None:
                raise RuntimeError(f"the {server.role} server exited at start:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {server.role} server was not healthy in {START_TIMEOUT_S:.0f} s")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    waiting.pop(0)
                    continue
            time.sleep(0.2)

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
