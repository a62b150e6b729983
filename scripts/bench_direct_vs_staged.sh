#!/usr/bin/env bash
# Direct against staged mode for a TP-mismatched pairing (ctx TP2 -> gen TP4), as the direct run length varies
# with tokens_per_block (one gen rank takes 2 of a ctx rank's 4 heads: run = 2 heads x T x head_dim x 2 bytes).
# Both modes run in the same invocation; prints GB/s of each and their ratio. Usage: scripts/bench_direct_vs_staged.sh
source "$(dirname "$0")/_env.sh"
printf '%8s %10s %12s %12s %8s\n' tokens/blk run_bytes direct_GB/s staged_GB/s ratio
for tpb in 4 8 16 32 64; do
  common=(--ctx tp=2 --gen tp=4 --layers 8 --kv-heads 8 --head-dim 128 --dtype bfloat16 --tokens-per-block "$tpb"
          --requests 512,1024,2048 --rounds 3 --json)
  direct=$(nixl-kv pair "${common[@]}" --direct-min-run-bytes 0 2>/dev/null | tail -1)
  staged=$(nixl-kv pair "${common[@]}" --direct-min-run-bytes 1099511627776 2>/dev/null | tail -1)
  python3 - "$tpb" "$direct" "$staged" <<'PY'
import json, sys
tpb, direct, staged = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
assert direct["ok"] and staged["ok"], (direct, staged)
print(f"{tpb:>8} {2 * tpb * 128 * 2:>10} {direct['gbps']:>12.2f} {staged['gbps']:>12.2f} {direct['gbps'] / staged['gbps']:>8.2f}")
PY
done
