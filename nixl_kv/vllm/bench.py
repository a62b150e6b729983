"""``scripts/bench_vllm.sh``: nixl_kv's connector, vLLM's NixlConnector and aggregated vLLM, side by side in one run.

By default each configuration runs alone on the machine (its servers start, serve every cell, stop); with
``--interleave`` every configuration's servers are up at once and each cell runs through each configuration in turn
(aggregated first, the two connectors in alternating order), so a drift in the machine's load falls on both
connectors alike; during a cell the other configurations' vLLM servers are paused (SIGSTOP), since an idle
NixlConnector pair kept two threads of each worker busy (BENCHMARKS.md), taking the measured configuration's CPUs.
Same checkpoint and same prompts for all: a few layers, wide enough that a request's KV is several MiB. The
connectors are the timed subclasses (``nixl_kv.vllm.timing``), so their host time is measured the same way. Per cell
(prompt length, concurrency): time to first token at the client (p50/p99), the decode instance's own time per
request (the mean of its ``vllm:e2e_request_latency_seconds`` over the cell: from the request's arrival there, the
pull included, to its last token), the transfer's own time per request from each connector's Prometheus histogram,
decode tokens per second, the connector's hook time per request, and whether every output equals aggregated vLLM's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from nixl_kv.serving.launcher import Server
from nixl_kv.vllm.client import Completion, complete, prompt_of, scrape
from nixl_kv.vllm.launch import KINDS, Instance, VllmServers, make_model

TRANSFER_METRIC = {"nixl_kv": "vllm:nixl_kv_transfer_seconds", "nixl": "vllm:nixl_xfer_time_seconds"}
DECODE_METRIC = "vllm:e2e_request_latency_seconds"  # the decode instance's, per request
CONFIGURATIONS = ("nixl_kv", "nixl", "aggregated")


@dataclass(frozen=True)
class Entry:
    """A configuration's way in: the URL requests go to, its decode server (None: aggregated), its hook-time folder."""

    url: str
    decode: Server | None
    hook_dir: Path
    servers: tuple[Server, ...]  # its vLLM servers (not the router): paused while another configuration runs


@dataclass(frozen=True)
class Cell:
    configuration: str
    length: int
    concurrency: int
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    transfer_ms: float | None  # the connector's own, per request (mean of its histogram over the cell)
    decode_ms: float | None  # the decode instance's own time per request (mean of DECODE_METRIC over the cell)
    hook_ms_per_request: float | None
    decode_tokens_per_s: float
    identical: int  # requests whose tokens equal aggregated vLLM's (aggregated: to itself)
    tokens: tuple[tuple[int, ...], ...] = ()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench_vllm.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests", type=int, default=16, help="requests per cell")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kind", choices=sorted(KINDS), default="llama", help="checkpoint (--layers: llama kinds)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: .vllm-model-bench (-KIND)")
    parser.add_argument("--json", type=Path, help="also write the cells here")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="every configuration's servers at once, each cell through each in turn",
    )
    parser.add_argument(
        "--omp-bind", default="each", help="VLLM_CPU_OMP_THREADS_BIND: each (a CPU per server, in turn) or vLLM's own"
    )
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    concurrencies = [int(n) for n in args.concurrency.split(",")]
    suffix = "" if args.kind == "llama" else f"-{args.kind}"
    model = make_model(args.model_dir or Path(f".vllm-model-bench{suffix}"), layers=args.layers, kind=args.kind)
    if args.kind.startswith("llama"):  # 2 kv heads of 64 dims, float32
        kv_mib = args.layers * 2 * 2 * 64 * 4 * max(lengths) / 2**20
        print(f"[bench] {args.layers} layers, KV {kv_mib:.0f} MiB at {max(lengths)} tokens", file=sys.stderr)
    first_contact: dict[str, float] = {}
    cells: dict[str, list[Cell]] = {}
    # aggregated first: its tokens are the reference
    phases = [("aggregated", "nixl_kv", "nixl")] if args.interleave else [("aggregated",), ("nixl_kv",), ("nixl",)]
    for phase in phases:
        run_phase(phase, model, lengths, concurrencies, args, cells, first_contact)
    print_table(cells, first_contact)
    if args.json:
        payload = {
            "first_contact_ttft_ms": first_contact,
            "cells": {k: [asdict(c) for c in v] for k, v in cells.items()},
        }
        args.json.write_text(json.dumps(payload, indent=1))
    all_identical = all(c.identical == c.requests for cs in cells.values() for c in cs)
    return 0 if all_identical else 1


