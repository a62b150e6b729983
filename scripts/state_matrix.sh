#!/usr/bin/env bash
# Every MLA / indexer-K / RNN pairing issue #4 asks for, through `nixl-kv pair --json`, one table row each:
# pairing, options, requests verified, mismatched elements, bytes moved. Usage: scripts/state_matrix.sh [OUT.md]
source "$(dirname "$0")/_env.sh"
OUT_FILE="${1:-/dev/stdout}"
COMMON=(--head-dim 4 --tokens-per-block 16 --requests 30,10,60,80 --rounds 2 --json)
RNN="layers=2,heads=4,head_dim=8,d_state=4,d_conv=4,n_groups=2,conv_dtype=float32,ssm_dtype=bfloat16"
row() {  # ctx gen options...
  local ctx=$1 gen=$2; shift 2
  local json
  json=$(nixl-kv pair --ctx="$ctx" --gen="$gen" "${COMMON[@]}" "$@" 2>/dev/null | tail -1)
  python3 - "$ctx" "$gen" "$*" "$json" <<'PY'
import json, sys
ctx, gen, options, text = sys.argv[1:]
try:
    s = json.loads(text)
    cells = [f"{s['verified']}/{s['requests']}", str(s["mismatched_elements"]), str(s["bytes"]), "yes" if s["ok"] else "NO"]
except (ValueError, KeyError):
    cells = ["-", "-", "-", "NO (no JSON: " + text[:60] + ")"]
print(f"| {ctx} | {gen} | {options} | " + " | ".join(cells) + " |")
PY
}
{
echo "| ctx | gen | options | verified | mismatched | bytes | ok |"
echo "|---|---|---|---|---|---|---|"
GRID=("tp=1,pp=1" "tp=2,pp=1" "tp=1,pp=2" "tp=2,pp=2")
for dtype in float32 int8; do  # the int8 runs carry the DSA indexer-K cache too
  indexer=(); [ "$dtype" = int8 ] && indexer=(--indexer-dim 128)
  for ctx in "${GRID[@]}"; do
    for gen in "${GRID[@]}"; do
      row "$ctx" "$gen" --layers 4 --kv-heads 1 --attention mla --dtype "$dtype" "${indexer[@]}"
    done
  done
done
row tp=4 pp=4 --layers 8 --kv-heads 1 --attention mla --dtype float32
for pairing in "tp=2,dp=1 tp=2" "tp=2 tp=2,dp=1" "tp=2 cp=2" "tp=1 cp=4" "tp=2,pp=2 tp=1,pp=2"; do
  row ${pairing} --layers 4 --kv-heads 1 --attention mla --dtype int8 --indexer-dim 128
done
for layout in xbc qkv none; do
  for pairing in "tp=1 tp=2" "tp=2 tp=1" "pp=2 tp=1"; do
    row ${pairing} --layers 2 --kv-heads 4 --dtype float16 --rnn "$RNN,layout=$layout"
  done
done
row tp=2,pp=2 tp=4 --layers 4 --kv-heads 4 --dtype float16 --rnn "$RNN,layers=4,heads=8,n_groups=4,layout=xbc"
ISSUE="layers=2,heads=4,head_dim=64,d_state=16,d_conv=4,n_groups=1,conv_dtype=float32,ssm_dtype=bfloat16"
for layout in xbc qkv none; do  # the issue's example: one group, replicated on both TP ranks
  for pairing in "tp=1 tp=2" "tp=2 tp=1" "pp=2 tp=1" "tp=2 tp=2,dp=1"; do
    row ${pairing} --layers 2 --kv-heads 4 --dtype bfloat16 --rnn "$ISSUE,layout=$layout"
  done
done
} > "$OUT_FILE"
