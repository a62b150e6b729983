#!/usr/bin/env bash
# On the GPU machine (no package index). Needs the wheels in .whl (see scripts/gpu_check.sh).
#
#   scripts/bench_gpu.sh [nixl-kv bench flags]   `nixl-kv bench` on VRAM, ctx on GPU 0 and gen on GPU 1, every baseline
#       in the same run. Writes $OUT/bench.json (then: python3 scripts/plot_bench.py bench.json bench.png, anywhere).
#   scripts/bench_gpu.sh cases                   issue 33's cases with `nixl-kv pair`, each twice: through NIXL READs
#       only (NIXL_KV_IPC_GATHER=0: before) and with the same-host CUDA IPC gather (after). One line a case: the path
#       the plan chose (`paths`), GB/s (median of the rounds after the first, min-max), the raw one-descriptor READ of
#       the same bytes in the same run, and the ratio. CASES_TOKENS (2048), CASES_ROUNDS (6), CASES_MODES
#       ("nixl ipc") and CASES (a subset of the names below) narrow it.
source "$(dirname "$0")/_gpu_env.sh"
if [ "${1:-}" != cases ]; then
  python3 -m nixl_kv.cli bench --device cuda --out "$OUT/bench.json" "$@" 2> >(grep -v "PerformanceWarning\|views\[0\]" >&2)
  exit
fi
declare -A FLAGS=(
  [same]=""
  [nhd-same]="--ctx layout=nhd --gen layout=nhd --tokens-per-block 16"
  [bm-nhd]="--ctx layout=block_major --gen layout=nhd"
  [tp4-tp2]="--ctx tp=4 --gen tp=2 --placement split"
  [tp2-tp4]="--ctx tp=2 --gen tp=4 --placement split"
  [tp8-tp4]="--ctx tp=8 --gen tp=4 --layers 80 --placement split"
  [mla-indexer]="--attention mla --indexer-dim 128 --layers 61 --head-dim 576 --tokens-per-block 64"
  [hybrid]="--layers 8 --kv-heads 8 --head-dim 128 --rnn layers=48,heads=128,head_dim=64,d_state=128,d_conv=4,n_groups=8,layout=xbc,ssm_dtype=float32"
)
SUMMARY='
import json, statistics, sys
name, mode = sys.argv[1], sys.argv[2]
text = sys.stdin.read().strip().splitlines()
try:
    d = json.loads(text[-1])
except (IndexError, ValueError):
    print("%-12s %-5s FAILED: %s" % (name, mode, " | ".join(text[-3:])[-300:])); sys.exit()
later = d["gbps_per_round"][1:] or d["gbps_per_round"]
gbps, raw = statistics.median(later), d["raw_read_gbps"]
paths = ",".join("%s:%d" % kv for kv in sorted(d.get("paths", {}).items()))
print("%-12s %-5s verified %s/%s  p50 %8.0f us  %7.1f GB/s [%.1f-%.1f]  raw %7.1f GB/s  ratio %.3f  paths %s" % (
    name, mode, d["verified"], d["requests"], d.get("latency_p50_us") or 0, gbps, min(later), max(later), raw or 0,
    gbps / raw if raw else 0, paths), flush=True)'
for name in ${CASES:-same nhd-same bm-nhd tp4-tp2 tp2-tp4 tp8-tp4 mla-indexer hybrid}; do
  for mode in ${CASES_MODES:-nixl ipc}; do
    gather=$([ "$mode" = ipc ] && echo 1 || echo 0)
    # shellcheck disable=SC2086
    NIXL_KV_IPC_GATHER=$gather timeout 300 python3 -m nixl_kv.cli pair --device cuda --json \
      --requests "${CASES_TOKENS:-2048}" --rounds "${CASES_ROUNDS:-6}" ${FLAGS[$name]} 2>&1 | python3 -c "$SUMMARY" "$name" "$mode"
  done
done
