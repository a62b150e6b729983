"""Real SGLang servers on this machine: a prefill and a decode instance over a transfer backend, or one aggregated.

Each server is ``python -m sglang.launch_server`` in its own process group (its scheduler and detokenizer go with it
on ``stop``), on a free port, logging to a file. The transfer backend is chosen per server:

- ``nixl_kv``: SGLang's ``--disaggregation-transfer-backend nixl`` with ``NIXL_KV_SGLANG=1`` (our plugin's classes);
- ``nixl``: SGLang's own NIXL backend (on a CPU-only machine, with our plugin's hook that registers its KV as DRAM).

On this CPU SGLang also needs ``SGLANG_USE_CPU_ENGINE=1`` and the stand-ins in ``tests/sglang_stubs`` on
``PYTHONPATH`` (``scripts/sglang_env.sh`` exports the directory): both are set from the caller's environment.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from nixl_kv.serving.launcher import Server, free_port
from nixl_kv.sglang.client import Pair
from nixl_kv.vllm.launch import MODEL  # the vLLM scripts' checkpoint (a wrong KV shows in the tokens)

START_TIMEOUT_S = 300.0
BACKENDS = ("nixl_kv", "nixl")


def make_model(directory: Path, layers: int = 4, python: str = sys.executable, stubs: str = "") -> Path:
    """The checkpoint in ``directory`` (kept when there), written by ``python``'s transformers (on this CPU it
    imports torchvision: ``stubs`` go on its ``PYTHONPATH``)."""
    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    if python != sys.executable or stubs:
        code = f"from nixl_kv.sglang.launch import make_model; make_model({str(directory)!r}, {layers})"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (stubs, os.environ.get("PYTHONPATH", "")) if p)}
        subprocess.run([python, "-c", code], check=True, capture_output=True, timeout=300, env=env)
        return directory
    from nixl_kv.serving.checkpoints import make_checkpoint

    make_checkpoint("llama", directory, num_hidden_layers=layers, **MODEL)
    return directory


@dataclass(frozen=True)
class Instance:
    """One SGLang server: its disaggregation mode (None: aggregated) and backend."""

    mode: str | None = None  # prefill, decode
    backend: str = "nixl_kv"
    page_size: int = 16
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()


@dataclass
class SglangServers:
    model: Path
    python: str = sys.executable  # a Python with SGLang and nixl_kv (scripts/sglang_env.sh makes one)
    stubs: str = ""  # the stand-ins' directory for PYTHONPATH (this CPU only)
    max_total_tokens: int = 32768
    context_length: int = 8192
    servers: list[Server] = field(default_factory=list)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="nixl_kv_sglang_")))

    def start(self, instance: Instance, name: str) -> tuple[Server, int]:
        """Start one server (not waiting for it: ``wait`` does, so several start at once); its bootstrap port."""
        if instance.backend not in BACKENDS:
            raise ValueError(f"unknown backend {instance.backend!r}: one of {BACKENDS}")
        port, bootstrap = free_port(), free_port()
        command = [
            self.python, "-m", "sglang.launch_server", "--model-path", str(self.model), "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--device", "cpu", "--dtype", "float32",
            "--page-size", str(instance.page_size), "--max-total-tokens", str(self.max_total_tokens),
            "--context-length", str(self.context_length), "--disable-radix-cache", "--disable-cuda-graph",
            *instance.extra_args,
        ]  # fmt: skip
        if instance.mode is not None:
            command += ["--disaggregation-mode", instance.mode, "--disaggregation-transfer-backend", "nixl",
                        "--disaggregation-bootstrap-port", str(bootstrap)]  # fmt: skip
        if instance.mode == "decode":  # its default keeps retracted KV in a pinned host pool: CUDA only
            command += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", **dict(instance.extra_env)}
        if self.stubs:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (self.stubs, env.get("PYTHONPATH", "")) if p)
        if instance.mode is not None and instance.backend == "nixl_kv":
            env["NIXL_KV_SGLANG"] = "1"
        elif instance.mode is not None:
            env.pop("NIXL_KV_SGLANG", None)
            env["NIXL_KV_SGLANG_NIXL_DRAM"] = "1"
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        server = Server(name, f"http://127.0.0.1:{port}", process, log)
        self.servers.append(server)
        return server, bootstrap

    def start_pair(self, backend: str = "nixl_kv", prefill: Instance | None = None,
                   decode: Instance | None = None) -> tuple[Pair, Server, Server]:  # fmt: skip
        """A prefill and a decode server of ``backend`` (``prefill``/``decode`` give other settings)."""
        p, bootstrap = self.start(prefill or Instance("prefill", backend), f"prefill-{backend}")
        d, _ = self.start(decode or Instance("decode", backend), f"decode-{backend}")
        return Pair(p.url, d.url, bootstrap), p, d

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every started server answers /health."""
        deadline = time.monotonic() + timeout_s
        for server in self.servers:
            while True:
                if server.process.poll() is not None:
                    raise RuntimeError(f"the {server.role} server exited at start:\n{server.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {server.role} server was not healthy in {timeout_s:.0f} s:\n"
                                       f"{server.log_tail()}")  # fmt: skip
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.5)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers.clear()

    def __enter__(self) -> SglangServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
