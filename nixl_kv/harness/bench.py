"""``nixl-kv bench``: nixl_kv against its baselines, measured in the same run, written as JSON (and a plot).

For each request size: nixl_kv idle and with a busy thread in every worker (a server's model loop holding the
GIL), a raw READ of the same bytes as one descriptor and a naive loop of one READ per block (both on the run's
transfer agent, ``--backend``), cudaMemcpyPeer (GPU) and an NCCL send/recv (GPU); then mismatched layouts, a
70B-like TP8 -> TP4 slice, many concurrent 128-token requests, the latency of one 128-token request at a time (idle
and busy) and the time of first contact with a new peer. Every nixl_kv figure is the median of the rounds after
the first (which pays first contact) with their min-max, beside the raw READ of the same bytes measured by the
same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nixl_kv.harness.baselines import memcpy_peer_gbps, nccl_sendrecv_gbps
from nixl_kv.harness.pair import PairOptions, PairReport, ParallelSpec, percentile, run_pair, steady_rounds
from nixl_kv.harness.pair_worker import InstanceSpec

LLAMA_8B = InstanceSpec(layers=32, kv_heads=8, head_dim=128, tokens_per_block=32, dtype="bfloat16", num_blocks=1)
SHAPES = {
    "small": InstanceSpec(layers=2, kv_heads=2, head_dim=64, tokens_per_block=32, dtype="bfloat16", num_blocks=1),
    "llama8b": LLAMA_8B,
}
LATENCY_TOKENS = 128
DEEP_LAYERS = 80 / 32  # the 70B-like slice: Llama-3-70B's depth over Llama-3-8B's, applied to the shape


@dataclass(frozen=True)
class BenchOptions:
    device: str = "cuda"
    shape: str = "llama8b"
    sizes: tuple[int, ...] = (16, 128, 512, 2048, 8192, 32768)
    rounds: int = 5
    concurrent: int = 1000
    latency_rounds: int = 300
    placement: str = "default"  # GPUs only; the CPU has one place
    busy_thread: bool = False  # also the cases that otherwise run idle only (mismatched layouts, concurrent)
    backend: str = "NIXL"  # the transfer agent of every case and of its raw READ baseline

    @classmethod
    def for_device(cls, device: str, **given: Any) -> BenchOptions:
        """Defaults that suit the device (the CPU machine has 2 cores and no VRAM), overridden by what is given."""
        if device == "cpu":
            defaults = cls(device, shape="small", sizes=(16, 128, 512, 2048), concurrent=100, latency_rounds=200)
        else:
            defaults = cls(device)
        return dataclasses.replace(defaults, **{k: v for k, v in given.items() if v is not None})

    @property
    def model(self) -> InstanceSpec:
        return dataclasses.replace(SHAPES[self.shape], device=self.device, backend=self.backend)


def _checked(report: PairReport) -> dict[str, Any]:
    """The run's summary; a figure of a run that failed verification would be meaningless."""
    summary = report.summary()
    if not summary["ok"]:
        raise RuntimeError(f"a benchmark run failed verification: {summary}")
    return summary