def run_phase(
    configurations: tuple[str, ...], model: Path, lengths: list[int], concurrencies: list[int],
    args: argparse.Namespace, cells: dict[str, list[Cell]], first_contact: dict[str, float],
) -> None:  # fmt: skip
    """Start these configurations' servers together, then every cell through each of them in turn."""
    max_len = max(lengths) + args.max_tokens + 64
    with VllmServers(model, max_model_len=max_len, kv_cache_gib=2, omp_bind=args.omp_bind) as servers:
        # the pairs first: each pair's prefill and decode then take different CPUs ("each" hands them out in turn)
        entries = {c: start(servers, c, args.kind) for c in sorted(configurations, key=lambda c: c == "aggregated")}
        started = time.monotonic()
        servers.wait()
        print(f"[bench] {', '.join(configurations)}: up after {time.monotonic() - started:.0f} s", file=sys.stderr,
              flush=True)  # fmt: skip
        client = httpx.Client(timeout=300)
        for configuration in configurations:
            first = complete(client, entries[configuration].url, prompt_of(1024, seed=999), args.max_tokens)
            first_contact[configuration] = round(first.first_token_s * 1e3, 1)
            cells[configuration] = []
        turn = 0
        for length in lengths:
            for concurrency in concurrencies:
                connectors = [c for c in configurations if c != "aggregated"]
                if turn % 2:  # the connectors alternate which goes first
                    connectors.reverse()
                turn += 1
                for configuration in [c for c in configurations if c == "aggregated"] + connectors:
                    alone(entries, configuration)
                    want = None
                    if configuration != "aggregated":
                        reference = cells["aggregated"]
                        want = next(c.tokens for c in reference if (c.length, c.concurrency) == (length, concurrency))
                    cell = measure(client, configuration, entries[configuration], length, concurrency, args, want)
                    cells[configuration].append(cell)
                    print(f"[bench] {cell}"[:240], file=sys.stderr, flush=True)
        alone(entries, None)


def alone(entries: dict[str, Entry], running: str | None) -> None:
    """Only ``running``'s servers may run (None: every configuration's)."""
    for configuration, entry in entries.items():
        for server in entry.servers:
            if running in (None, configuration):
                server.resume()
            else:
                server.pause()


def start(servers: VllmServers, configuration: str, kind: str) -> Entry:
    """One configuration's servers (not waited for): one aggregated server, or a prefill, a decode and a router."""
    hook_dir = Path(tempfile.mkdtemp(prefix=f"nixl_kv_hooks_{configuration}_"))
    env = (("NIXL_KV_HOOK_TIMES", str(hook_dir)),)
    extra = KINDS[kind]
    if configuration == "aggregated":
        server = servers.start(Instance(extra_args=extra, env=env), "aggregated")
        return Entry(server.url, None, hook_dir, (server,))
    timed = f"{configuration}-timed"
    config = (("allow_cpu_mla", True),) if kind == "deepseek_mla" else ()  # read by nixl_kv's only
    prefill = servers.start(
        Instance("kv_producer", timed, extra_config=config, extra_args=extra, env=env), f"{configuration}-prefill"
    )
    decode = servers.start(
        Instance("kv_consumer", timed, extra_config=config, extra_args=extra, env=env), f"{configuration}-decode"
    )
    router = servers.start_router([prefill], [decode], name=f"{configuration}-router")
    return Entry(router.url, decode, hook_dir, (prefill, decode))


