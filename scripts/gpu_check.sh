#!/usr/bin/env bash
# On the GPU machine (no package index): install nixl from the wheels carried in .whl/, then run the GPU tests
# and a Llama-3-8B-like pair on VRAM. Logs go to $OUT (or ./out). Usage: scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
for rounds in 3; do
  python3 -m nixl_kv.cli pair --device cuda --rounds "$rounds" --requests 256,777,1500,3000,8000 --json 2>"$OUT/pair.err" \
    | tee "$OUT/pair.txt" | tail -4
done
