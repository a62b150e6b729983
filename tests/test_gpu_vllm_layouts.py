"""vLLM's GPU KV cache layouts through the connector's own layout code, on CUDA tensors, without vLLM installed.

Each layout (tests/vllm_layout_peer.py builds the tensors as vLLM 0.32 allocates them) is described by
``nixl_kv.vllm.kv_layout`` and pulled between two processes with real NIXL, byte-exact, into a decode instance of a
different block size where the layout allows it (MLA's formatter needs equal block sizes); each layout's
per-request time (the median of the 8 requests after 3 untimed ones) is reported beside a raw NIXL READ of the same
bytes between the same two processes (``pytest -s`` prints a ``LAYOUT`` JSON line per layout; where ``OUT`` is set,
they are appended to ``$OUT/vllm_layouts.jsonl`` too). On CUDA on the GPU machine
(``pytest tests/test_gpu_vllm_layouts.py``, skipped where torch has no CUDA device); the same pairings run small on
DRAM everywhere, so CI checks the layout code too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

PEER = [sys.executable, "-m", "tests.vllm_layout_peer"]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
PAIRINGS = [("flash_attn", 16, 32), ("flashinfer", 32, 16), ("cross_layer", 16, 32), ("mla", 64, 64), ("mamba", 16, 32)]


def pull(layout: str, ctx_block: int, gen_block: int, device: str) -> dict:
    """The gen's summary of pulling the ctx's requests (the two peers in processes of their own; small on DRAM)."""
    env = dict(os.environ, NIXL_KV_LAYOUT_SMALL="1" if device == "cpu" else "0")
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "env": env}
    ctx = subprocess.Popen([*PEER, "ctx", layout, str(ctx_block), device], **pipes)
    try:
        offer = next((line for line in ctx.stdout if line.startswith("OFFER ")), None)
        assert offer is not None, f"the ctx peer ended without an offer (exit {ctx.wait(5)})"
        command = [*PEER, "gen", layout, str(gen_block), device]
        gen = subprocess.run(command, input=offer, capture_output=True, text=True, timeout=300, env=env)
        assert gen.returncode == 0, gen.stderr[-3000:]
        result = next(line for line in gen.stdout.splitlines() if line.startswith("RESULT "))
        return json.loads(result[len("RESULT ") :])
    finally:
        ctx.stdin.close()
        try:
            ctx.wait(30)
        except subprocess.TimeoutExpired:
            ctx.kill()
            ctx.wait(5)


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "ctx_block", "gen_block"), PAIRINGS)
def test_a_vllm_gpu_layout_moves_byte_exact_beside_a_raw_read(layout: str, ctx_block: int, gen_block: int) -> None:
    summary = {**pull(layout, ctx_block, gen_block, "cuda"), "blocks": f"{ctx_block}->{gen_block}"}
    print("LAYOUT", json.dumps(summary))  # BENCHMARKS.md: each layout's per-request time beside its raw READ
    if os.environ.get("OUT"):  # the GPU machine's folder of files sent back: one JSON line a layout
        with open(os.path.join(os.environ["OUT"], "vllm_layouts.jsonl"), "a") as out:
            out.write(json.dumps(summary) + "\n")
    assert summary["verified"] == summary["requests"] == 11 and summary["mismatched_elements"] == 0, summary


def test_a_hybrids_layouts_move_byte_exact_on_dram() -> None:
    """The GPU test's hybrid pairing (HND attention views and Mamba pages of one buffer, block sizes 16 to 32) on
    DRAM, small: the layout code runs in CI, where there is no GPU."""
    summary = pull("mamba", 16, 32, "cpu")
    assert summary["verified"] == summary["requests"] == 5 and summary["mismatched_elements"] == 0, summary