def measure(
    client: httpx.Client, configuration: str, entry: Entry, length: int, concurrency: int,
    args: argparse.Namespace, want: tuple[tuple[int, ...], ...] | None,
) -> Cell:  # fmt: skip
    prompts = [prompt_of(length, seed=concurrency * 10_000 + i) for i in range(args.requests)]
    decode, url = entry.decode, entry.url
    before = scrape(client, decode.url) if decode is not None else {}
    hooks_before = hook_seconds(entry.hook_dir)
    with ThreadPoolExecutor(concurrency) as pool:
        answers: list[Completion] = list(pool.map(lambda p: complete(client, url, p, args.max_tokens), prompts))
    time.sleep(1.0)  # the hook-time files are rewritten every 0.2 s; the stats reach /metrics by the next step
    hook_ms = (hook_seconds(entry.hook_dir) - hooks_before) * 1e3 / len(prompts) if decode is not None else None
    transfer_ms = decode_ms = None
    if decode is not None:
        after = scrape(client, decode.url)
        transfer_ms = mean_ms(before, after, TRANSFER_METRIC[configuration])
        decode_ms = mean_ms(before, after, DECODE_METRIC)
    ttfts = sorted(a.first_token_s * 1e3 for a in answers)
    rates = [(len(a.tokens) - 1) / (a.total_s - a.first_token_s) for a in answers if a.total_s > a.first_token_s]
    tokens = tuple(a.tokens for a in answers)
    reference = want if want is not None else tokens
    identical = sum(
        a.status == 200 and len(a.tokens) == args.max_tokens and a.tokens == w
        for a, w in zip(answers, reference, strict=True)
    )
    return Cell(
        configuration, length, concurrency, len(prompts), round(statistics.median(ttfts), 2),
        round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 2), transfer_ms, decode_ms,
        None if hook_ms is None else round(hook_ms, 3), round(statistics.median(rates), 1) if rates else 0.0,
        identical, tokens,
    )  # fmt: skip


def mean_ms(before: dict[str, float], after: dict[str, float], histogram: str) -> float | None:
    """A Prometheus histogram's mean between two scrapes, in ms (None: no sample)."""
    count = after.get(histogram + "_count", 0) - before.get(histogram + "_count", 0)
    total = after.get(histogram + "_sum", 0) - before.get(histogram + "_sum", 0)
    return round(total / count * 1e3, 3) if count else None


def hook_seconds(folder: Path) -> float:
    total = 0.0
    for path in folder.glob("*.json"):
        try:
            total += json.loads(path.read_text())["seconds"]
        except (OSError, ValueError, KeyError):
            continue
    return total


def print_table(cells: dict[str, list[Cell]], first_contact: dict[str, float]) -> None:
    header = "prompt | conc. | configuration | TTFT p50 ms | TTFT p99 ms | decode side ms/request | transfer ms"
    print(f"\n| {header} | hook ms/request | decode tok/s | identical |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = sorted(
        (c for cs in cells.values() for c in cs),
        key=lambda c: (c.length, c.concurrency, CONFIGURATIONS.index(c.configuration)),
    )
    for c in rows:
        decode, transfer, hooks = (
            "" if v is None else f"{v:.2f}" for v in (c.decode_ms, c.transfer_ms, c.hook_ms_per_request)
        )
        print(f"| {c.length} | {c.concurrency} | {c.configuration} | {c.ttft_p50_ms:.1f} | {c.ttft_p99_ms:.1f} | "
              f"{decode} | {transfer} | {hooks} | {c.decode_tokens_per_s:.1f} | "
              f"{c.identical}/{c.requests} |")  # fmt: skip
    print("\nfirst request after start (1024 tokens, first contact included), TTFT ms: "
          + ", ".join(f"{k} {v}" for k, v in first_contact.items()))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
