"""``scripts/run_disagg.sh``: serve prompts through router, ctx and gen servers, and check every output against
plain transformers ``generate(do_sample=False)`` of the same checkpoint in this process.

Prints a table (prompt length, tokens, time to first token disaggregated and aggregated, blocks reused, identical)
and the gen servers' transfer counters; exits 0 only if every output is identical. Every server it started is
stopped on the way out, also on Ctrl-C or a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from nixl_kv.serving.checkpoints import CHECKPOINTS, VOCAB, load_model, make_checkpoint
from nixl_kv.serving.launcher import Cluster, InstanceArgs
from nixl_kv.serving.serve import LAYOUTS


@dataclass
class Outcome:
    prompt: list[int]
    tokens: list[int]
    ttft_ms: float
    reused_blocks: int
    reference: list[int] | None = None
    aggregated_ttft_ms: float = 0.0

    @property
    def identical(self) -> bool:
        return self.tokens == self.reference


def make_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of 5 to ~300 tokens; every fourth repeats an earlier prompt's start (the gen side may reuse it)."""
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    for index in range(count):
        length = int(rng.integers(5, 300))
        tokens = rng.integers(0, VOCAB, size=length).tolist()
        if index % 4 == 3:
            shared = prompts[index - 3]
            tokens = shared[: max(1, len(shared) * 3 // 4)] + tokens[:40]
        prompts.append(tokens)
    return prompts


async def complete(client: httpx.AsyncClient, router: str, prompt: list[int], max_tokens: int) -> Outcome:
    """One streamed completion; time to first token is measured here, at the client."""
    started, first, tokens, reused = time.perf_counter(), None, [], 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with client.stream("POST", router + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"router answered {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            for choice in event["choices"]:
                if choice["token_ids"] and first is None:
                    first = time.perf_counter()
                tokens.extend(choice["token_ids"])
            reused = event.get("nixl_kv", {}).get("reused_blocks", reused)
    return Outcome(prompt, tokens, ((first or time.perf_counter()) - started) * 1e3, reused)


async def serve_all(router: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[Outcome]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(prompt: list[int]) -> Outcome:
            async with limit:
                return await complete(client, router, prompt, max_tokens)

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def add_reference(outcomes: list[Outcome], model_dir: Path, dtype: str, max_tokens: int) -> None:
    """The same prompts through plain ``generate`` (and a timed prefill: the aggregated time to first token)."""
    import torch

    model = load_model(model_dir, dtype)
    for outcome in outcomes:
        ids = torch.tensor([outcome.prompt])
        started = time.perf_counter()
        with torch.no_grad():
            model(ids)
        outcome.aggregated_ttft_ms = (time.perf_counter() - started) * 1e3
        generated = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        outcome.reference = generated[0, len(outcome.prompt) :].tolist()


def transfer_counters(gen_urls: list[str]) -> dict[str, float]:
    """The gen servers' nixl_kv_* counters for the gen side, summed."""
    totals: dict[str, float] = {}
    for url in gen_urls:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            match = re.match(r'(nixl_kv_\w+)\{[^}]*side="gen"[^}]*\} ([0-9.e+-]+)$', line)
            if match:
                totals[match[1]] = totals.get(match[1], 0.0) + float(match[2])
    return totals


def format_table(outcomes: list[Outcome]) -> str:
    rows = [
        "| prompt tokens | tokens | TTFT disagg ms | TTFT aggregated ms | blocks reused | identical |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        rows.append(
            f"| {len(o.prompt)} | {len(o.tokens)} | {o.ttft_ms:.1f} | {o.aggregated_ttft_ms:.1f} | {o.reused_blocks} | "
            f"{'yes' if o.identical else 'NO'} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run_disagg.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: build --kind in a temp dir)")
    parser.add_argument("--kind", choices=list(CHECKPOINTS), default="llama", help="the checkpoint to build")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--ctx-tp", type=int, default=1)
    parser.add_argument("--gen-tp", type=int, default=1)
    parser.add_argument("--ctx-layout", choices=list(LAYOUTS), default="block_major")
    parser.add_argument("--gen-layout", choices=list(LAYOUTS), default="nhd")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out, as on Ctrl-C
    with tempfile.TemporaryDirectory(prefix="nixl_kv_model_") as scratch:
        model_dir = args.model or make_checkpoint(args.kind, Path(scratch) / args.kind, args.dtype, args.seed)
        cluster = Cluster(
            model_dir,
            args.dtype,
            ctx=[InstanceArgs(args.ctx_tp, args.ctx_layout)],
            gen=[InstanceArgs(args.gen_tp, args.gen_layout)],
        )
        print(f"starting a router, a ctx instance (tp={args.ctx_tp}) and a gen instance (tp={args.gen_tp})")
        with cluster:
            prompts = make_prompts(args.prompts, args.seed)
            started = time.perf_counter()
            outcomes = asyncio.run(serve_all(cluster.router.url, prompts, args.max_tokens, args.concurrency))
            seconds = time.perf_counter() - started
            counters = transfer_counters([s.url for s in cluster.of("gen")])
        add_reference(outcomes, model_dir, args.dtype, args.max_tokens)
    print(format_table(outcomes))
    identical = sum(o.identical for o in outcomes)
    disaggregated = statistics.median(o.ttft_ms for o in outcomes)
    aggregated = statistics.median(o.aggregated_ttft_ms for o in outcomes)
    print(
        f"{identical}/{len(outcomes)} identical to transformers generate(do_sample=False); {len(outcomes)} prompts "
        f"in {seconds:.1f} s, {args.concurrency} at a time; TTFT p50 {disaggregated:.1f} ms disaggregated (at the "
        f"client, through the router), {aggregated:.1f} ms aggregated (the prefill forward, in process)"
    )
    print("transfer (gen side): " + ", ".join(f"{k.removeprefix('nixl_kv_')}={v:g}" for k, v in counters.items()))
    return 0 if identical == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
