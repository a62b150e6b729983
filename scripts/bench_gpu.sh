#!/usr/bin/env bash
# On the GPU machine: nixl_kv against a raw one-descriptor NIXL READ of the same bytes, measured in the same run,
# for request sizes from 16 to 32k tokens of a Llama-3-8B-like shape (32 layers, 8 kv heads, head dim 128, bf16,
# 32 tokens per block; ctx on GPU 0, gen on GPU 1), and for a 70B-like TP8 -> TP4 slice (80 layers).
# Writes $OUT/bench.jsonl (one JSON object per line). Needs the wheels in .whl (see scripts/gpu_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
run() {  # label, then nixl-kv pair arguments
  local label=$1; shift
  python3 -m nixl_kv.cli pair --device cuda --rounds 5 --json "$@" 2>>"$OUT/bench.err" | tail -1 \
    | python3 -c "import json,sys; d=json.load(sys.stdin); d['label']='$label'; d['args']='$*'; print(json.dumps(d))" \
    | tee -a "$OUT/bench.jsonl"
}
: >"$OUT/bench.jsonl"
for tokens in 16 128 512 2048 8192 32768; do
  run "llama8b-same-$tokens" --requests "$tokens"
done
run "llama8b-4x2048" --requests 2048,2048,2048,2048
run "llama8b-staged-nhd-8192" --requests 8192 --gen layout=nhd
run "70b-tp8-tp4-4096" --requests 4096 --layers 80 --ctx tp=8 --gen tp=4
