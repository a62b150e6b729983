"""Multi-rank pairings end to end: each instance is its own mpiexec job, every element of every rank checked."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.mpi


def _run(ctx: str, gen: str, *, layers: int = 4, heads: int = 4, tokens_per_block: int = 16, dtype: str = "float32",
         requests: str = "30,10,60,80", rounds: int = 2, extra: tuple[str, ...] = ()) -> dict:  # fmt: skip
    command = [
        sys.executable, "-m", "nixl_kv.cli", "pair", f"--ctx={ctx}", f"--gen={gen}", "--layers", str(layers),
        "--kv-heads", str(heads), "--head-dim", "4", "--tokens-per-block", str(tokens_per_block), "--dtype", dtype,
        "--requests", requests, "--rounds", str(rounds), "--json", *extra,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{ctx} -> {gen}: {result.stdout[-1500:]}\n{result.stderr[-3000:]}"
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    count = len(requests.split(",")) * rounds
    assert summary["requests"] == summary["verified"] == count, summary
    assert summary["mismatched_elements"] == 0 and summary["ctx_errors"] == {}, summary
    return summary


def _bytes(layers: int, heads: int, dim: int, itemsize: int, tokens_per_block: int, requests: str, rounds: int) -> int:
    blocks = sum(-(-int(n) // tokens_per_block) for n in requests.split(","))
    return blocks * tokens_per_block * layers * 2 * heads * dim * itemsize * rounds


GRID = [f"tp={tp},pp={pp}" for tp, pp in itertools.product((1, 2), (1, 2))]


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize(("ctx", "gen"), list(itertools.product(GRID, GRID)))
def test_tp_pp_grid(ctx: str, gen: str, dtype: str) -> None:
    summary = _run(ctx, gen, dtype=dtype)
    itemsize = 4 if dtype == "float32" else 1
    assert summary["bytes"] == _bytes(4, 4, 4, itemsize, 16, "30,10,60,80", 2)  # every byte once, none twice


@pytest.mark.parametrize(
    ("ctx", "gen", "layers", "heads", "tokens_per_block"),
    [
        ("tp=4", "pp=4", 8, 4, 8),
        ("pp=4", "pp=4", 10, 4, 16),
        ("tp=4", "pp=4", 10, 4, 16),
        ("pp=2", "pp=1", 16, 16, 16),
        ("pp=2", "pp=4", 16, 16, 16),
        ("pp=4,layers=1:4:3:2", "pp=2,layers=7:3", 10, 4, 16),
    ],
)
def test_pp_and_tp_mismatches(ctx: str, gen: str, layers: int, heads: int, tokens_per_block: int) -> None:
    _run(ctx, gen, layers=layers, heads=heads, tokens_per_block=tokens_per_block)


@pytest.mark.parametrize(
    ("ctx", "gen", "heads"),
    [
        ("tp=2,dp=1", "tp=2", 4),  # attention DP on the ctx side
        ("tp=2", "tp=2,dp=1,pp=2", 4),  # attention DP on the gen side
        ("tp=2,dp=1", "tp=2,dp=1", 4),
        ("tp=4", "tp=2", 2),  # fewer kv heads than TP ranks: one duplicate serves each reader
        ("tp=2", "tp=4,pp=2", 1),
        ("cp=2,tp=2", "cp=3", 4),  # context parallel on both sides, a 1-block request leaves a CP rank empty
    ],
)
def test_attention_dp_duplicated_heads_and_cp(ctx: str, gen: str, heads: int) -> None:
    _run(ctx, gen, heads=heads)


@pytest.mark.parametrize(
    ("ctx", "gen"),
    [
        ("tp=2,layout=block_major", "layout=nhd"),
        ("layout=nhd", "tp=2,layout=block_major"),
        ("tp=2,layout=hnd", "tp=2,pp=2,layout=nhd"),
    ],
)
def test_block_major_and_per_layer_pools_meet(ctx: str, gen: str) -> None:
    _run(ctx, gen)


INDEXER = ("--indexer-dim", "128")  # 132 bytes per token and layer


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize(("ctx", "gen"), list(itertools.product(GRID, GRID)))
def test_mla_grid(ctx: str, gen: str, dtype: str) -> None:
    """MLA over every TP{1,2} x PP{1,2} pairing; the int8 runs carry the DSA indexer-K cache too."""
    extra = ("--attention", "mla", *(INDEXER if dtype == "int8" else ()))
    summary = _run(ctx, gen, heads=1, dtype=dtype, extra=extra)
    itemsize = 4 if dtype == "float32" else 1
    per_token = 4 * itemsize + (132 if dtype == "int8" else 0)  # latent (head dim 4) + indexer, per layer
    replicas = int(dict(item.split("=") for item in gen.split(",")).get("tp", 1))  # every gen TP rank holds it
    assert summary["bytes"] == 2 * 12 * 16 * 4 * per_token * replicas  # 12 blocks, 4 layers, 2 rounds


@pytest.mark.parametrize(
    ("ctx", "gen"),
    [
        ("tp=2,dp=1", "tp=2"),  # attention DP on the ctx side
        ("tp=2", "tp=2,dp=1"),  # and on the gen side
        ("tp=2", "cp=2"),  # gen-side CP
        ("tp=1", "cp=4"),
        ("tp=2,pp=2", "tp=2,cp=2"),
    ],
)
def test_mla_dp_and_gen_cp_with_indexer(ctx: str, gen: str) -> None:
    summary = _run(ctx, gen, heads=1, dtype="int8", extra=("--attention", "mla", *INDEXER))
    spec = dict(item.split("=") for item in gen.split(","))
    replicas = 1 if spec.get("dp") == "1" else int(spec.get("tp", 1))  # CP ranks split the blocks: no replica
    assert summary["bytes"] == 2 * 12 * 16 * 4 * (4 + 132) * replicas  # read once per gen replica


RNN = "layers=2,heads=4,head_dim=8,d_state=4,d_conv=4,n_groups=2,conv_dtype=float32,ssm_dtype=bfloat16"


@pytest.mark.parametrize("layout", ["xbc", "qkv", "none"])
@pytest.mark.parametrize(("ctx", "gen"), [("tp=1", "tp=2"), ("tp=2", "tp=1"), ("pp=2", "tp=1")])
def test_rnn_state_reshards(ctx: str, gen: str, layout: str) -> None:
    """Hybrid runs (2 attention layers beside 2 Mamba layers): every conv channel and SSM element checked."""
    summary = _run(ctx, gen, layers=2, dtype="float16", extra=("--rnn", f"{RNN},layout={layout}"))
    kv = 2 * 12 * 16 * 2 * 2 * 4 * 4 * 2  # rounds, blocks, tokens, layers, k/v, heads, dim, itemsize
    state = 2 * 4 * 2 * ((32 + 16) * 3 * 4 + 4 * 8 * 4 * 2)  # rounds, requests, layers, conv + SSM per layer
    assert summary["bytes"] == kv + state


def test_hybrid_tp2_pp2_to_tp4() -> None:
    _run("tp=2,pp=2", "tp=4", layers=4, extra=("--rnn", f"{RNN},layers=4,heads=8,n_groups=4,layout=xbc"))


@pytest.mark.parametrize(
    ("ctx", "gen", "extra"),
    [
        ("tp=2,dp=1", "tp=1", ()),  # attention DP: a ctx rank holds the whole state of its requests
        ("tp=1", "tp=2,dp=1", ()),
        ("tp=2", "tp=1,layout=nhd", ("--reuse-prefix", "1")),  # staged KV, then the state; prefix not moved
    ],
)
def test_hybrid_with_attention_dp_staging_and_prefix_reuse(ctx: str, gen: str, extra: tuple[str, ...]) -> None:
    _run(ctx, gen, layers=2, extra=("--rnn", f"{RNN},layout=qkv", *extra))


@pytest.mark.parametrize("extra", [("--layerwise",), ("--gen=layout=nhd", "--direct-min-run-bytes", "1000000000")])
def test_indexer_after_layerwise_and_staged_latent_reads(extra: tuple[str, ...]) -> None:
    _run("tp=2", "tp=1", heads=1, dtype="int8", extra=("--attention", "mla", *INDEXER, *extra))


def test_mla_tp4_to_pp4() -> None:
    _run("tp=4", "pp=4", layers=8, heads=1, tokens_per_block=8, extra=("--attention", "mla"))


def test_hybrid_whose_kv_the_gen_side_already_holds_moves_only_the_state() -> None:
    """Prefix reuse covering every block: no KV READ at all, the Mamba state still moves (and nothing else)."""
    summary = _run(
        "tp=2", "tp=1", layers=2, dtype="float16", extra=("--rnn", f"{RNN},layout=xbc", "--reuse-prefix", "8")
    )
    assert summary["bytes"] == 2 * 4 * 2 * ((32 + 16) * 3 * 4 + 4 * 8 * 4 * 2)  # rounds, requests, layers, state
