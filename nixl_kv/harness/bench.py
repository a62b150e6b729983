"""``nixl-kv bench``: nixl_kv against its baselines, measured in the same run, written as JSON (and a plot).

For each request size of a Llama-3-8B-like shape: nixl_kv (median and spread over rounds), a raw NIXL READ of
the same bytes as one descriptor, a naive loop of one NIXL READ per block, cudaMemcpyPeer (GPU) and an NCCL
send/recv (GPU); then mismatched layouts, a 70B-like TP8 -> TP4 slice, 1000 concurrent 128-token requests
(requests/s, p50/p99 latency) and the time of first contact with a new peer.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from typing import Any

from nixl_kv.harness.baselines import memcpy_peer_gbps, nccl_sendrecv_gbps
from nixl_kv.harness.pair import PairOptions, ParallelSpec, run_pair
from nixl_kv.harness.pair_worker import InstanceSpec

LLAMA_8B = InstanceSpec(layers=32, kv_heads=8, head_dim=128, tokens_per_block=32, dtype="bfloat16", num_blocks=1)
BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2


def _pair(model: InstanceSpec, requests: tuple[int, ...], rounds: int, ctx: str = "", gen: str = "") -> dict[str, Any]:
    report = run_pair(PairOptions(ParallelSpec.parse(ctx), ParallelSpec.parse(gen), model, requests, rounds))
    summary = report.summary()
    summary["request_seconds"] = [[r.round, r.seconds] for r in report.results]
    if not summary["ok"]:
        raise RuntimeError(f"a benchmark run failed verification: {summary}")
    return summary


def run_bench(
    device: str, sizes: tuple[int, ...], rounds: int, concurrent: int = 1000, say: Any = print
) -> dict[str, Any]:
    model = dataclasses.replace(LLAMA_8B, device=device)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    sweep = []
    for tokens in sizes:
        say(f"size {tokens} tokens ({tokens * BYTES_PER_TOKEN / 2**20:.0f} MiB)")
        sweep.append({"tokens": tokens, **_pair(model, (tokens,), rounds)})
    byte_sizes = [-(-t // 32) * 32 * BYTES_PER_TOKEN for t in sizes]
    say("cudaMemcpyPeer and NCCL send/recv baselines")
    peer = memcpy_peer_gbps(byte_sizes) if device == "cuda" else None
    nccl = nccl_sendrecv_gbps(byte_sizes) if device == "cuda" else None
    for row, size in zip(sweep, byte_sizes, strict=True):
        row["memcpy_peer_gbps"] = peer.get(size) if peer else None
        row["nccl_sendrecv_gbps"] = nccl.get(size) if nccl else None
    middle = sizes[len(sizes) // 2]
    say("mismatched layouts and a 70B-like TP8 -> TP4 slice")
    mismatched = {
        "block_major_to_nhd": _pair(model, (middle,), rounds, gen="layout=nhd"),
        "tp2_to_tp4": _pair(model, (middle,), rounds, ctx="tp=2", gen="tp=4"),
        "70b_tp8_to_tp4": _pair(dataclasses.replace(model, layers=80), (middle,), rounds, ctx="tp=8", gen="tp=4"),
    }
    say(f"{concurrent} concurrent 128-token requests")
    burst = _pair(model, (128,) * concurrent, 2)
    latencies = sorted(seconds for round_index, seconds in burst["request_seconds"] if round_index == 1)
    burst_summary = {
        "requests": concurrent,
        "requests_per_s": concurrent / burst["seconds_per_round"][1],
        "p50_ms": 1e3 * latencies[len(latencies) // 2],
        "p99_ms": 1e3 * latencies[max(0, int(len(latencies) * 0.99) - 1)],
    }
    first = sweep[0]["request_seconds"]
    first_contact = {
        "first_request_ms": 1e3 * first[0][1],
        "later_requests_median_ms": 1e3 * statistics.median(s for r, s in first if r > 0),
    }
    return {
        "date": started,
        "device": device,
        "model": dataclasses.asdict(model),
        "sweep": sweep,
        "mismatched": mismatched,
        "concurrent_128_tokens": burst_summary,
        "first_contact": first_contact,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="nixl-kv bench", description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--sizes", default="16,128,512,2048,8192,32768", help="request sizes in tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrent", type=int, default=1000, help="128-token requests in flight at once")
    parser.add_argument("--out", default="bench.json")
    args = parser.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    say = lambda text: print(f"[bench] {text}", file=sys.stderr, flush=True)  # noqa: E731
    result = run_bench(args.device, sizes, args.rounds, args.concurrent, say)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps({k: result[k] for k in ("concurrent_128_tokens", "first_contact")}))
    return 0
