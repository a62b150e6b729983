#!/usr/bin/env bash
# On the GPU machine: direct against staged mode for TP-mismatched pairings on VRAM (same run, same shapes),
# and small-request latency. Writes $OUT/threshold.jsonl. Needs the wheels in .whl (see scripts/gpu_check.sh).
source "$(dirname "$0")/_gpu_env.sh"
run() {  # label, then nixl-kv pair arguments
  local label=$1; shift
  python3 -m nixl_kv.cli pair --device cuda --rounds 5 --json "$@" 2>>"$OUT/threshold.err" | tail -1 \
    | python3 -c "import json,sys; d=json.load(sys.stdin); d['label']='$label'; print(json.dumps(d))" \
    | tee -a "$OUT/threshold.jsonl"
}
: >"$OUT/threshold.jsonl"
for mode in direct:0 staged:1099511627776; do
  run "tp2-tp4-${mode%%:*}" --requests 4096 --ctx tp=2 --gen tp=4 --direct-min-run-bytes "${mode#*:}"
  run "tp2-tp4-t16-${mode%%:*}" --requests 4096 --ctx tp=2 --gen tp=4 --tokens-per-block 16 --direct-min-run-bytes "${mode#*:}"
done
run "small-16x20" --requests "$(python3 -c 'print(",".join(["16"] * 20))')"
