"""GPU pools (VRAM, cupy) end to end: ctx and gen in separate processes, one GPU each where there are two.

Run on the GPU machine (scripts/gpu_check.sh); skipped where cupy or a GPU is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_pair import run_pair

pytestmark = pytest.mark.gpu


def _pair(*args: str) -> dict:
    summary = run_pair(*args)
    assert summary["verified"] == summary["requests"], summary
    return summary


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8"])
def test_same_layout_direct(dtype: str) -> None:
    _pair("--layers", "8", "--kv-heads", "8", "--head-dim", "128", "--dtype", dtype, "--requests", "1,100,1000")


@pytest.mark.parametrize(
    ("ctx", "gen"),
    [("tp=2", "tp=1"), ("tp=1", "tp=2,pp=2"), ("layout=block_major", "layout=nhd"), ("tp=2,layout=hnd", "layout=nhd")],
)
def test_mismatched_layouts_staged_with_cupy_kernels(ctx: str, gen: str) -> None:
    common = ("--layers", "4", "--kv-heads", "4", "--head-dim", "64", "--tokens-per-block", "16")
    _pair(f"--ctx={ctx}", f"--gen={gen}", *common, "--requests", "1,33,200", "--rounds", "2")


@pytest.mark.parametrize("dtype", ["float32", "int8", "float16"])
def test_pack_kernel_for_every_element_width(dtype: str) -> None:
    common = ("--layers", "3", "--kv-heads", "4", "--head-dim", "32", "--tokens-per-block", "16", "--dtype", dtype)
    _pair("--gen=layout=nhd", *common, "--requests", "1,50")  # block-major -> NHD: always staged


def test_layerwise_and_prefix_reuse_on_vram() -> None:
    _pair("--layers", "4", "--kv-heads", "4", "--head-dim", "64", "--requests", "40,200", "--layerwise")
    _pair("--layers", "4", "--kv-heads", "4", "--head-dim", "64", "--requests", "40,200", "--reuse-prefix", "1")


@pytest.mark.parametrize(("ctx", "gen"), [("tp=2", "tp=1"), ("tp=1", "cp=2")])
def test_mla_on_vram(ctx: str, gen: str) -> None:
    common = ("--attention", "mla", "--layers", "4", "--head-dim", "576", "--tokens-per-block", "64")
    _pair(f"--ctx={ctx}", f"--gen={gen}", *common, "--requests", "1,65,700", "--rounds", "2")


@pytest.mark.parametrize(("ctx", "gen"), [("tp=1", "tp=1"), ("tp=2", "tp=1,layout=nhd"), ("tp=1", "cp=2")])
def test_mla_with_indexer_k_on_vram(ctx: str, gen: str) -> None:
    common = ("--attention", "mla", "--indexer-dim", "128", "--layers", "4", "--head-dim", "576")
    _pair(f"--ctx={ctx}", f"--gen={gen}", *common, "--tokens-per-block", "64", "--requests", "1,300,2000")


@pytest.mark.parametrize("layout", ["xbc", "qkv"])
@pytest.mark.parametrize(("ctx", "gen"), [("tp=1", "tp=2"), ("tp=2", "tp=1"), ("pp=2", "tp=1")])
def test_hybrid_mamba_state_on_vram(ctx: str, gen: str, layout: str) -> None:
    rnn = f"layers=4,heads=8,head_dim=64,d_state=128,d_conv=4,n_groups=2,layout={layout},ssm_dtype=bfloat16"
    common = ("--layers", "2", "--kv-heads", "4", "--head-dim", "64", "--rnn", rnn)
    _pair(f"--ctx={ctx}", f"--gen={gen}", *common, "--requests", "1,100,1000", "--rounds", "2")


@pytest.mark.parametrize("layout", ["block_major", "nhd"])
def test_adjacent_blocks_move_as_one_descriptor_per_run(layout: str) -> None:
    """Issue 33: on VRAM a request of more than one block (adjacent on both sides: the allocators hand out runs) is
    read as explicit rows, one per run (``coalesced``); a one-block request keeps its prepared entries."""
    common = ("--layers", "8", "--kv-heads", "8", "--head-dim", "128", "--requests", "1,100,1000", "--rounds", "2")
    summary = _pair(f"--ctx=layout={layout}", f"--gen=layout={layout}", *common)
    assert summary["paths"] == {"prepared": 2, "coalesced": 4}, summary["paths"]


@pytest.mark.parametrize(("layout", "batch"), [("block_major", False), ("nhd", False), ("block_major", True)])
def test_cuda_ipc_gather_between_two_processes(layout: str, batch: bool) -> None:
    """Issue 33: the gen maps the ctx's pools through CUDA IPC and one kernel a request (or a batch) copies every
    row; every element is checked (the script exits 1 on any difference)."""
    script = Path(__file__).parent.parent / "scripts" / "bench_ipc_gather.py"
    command = [sys.executable, str(script), "--layout", layout, "--tokens", "100", "--requests", "5", "--rounds", "2"]
    command += ["--layers", "4", "--tokens-per-block", "16", *(["--batch"] if batch else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["verified"] and summary["mismatched_elements"] == 0, summary
    assert summary["launches_per_round"] == (1 if batch else 5), summary
