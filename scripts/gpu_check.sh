#!/usr/bin/env bash
# On the GPU machine (no package index): install nixl from the wheels carried in .whl/, then run the GPU tests
# and a Llama-3-8B-like pair on VRAM. Logs go to $OUT (or ./out). Usage: scripts/gpu_check.sh
source "$(dirname "$0")/_gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 -m nixl_kv.cli pair --device cuda --rounds 3 --requests 256,777,1500,3000,8000 --json 2>"$OUT/pair.err" \
  | tee "$OUT/pair.txt" | tail -4
