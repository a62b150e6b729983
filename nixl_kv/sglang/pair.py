"""``scripts/run_sglang_pair.sh``: a real SGLang prefill and decode pair through a transfer backend, against
aggregated SGLang.

It builds the tiny checkpoint, starts a prefill and a decode SGLang server with the backend (nixl_kv's, or
``--backend nixl``: SGLang's own NIXL backend) and one aggregated SGLang server, sends every prompt through both,
greedy, and prints a table. The pair is driven as SGLang's router drives it (both servers get each request with one
bootstrap room; ``nixl_kv.sglang.client``). The exit status is 0 only if every output is identical. Everything it
started is stopped, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import httpx

from nixl_kv.sglang.client import body_of, generate, generate_pair
from nixl_kv.sglang.launch import BACKENDS, Instance, SglangServers, make_model
from nixl_kv.vllm.client import prompt_of

DEFAULT_LENGTHS = (1, 15, 16, 17, 100, 257, 511, 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/run_sglang_pair.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=BACKENDS, default="nixl_kv")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="prompt lengths (tokens)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model-dir", type=Path, default=Path(".sglang-model"))
    parser.add_argument("--prefill-page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--decode-page-size", type=int, default=16)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    stubs = os.environ.get("NIXL_KV_SGLANG_PYTHONPATH", "")
    model = make_model(args.model_dir.resolve(), stubs=stubs)
    with SglangServers(model, stubs=stubs) as servers:
        # on SIGTERM (a timeout) stop the servers at once: threads waiting on their answers would hold an exit
        signal.signal(signal.SIGTERM, lambda *_: (servers.stop(), os._exit(143)))
        pair, _, _ = servers.start_pair(
            args.backend,
            Instance("prefill", args.backend, args.prefill_page_size),
            Instance("decode", args.backend, args.decode_page_size),
        )
        aggregated, _ = servers.start(Instance(page_size=args.decode_page_size), "aggregated")
        print(f"[sglang pair] starting SGLang servers (logs in {servers.log_dir}) ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        servers.wait()
        print(f"[sglang pair] up after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        client = httpx.Client(timeout=120)
        rows, identical = [], 0
        for length in lengths:
            prompt = prompt_of(length)
            split = generate_pair(client, pair, prompt, args.max_tokens)
            alone = generate(client, aggregated.url, body_of(prompt, args.max_tokens))
            same = split.status == alone.status == 200 and split.tokens == alone.tokens and len(split.tokens)
            identical += bool(same)
            rows.append((length, split, alone, same))
    pages = f"page size {args.prefill_page_size} -> {args.decode_page_size}"
    print(f"\nbackend: {args.backend}; {pages}; {args.max_tokens} greedy tokens per prompt")
    print(f"{'prompt':>7} {'P/D TTFT ms':>12} {'P/D ms':>9} {'aggregated ms':>14} {'identical':>10}  first tokens")
    for length, split, alone, same in rows:
        shown = list(split.tokens[:6]) if split.status == 200 else f"HTTP {split.status}: {split.error[:60]}"
        verdict = "yes" if same else "NO"
        print(f"{length:>7} {split.first_token_s * 1e3:>12.1f} {split.total_s * 1e3:>9.1f} "
              f"{alone.total_s * 1e3:>14.1f} {verdict:>10}  {shown}")  # fmt: skip
    print(f"\n{identical} of {len(rows)} outputs identical to aggregated SGLang")
    return 0 if identical == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
