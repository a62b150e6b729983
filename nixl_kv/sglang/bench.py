"""``scripts/bench_sglang.sh``: nixl_kv's backend, SGLang's own NIXL backend and aggregated SGLang in one run.

The same tiny checkpoint and prompts (lengths x concurrency) go to a nixl_kv pair, a pair over SGLang's NIXL backend
and one aggregated server. For each it reports TTFT p50/p99 at the client (streamed), the transfer's own time per
request where the backend reports it (nixl_kv's decode logs each pull's time with ``NIXL_KV_SGLANG_LOG_TRANSFERS``;
SGLang's NIXL backend reports none), and whether every output is identical to aggregated SGLang's. The machine may be
loaded: the targets run interleaved, round by round, so each sees the same load, and each row gives the median 1-minute
load average after its batches.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from nixl_kv.sglang.client import Generation, body_of, generate, generate_pair
from nixl_kv.sglang.launch import Instance, SglangServers, make_model
from nixl_kv.vllm.client import prompt_of

TRANSFER_LINE = re.compile(rb"nixl_kv transfer: room \d+, \d+ bytes in ([0-9.]+) ms")


@dataclass
class Cell:
    """One target's answers in one (length, concurrency) cell, its pulls' own times, and the 1-minute load average
    after each of its batches."""

    answers: list[Generation] = field(default_factory=list)
    moved: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def transfer_ms(log: Path, start: int) -> list[float]:
    return [float(m.group(1)) for m in TRANSFER_LINE.finditer(log.read_bytes()[start:])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench_sglang.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per cell (each: one batch of each target)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model-dir", type=Path, default=Path(".sglang-model-bench"))
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    levels = [int(n) for n in args.concurrency.split(",")]
    stubs = os.environ.get("NIXL_KV_SGLANG_PYTHONPATH", "")
    model = make_model(args.model_dir.resolve(), stubs=stubs)
    logged = (("NIXL_KV_SGLANG_LOG_TRANSFERS", "1"),)
    with SglangServers(model, stubs=stubs, max_total_tokens=65536, context_length=8192) as servers:
        # on SIGTERM (a timeout) stop the servers at once: threads waiting on their answers would hold an exit
        signal.signal(signal.SIGTERM, lambda *_: (servers.stop(), os._exit(143)))
        ours, _, ours_decode = servers.start_pair(
            "nixl_kv", Instance("prefill", "nixl_kv"), Instance("decode", "nixl_kv", extra_env=logged)
        )
        theirs, _, _ = servers.start_pair("nixl")
        aggregated, _ = servers.start(Instance(), "aggregated")
        print(f"[sglang bench] starting 5 SGLang servers (logs in {servers.log_dir}) ...", file=sys.stderr, flush=True)
        servers.wait()
        client = httpx.Client(timeout=300)
        targets = {
            "nixl_kv": lambda p: generate_pair(client, ours, p, args.max_tokens),
            "sglang nixl": lambda p: generate_pair(client, theirs, p, args.max_tokens),
            "aggregated": lambda p: generate(client, aggregated.url, body_of(p, args.max_tokens)),
        }
        for send in targets.values():  # warm each (first requests pay one-time set-up)
            send(prompt_of(64, seed=99))
        all_same = True
        print(f"\n{args.max_tokens} tokens a prompt, {args.rounds} rounds a cell, the targets interleaved (each round "
              f"one batch of each, in a rotating order); TTFT at the client (streamed)")  # fmt: skip
        print(f"{'backend':>12} {'prompt':>7} {'conc':>5} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
              f"{'transfer p50 ms':>16} {'identical':>10} {'load avg':>9}", flush=True)  # fmt: skip
        names = list(targets)
        for length in lengths:
            for level in levels:
                results = {name: Cell() for name in names}
                for r in range(args.rounds):
                    batch = [prompt_of(length, seed=r * 100 + i) for i in range(level)]
                    for k in range(len(names)):  # round r starts at target r: none always runs first or last
                        name = names[(r + k) % len(names)]
                        mark = ours_decode.log.stat().st_size
                        with ThreadPoolExecutor(level) as pool:
                            results[name].answers += pool.map(targets[name], batch)
                        results[name].load.append(os.getloadavg()[0])
                        if name == "nixl_kv":
                            results[name].moved += transfer_ms(ours_decode.log, mark)
                expected = [a.tokens for a in results["aggregated"].answers]
                for name, cell in results.items():
                    same = all(a.status == 200 for a in cell.answers) and [a.tokens for a in cell.answers] == expected
                    all_same &= same
                    print_row(name, length, level, cell, "ref" if name == "aggregated" else same)
    return 0 if all_same else 1


def print_row(name: str, length: int, level: int, cell: Cell, same: object) -> None:
    ttft = [a.first_token_s * 1e3 for a in cell.answers if a.status == 200] or [float("nan")]
    shown = f"{statistics.median(cell.moved):.1f}" if cell.moved else "-"
    verdict = same if same == "ref" else ("yes" if same else "NO")
    print(f"{name:>12} {length:>7} {level:>5} {statistics.median(ttft):>12.1f} {percentile(ttft, 0.99):>12.1f} "
          f"{shown:>16} {verdict:>10} {statistics.median(cell.load):>9.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
