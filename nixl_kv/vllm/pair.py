"""``scripts/run_vllm_pair.sh``: a real vLLM prefill and decode pair through a connector, against aggregated vLLM.

It builds the tiny checkpoint, starts a prefill (``kv_producer``) and a decode (``kv_consumer``) vLLM server with
the connector (nixl_kv's, or ``--connector nixl``: vLLM's own NixlConnector), the router over them and one
aggregated vLLM server (the same engine, no connector), sends every prompt through both, greedy, and prints a
table. The exit status is 0 only if every output is identical and the decode instance received KV for the
requests (it did not just recompute them). Everything it started is stopped, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

from nixl_kv.vllm.client import complete, prompt_of, scrape
from nixl_kv.vllm.launch import CONNECTORS, KINDS, Instance, VllmServers, make_model

DEFAULT_LENGTHS = (1, 31, 32, 33, 100, 257, 511, 1000)
TRANSFER_COUNTERS = {"nixl_kv": "vllm:nixl_kv_transfer_seconds_count", "nixl": "vllm:nixl_xfer_time_seconds_count"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/run_vllm_pair.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--connector", choices=["nixl_kv", "nixl"], default="nixl_kv")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="prompt lengths (tokens)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kind", choices=sorted(KINDS), default="llama", help="checkpoint (granite_hybrid: Mamba2)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: .vllm-model (-KIND)")
    parser.add_argument("--prefill-block-size", type=int, default=32, help="tokens per KV block (a multiple of 32)")
    parser.add_argument("--decode-block-size", type=int, default=32)
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel size of the prefill instance")
    parser.add_argument("--decode-tp", type=int, default=1)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    suffix = "" if args.kind == "llama" else f"-{args.kind}"
    model = make_model(args.model_dir or Path(f".vllm-model{suffix}"), kind=args.kind)
    extra = KINDS[args.kind]
    with VllmServers(model) as servers:
        prefill = servers.start(
            Instance("kv_producer", args.connector, args.prefill_block_size, args.prefill_tp, extra_args=extra),
            "prefill",
        )
        decode = servers.start(
            Instance("kv_consumer", args.connector, args.decode_block_size, args.decode_tp, extra_args=extra),
            "decode",
        )
        aggregated = servers.start(Instance(extra_args=extra), "aggregated")
        router = servers.start_router([prefill], [decode])
        print(f"[vllm pair] starting vLLM servers (logs in {servers.log_dir}) ...", file=sys.stderr, flush=True)
        started = time.monotonic()
        servers.wait()
        print(f"[vllm pair] up after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        client = httpx.Client(timeout=120)
        counter = TRANSFER_COUNTERS[args.connector]
        before = scrape(client, decode.url).get(counter, 0.0)
        rows, identical = [], 0
        for length in lengths:
            prompt = prompt_of(length)
            split = complete(client, router.url, prompt, args.max_tokens)
            alone = complete(client, aggregated.url, prompt, args.max_tokens)
            same = split.status == alone.status == 200 and split.tokens == alone.tokens and len(split.tokens)
            identical += bool(same)
            rows.append((length, split, alone, same))
        transfers = scrape(client, decode.url).get(counter, 0.0) - before
    blocks = f"TP {args.prefill_tp} -> {args.decode_tp}, "
    blocks += f"block size {args.prefill_block_size} -> {args.decode_block_size}"
    print(f"\n{args.kind}, {CONNECTORS[args.connector][0]}; {blocks}; {args.max_tokens} greedy tokens a prompt")
    print(f"{'prompt':>7} {'P/D ms':>9} {'aggregated ms':>14} {'identical':>10}  first tokens (P/D)")
    for length, split, alone, same in rows:
        shown = list(split.tokens[:6]) if split.status == 200 else f"HTTP {split.status}: {split.error[:60]}"
        verdict = "yes" if same else "NO"
        print(f"{length:>7} {split.total_s * 1e3:>9.1f} {alone.total_s * 1e3:>14.1f} {verdict:>10}  {shown}")
    print(f"\n{identical} of {len(rows)} outputs identical to aggregated vLLM; the decode instance received KV "
          f"{transfers:.0f} times")  # fmt: skip
    return 0 if identical == len(rows) and transfers >= sum(n > 1 for n in lengths) else 1


if __name__ == "__main__":
    raise SystemExit(main())