def _figure(report: PairReport) -> dict[str, Any]:
    """GB/s of one pair run: median and min-max of the steady rounds, the raw READ of the same bytes in the same
    run and the ratio to it; the run's whole summary beside."""
    summary = _checked(report)
    steady = steady_rounds(summary["gbps_per_round"])
    median, raw = statistics.median(steady), summary["raw_read_gbps"]
    return {
        "gbps": median,
        "gbps_min": min(steady),
        "gbps_max": max(steady),
        "raw_read_gbps": raw,
        "ratio_to_raw": median / raw if raw else None,
        "per_block_read_gbps": summary["per_block_read_gbps"],
        "pair": summary,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


class Bench:
    """One bench run: every case goes through ``nixl-kv pair`` (separate processes, every element verified)."""

    def __init__(self, options: BenchOptions, say: Callable[[str], None]) -> None:
        self.options, self.say = options, say
        self.placement = options.placement if options.device == "cuda" else "default"
        if self.placement != options.placement:
            say(f"--placement {options.placement} places GPU ranks: ignored on the CPU")

    def pair(
        self, requests: tuple[int, ...], rounds: int, *, ctx: str = "", gen: str = "", busy: bool, layers: int = 0
    ) -> PairReport:
        model = self.options.model
        model = dataclasses.replace(model, busy_thread=busy, layers=layers or model.layers)
        pair = PairOptions(ParallelSpec.parse(ctx), ParallelSpec.parse(gen), model, requests, rounds)
        return run_pair(dataclasses.replace(pair, placement=self.placement))

    def request_bytes(self, tokens: int) -> int:
        """Whole blocks move: a request's bytes."""
        model = self.options.model
        return -(-tokens // model.tokens_per_block) * model.tokens_per_block * model.kv_bytes_per_token

    def run(self) -> dict[str, Any]:
        options, started = self.options, time.strftime("%Y-%m-%d %H:%M:%S")
        sweep, first = self.sweep()
        later = [r.seconds for r in first.results if r.round > 0] or [r.seconds for r in first.results]
        return {
            "date": started,
            "device": options.device,
            "shape": options.shape,
            "placement": self.placement,
            "options": dataclasses.asdict(options),
            "model": dataclasses.asdict(options.model),
            "sweep": sweep,
            "mismatched": self.mismatched(),
            "concurrent_128_tokens": self.burst(),
            "latency_128_tokens": self.latency(),
            "first_contact": {
                "first_request_ms": 1e3 * first.results[0].seconds,
                "later_requests_median_ms": 1e3 * statistics.median(later),
            },
        }

    def sweep(self) -> tuple[list[dict[str, Any]], PairReport]:
        """Each size idle and busy; returns the rows and the first idle run (its first request met a new peer)."""
        rows, idle_runs = [], []
        for tokens in self.options.sizes:
            self.say(f"size {tokens} tokens ({self.request_bytes(tokens) / 2**20:.2f} MiB), idle and busy")
            idle_runs.append(self.pair((tokens,), self.options.rounds, busy=False))
            idle = _figure(idle_runs[-1])
            busy = _figure(self.pair((tokens,), self.options.rounds, busy=True))
            rows.append(
                {
                    "tokens": tokens,
                    "request_bytes": self.request_bytes(tokens),
                    "idle": idle,
                    "busy": busy,
                    "busy_over_idle_gbps": _ratio(busy["gbps"], idle["gbps"]),
                }
            )
        byte_sizes = [row["request_bytes"] for row in rows]
        peer = nccl = None
        if self.options.device == "cuda":
            self.say("cudaMemcpyPeer and NCCL send/recv baselines")
            peer, nccl = memcpy_peer_gbps(byte_sizes), nccl_sendrecv_gbps(byte_sizes)
        for row in rows:
            row["memcpy_peer_gbps"] = peer.get(row["request_bytes"]) if peer else None
            row["nccl_sendrecv_gbps"] = nccl.get(row["request_bytes"]) if nccl else None
        return rows, idle_runs[0]

    def mismatched(self) -> dict[str, Any]:
        options = self.options
        tokens, layers = options.sizes[len(options.sizes) // 2], options.model.layers
        self.say(f"mismatched layouts and a 70B-like TP8 -> TP4 slice, {tokens} tokens ({self.placement} placement)")
        cases = {
            "block_major_to_nhd": ("", "layout=nhd", layers),
            "tp2_to_tp4": ("tp=2", "tp=4", layers),
            "70b_tp8_to_tp4": ("tp=8", "tp=4", round(layers * DEEP_LAYERS)),
        }
        results = {}
        for name, (ctx, gen, depth) in cases.items():
            report = self.pair((tokens,), options.rounds, ctx=ctx, gen=gen, busy=options.busy_thread, layers=depth)
            results[name] = {"tokens": tokens, "layers": depth, **_figure(report)}
        return results

    def burst(self) -> dict[str, Any]:
        count = self.options.concurrent
        self.say(f"{count} concurrent {LATENCY_TOKENS}-token requests")
        report = self.pair((LATENCY_TOKENS,) * count, max(2, self.options.rounds), busy=self.options.busy_thread)
        figure = _figure(report)
        per_round = steady_rounds([count / s for s in report.round_seconds])
        transfers = [r.seconds for r in report.results if r.round > 0]
        return {
            **figure,
            "requests": count,
            "requests_per_s": statistics.median(per_round),
            "requests_per_s_min": min(per_round),
            "requests_per_s_max": max(per_round),
            "p50_ms": 1e3 * percentile(transfers, 0.5),  # the transfer alone (request.transfer_end - start)
            "p99_ms": 1e3 * percentile(transfers, 0.99),
            "latency_p50_us": figure["pair"]["latency_p50_us"],  # as the gen server sees it, queueing included
            "latency_p99_us": figure["pair"]["latency_p99_us"],
        }

    def latency(self) -> dict[str, Any]:
        """One 128-token request a round, idle and with a busy thread in every worker."""
        rounds, runs = self.options.latency_rounds, {}
        for name, busy in (("idle", False), ("busy", True)):
            self.say(f"latency: {rounds} rounds of one {LATENCY_TOKENS}-token request, {name}")
            report = self.pair((LATENCY_TOKENS,), rounds, busy=busy)
            summary, steady = _checked(report), report.steady_latencies_s()
            runs[name] = {
                "p50_us": summary["latency_p50_us"],
                "p99_us": summary["latency_p99_us"],
                "min_us": 1e6 * min(steady),
                "max_us": 1e6 * max(steady),
                "raw_read_us": 1e6 * statistics.median(report.raw_seconds),  # the same bytes, one READ, no protocol
                "first_round_ms": summary["first_round_ms"],
                "pair": summary,
            }
        ratio = _ratio(runs["busy"]["p50_us"], runs["idle"]["p50_us"])
        return {"tokens": LATENCY_TOKENS, "rounds": rounds, **runs, "busy_over_idle_p50": ratio}


def run_bench(options: BenchOptions, say: Callable[[str], None] = print) -> dict[str, Any]:
    return Bench(options, say).run()


def _spread(figure: dict[str, Any], key: str = "gbps", style: str = ".3g") -> str:
    """``median (min-max)`` of a figure."""
    low, high = figure[f"{key}_min"], figure[f"{key}_max"]
    return f"{figure[key]:{style}} ({low:{style}}-{high:{style}})"


def _number(value: float | None, style: str = ".3g") -> str:
    return "-" if value is None else format(value, style)


def _times(value: float | None) -> str:
    """A ratio."""
    return _number(value, ".2f")


def _figures_only(value: Any) -> Any:
    """The result without each run's whole summary (under ``pair``), for a one-line headline."""
    if isinstance(value, dict):
        return {key: _figures_only(item) for key, item in value.items() if key != "pair"}
    return [_figures_only(item) for item in value] if isinstance(value, list) else value


def _paths(figure: dict[str, Any]) -> str:
    """The paths the run's per-peer reads took, most used first (``nixl_kv.gen.plan.path_of``)."""
    paths = sorted(figure["pair"].get("paths", {}).items(), key=lambda item: -item[1])
    return ",".join(path for path, _ in paths) or "-"


def format_bench(result: dict[str, Any]) -> str:
    """The figures as a compact table: GB/s unless said, median of the rounds after the first (min-max)."""
    model, options = result["model"], result["options"]
    busy_note = "; busy thread in the mismatched and concurrent runs too" if options["busy_thread"] else ""
    lines = [
        f"nixl-kv bench on {result['device']} ({result['placement']} placement), {result['shape']} shape: "
        f"{model['layers']} layers, {model['kv_heads']} kv heads, head dim {model['head_dim']}, {model['dtype']}, "
        f"{model['tokens_per_block']} tokens per block; {options['rounds']} rounds, median of rounds 2+ (min-max)"
        f"{busy_note}",
        f"{'tokens':>7} {'MiB':>8}  {'nixl_kv':<26} {'raw':>7} {'/raw':>5}  {'busy':<26} {'busy/idle':>9} "
        f"{'per-block':>9} {'memcpyPeer':>10} {'NCCL':>7}  path",
    ]
    for row in result["sweep"]:
        idle, busy = row["idle"], row["busy"]
        lines.append(
            f"{row['tokens']:>7} {row['request_bytes'] / 2**20:>8.2f}  {_spread(idle):<26} "
            f"{_number(idle['raw_read_gbps']):>7} {_times(idle['ratio_to_raw']):>5}  {_spread(busy):<26} "
            f"{_times(row['busy_over_idle_gbps']):>9} {_number(idle['per_block_read_gbps']):>9} "
            f"{_number(row['memcpy_peer_gbps']):>10} {_number(row['nccl_sendrecv_gbps']):>7}  {_paths(idle)}"
        )
    for name, case in result["mismatched"].items():
        lines.append(
            f"{name:<20} {case['tokens']} tokens, {case['layers']} layers: {_spread(case)}, "
            f"raw {_number(case['raw_read_gbps'])}, /raw {_times(case['ratio_to_raw'])}, path {_paths(case)}"
        )
    burst = result["concurrent_128_tokens"]
    lines.append(
        f"{burst['requests']} concurrent 128-token requests: {_spread(burst, 'requests_per_s', '.0f')} requests/s, "
        f"{_spread(burst)}, /raw {_times(burst['ratio_to_raw'])}, path {_paths(burst)}; latency µs p50 "
        f"{burst['latency_p50_us']:.0f} p99 {burst['latency_p99_us']:.0f}"
    )
    latency = result["latency_128_tokens"]
    runs = [
        f"{name} p50 {run['p50_us']:.0f} p99 {run['p99_us']:.0f} ({run['min_us']:.0f}-{run['max_us']:.0f})"
        for name, run in [("idle", latency["idle"]), ("busy", latency["busy"])]
    ]
    lines.append(
        f"one 128-token request at a time ({latency['rounds']} rounds), µs: {'; '.join(runs)}; busy/idle p50 "
        f"{_times(latency['busy_over_idle_p50'])}; raw READ {latency['idle']['raw_read_us']:.0f}"
    )
    first = result["first_contact"]
    lines.append(
        f"first contact: first request {first['first_request_ms']:.1f} ms, later requests "
        f"{first['later_requests_median_ms']:.2f} ms (median)"
    )
    return "\n".join(lines)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    from nixl_kv.cli import add_load_options, token_counts

    parser = argparse.ArgumentParser(prog="nixl-kv bench", description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        help="small: 2 layers, 2 kv heads, head dim 64 (default on the CPU); llama8b: 32 layers, 8 kv heads, head "
        "dim 128 (default on GPUs); both bf16, 32 tokens per block",
    )
    parser.add_argument("--sizes", type=token_counts, help="request sizes in tokens (CPU: 16,128,512,2048)")
    parser.add_argument("--rounds", type=_positive, help="rounds of each case (5); the first pays first contact")
    parser.add_argument("--concurrent", type=_positive, help="128-token requests in flight at once (CPU 100, GPU 1000)")
    parser.add_argument(
        "--latency-rounds", type=_positive, help="rounds of one 128-token request, idle and busy (CPU 200, GPU 300)"
    )
    add_load_options(
        parser, busy_scope=": here also in the cases that otherwise run idle only (mismatched, concurrent)"
    )
    parser.add_argument("--out", default="bench.json")
    args = parser.parse_args(argv)
    options = BenchOptions.for_device(
        args.device,
        shape=args.shape,
        sizes=args.sizes,
        rounds=args.rounds,
        concurrent=args.concurrent,
        latency_rounds=args.latency_rounds,
        placement=args.placement,
        busy_thread=args.busy_thread,
        backend=args.backend,
    )
    say = lambda text: print(f"[bench] {text}", file=sys.stderr, flush=True)  # noqa: E731
    result = run_bench(options, say)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    print(format_bench(result), file=sys.stderr)
    headline = {k: result[k] for k in ("concurrent_128_tokens", "latency_128_tokens", "first_contact")}
    print(json.dumps(_figures_only(headline)))
    return 0
