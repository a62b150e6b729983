"""Real vLLM OpenAI servers on this machine: a prefill and a decode instance with a connector, or one aggregated.

Each server is ``python -m vllm.entrypoints.openai.api_server`` in its own process group (the API server, its
engine core and its worker go together on ``stop``), on a free port, logging to a file. vLLM's CPU build on a small
machine needs three settings, made here unless the caller set them: a KV cache size (``VLLM_CPU_KVCACHE_SPACE``,
GiB), a core of its own for each rank's OMP threads (``VLLM_CPU_OMP_THREADS_BIND``, the machine's CPUs in turn:
by default, with a connector loaded, vLLM reserves cores and pins its worker to what is left and decodes at a
tenth of the speed; unbound, two engines' OMP threads spin against each other; both on CPU 0, a worker's compute
starves the other's transfer threads), and vLLM's own NixlConnector's side-channel port, one per instance.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from nixl_kv.serving.launcher import Server, free_port

START_TIMEOUT_S = 300.0
CONNECTORS = {  # --connector name -> (kv_connector, kv_connector_module_path or None)
    "nixl_kv": ("NixlKvConnector", "nixl_kv.vllm"),
    "nixl": ("NixlConnector", None),
    "nixl_kv-timed": ("TimedNixlKvConnector", "nixl_kv.vllm.timing"),
    "nixl-timed": ("TimedNixlConnector", "nixl_kv.vllm.timing"),
}
# the checkpoint the scripts and tests build (nixl_kv.serving.checkpoints, kind "llama"): head dim 64, as vLLM's
# CPU attention needs; weights wide enough (initializer range 0.3) that the continuation depends on the whole
# prompt, so KV that did not arrive, or arrived wrong, shows in the tokens
MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    initializer_range=0.3,
)


# the other kinds vLLM's CPU build runs (nixl_kv.serving.checkpoints), each with what its servers need;
# llama_sw: the llama checkpoint with a sliding window of SLIDING_WINDOW tokens in every layer (Mistral-like: vLLM's
# Llama reads the window from layer_types)
KINDS = {"llama": (), "llama_sw": (), "granite_hybrid": ("--no-enable-prefix-caching",), "deepseek_mla": ()}
SLIDING_WINDOW = 96


def make_model(directory: Path, layers: int = 4, python: str = sys.executable, kind: str = "llama") -> Path:
    """The checkpoint in ``directory`` (kept when there), written by ``python``'s transformers: vLLM's venv pins
    an older one than the serve extra, and a config it does not know may not load."""
    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    if python != sys.executable:
        code = f"from nixl_kv.vllm.launch import make_model; make_model({str(directory)!r}, {layers}, kind={kind!r})"
        subprocess.run([python, "-c", code], check=True, capture_output=True, timeout=300)
        return directory
    from nixl_kv.serving.checkpoints import make_checkpoint

    if kind in ("llama", "llama_sw"):
        window = {"layer_types": ["sliding_attention"] * layers, "sliding_window": SLIDING_WINDOW}
        make_checkpoint("llama", directory, num_hidden_layers=layers, **MODEL, **(window if kind == "llama_sw" else {}))
    else:
        make_checkpoint(kind, directory)
    return directory


@dataclass(frozen=True)
class Instance:
    """One vLLM server: its KV role (None: aggregated, no connector) and anything else for its command line."""

    role: str | None = None  # kv_producer, kv_consumer, kv_both
    connector: str = "nixl_kv"  # a key of CONNECTORS, or "module:Class" (a connector of one's own)
    block_size: int = 32
    tp: int = 1
    extra_config: tuple[tuple[str, object], ...] = ()
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # the server's environment, beside the launcher's settings

    def kv_transfer_config(self) -> dict | None:
        if self.role is None:
            return None
        if self.connector in CONNECTORS:
            name, module = CONNECTORS[self.connector]
        else:
            module, _, name = self.connector.partition(":")
        config = {"kv_connector": name, "kv_role": self.role, "kv_load_failure_policy": "recompute"}
        if module:
            config["kv_connector_module_path"] = module
        if self.extra_config:
            config["kv_connector_extra_config"] = dict(self.extra_config)
        return config


@dataclass
class VllmServers:
    model: Path
    python: str = sys.executable  # a Python with vLLM and nixl_kv installed (scripts/vllm_env.sh makes one)
    max_model_len: int = 4096
    kv_cache_gib: int = 1
    omp_bind: str = "each"  # VLLM_CPU_OMP_THREADS_BIND: "each" (a CPU per rank, in turn), "nobind", "auto", a list
    servers: list[Server] = field(default_factory=list)
    _next_cpu: int = 0
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="nixl_kv_vllm_")))

    def start(self, instance: Instance, name: str) -> Server:
        """Start one server (not waiting for it: ``wait`` does, so several start at once)."""
        port = free_port()
        command = [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--port", str(port), "--served-model-name", "tiny", "--skip-tokenizer-init", "--enforce-eager",
            "--dtype", "float32", "--block-size", str(instance.block_size),
            "--max-model-len", str(self.max_model_len), "--tensor-parallel-size", str(instance.tp),
            *instance.extra_args,
        ]  # fmt: skip
        config = instance.kv_transfer_config()
        if config is not None:
            command += ["--kv-transfer-config", json.dumps(config)]
        env = {
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": self._binding(instance.tp),
            # a hybrid's Mamba conv state as (dim, state), the order nixl_kv moves (every server alike, so an
            # aggregated one computes as the pair does)
            "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
            **os.environ,
            **dict(instance.env),
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        }
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        server = Server(name, f"http://127.0.0.1:{port}", process, log)
        self.servers.append(server)
        return server

    def start_router(self, prefill: list[Server], decode: list[Server], name: str = "router") -> Server:
        """``nixl_kv.vllm.router`` over these servers."""
        port = free_port()
        command = [self.python, "-m", "nixl_kv.vllm.router", "--port", str(port)]
        command += [arg for server in prefill for arg in ("--prefill", server.url)]
        command += [arg for server in decode for arg in ("--decode", server.url)]
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        server = Server(name, f"http://127.0.0.1:{port}", process, log)
        self.servers.append(server)
        return server

    def _binding(self, tp: int) -> str:
        """``omp_bind`` for ``tp`` ranks (vLLM wants one CPU list per rank, ``|``-separated); "each" gives every rank
        the next CPU of the machine in turn."""
        if self.omp_bind != "each":
            return self.omp_bind
        cpus = sorted(os.sched_getaffinity(0))
        ranks = [str(cpus[(self._next_cpu + i) % len(cpus)]) for i in range(tp)]
        self._next_cpu += tp
        return "|".join(ranks)

    def wait(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every started server answers /health (vLLM's engine start: 30-100 s on 2 cores)."""
        deadline = time.monotonic() + timeout_s
        for server in self.servers:
            while True:
                if server.process.poll() is not None:
                    raise RuntimeError(f"the {server.role} server exited at start:\n{server.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {server.role} server was not healthy in {timeout_s:.0f} s")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.5)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers.clear()

    def __enter__(self) -> VllmServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
