"""Shared by the GPU test modules: importing it skips the module where cupy or a CUDA device is missing, and
``run_pair`` runs ``nixl-kv pair`` on the GPU, every element verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

cupy = pytest.importorskip("cupy")

try:
    GPUS = cupy.cuda.runtime.getDeviceCount()
except Exception:  # no driver, no device
    GPUS = 0
if GPUS == 0:
    pytest.skip("no CUDA device", allow_module_level=True)


def run_pair(*args: str, env: dict[str, str] | None = None) -> dict:
    """``nixl-kv pair --device cuda --json ARGS`` (with ``env`` added to ours); its summary, once it exited 0 with
    no mismatched element."""
    command = [sys.executable, "-m", "nixl_kv.cli", "pair", "--device", "cuda", "--json", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["mismatched_elements"] == 0, summary
    return summary
