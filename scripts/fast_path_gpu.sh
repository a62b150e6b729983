#!/usr/bin/env bash
# On the GPU machine: the fast-path figures of issue 10 with `nixl-kv pair` (ctx on GPU 0, gen on GPU 1), one line
# each: one 128-token request at a time idle, with a busy Python thread in every process, and with it and a
# shorter GIL switch interval; then single requests of growing size, a burst of 1000 128-token requests, the
# mismatched pairings (2048 tokens) and three first rounds with --connect-ahead.
# GB/s are medians of the rounds after the first; the ratio is to a raw one-descriptor NIXL READ of the same run;
# paths: the gen's per-peer reads by the path the plan chose (prepared, coalesced, rows, gathered, staged).
source "$(dirname "$0")/_gpu_env.sh"
pair() { python3 -m nixl_kv.cli pair --device cuda --json "$@" 2>/dev/null | tail -1 | python3 -c "$SUMMARY"; }
SUMMARY='
import json, statistics, sys
d = json.load(sys.stdin)
later = d["gbps_per_round"][1:] or d["gbps_per_round"]
gbps = statistics.median(later)
raw = d["raw_read_gbps"]
print(json.dumps({"verified": "%d/%d" % (d["verified"], d["requests"]), "p50_us": d.get("latency_p50_us"),
    "p99_us": d.get("latency_p99_us"), "first_round_ms": d.get("first_round_ms"), "gbps": round(gbps, 1),
    "gbps_min_max": [round(min(later), 1), round(max(later), 1)], "raw_gbps": raw and round(raw, 1),
    "ratio": raw and round(gbps / raw, 3), "per_block_gbps": d.get("per_block_read_gbps"), "paths": d.get("paths")}))'
ROUNDS="${LATENCY_ROUNDS:-300}"
echo "latency idle"; pair --requests 128 --rounds "$ROUNDS"
for gil_us in ${BUSY_GIL_US:-default 100 20}; do
  echo "latency busy, GIL switch interval $gil_us"
  if [ "$gil_us" = default ]; then pair --requests 128 --rounds "$ROUNDS" --busy-thread
  else NIXL_KV_GIL_SWITCH_INTERVAL_US="$gil_us" pair --requests 128 --rounds "$ROUNDS" --busy-thread; fi
done
for tokens in ${SIZES:-128 512 2048 8192 32768}; do echo "size $tokens"; pair --requests "$tokens" --rounds 6; done
echo "burst of 1000"; pair --requests "$(python3 -c "print(','.join(['128'] * 1000))")" --rounds "${BURST_ROUNDS:-3}"
# Mismatched layouts, MLA + indexer-K and the Mamba hybrid (MISMATCHED_TOKENS= skips them).
echo "same layout, vLLM per-layer NHD, 16-token blocks, 2048 tokens"
pair --requests 2048 --rounds 6 --ctx layout=nhd --gen layout=nhd --tokens-per-block 16
mismatched=(
  "--ctx layout=block_major --gen layout=nhd"
  "--ctx tp=4 --gen tp=2 --placement split"
  "--ctx tp=2 --gen tp=4 --placement split"
  "--ctx tp=8 --gen tp=4 --layers 80 --placement split"
  "--attention mla --indexer-dim 128 --layers 61 --head-dim 576 --tokens-per-block 64"
  "--layers 8 --kv-heads 8 --head-dim 128 --rnn layers=48,heads=128,head_dim=64,d_state=128,d_conv=4,n_groups=8,layout=xbc,ssm_dtype=float32"
)
for tokens in ${MISMATCHED_TOKENS-2048}; do
  for flags in "${mismatched[@]}"; do echo "mismatched $tokens: $flags"; pair --requests "$tokens" --rounds 6 $flags; done
done
echo "first round with --connect-ahead"; for _ in ${CONNECT_AHEAD_RUNS-1 2 3}; do pair --requests 128 --rounds 3 --connect-ahead; done
