#!/usr/bin/env bash
# On the GPU machine (no package index): install nixl from the wheels carried in .whl/, then run the GPU tests
# and a Llama-3-8B-like pair on VRAM. Logs go to $OUT (or ./out). Usage: scripts/gpu_check.sh
source "$(dirname "$0")/_gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python3 -m nixl_kv.cli pair --device cuda --rounds 3 --requests 256,777,1500,3000,8000 --json 2>"$OUT/pair.err" \
  | tee "$OUT/pair.txt" | tail -4
python3 -m nixl_kv.cli pair --device cuda --attention mla --indexer-dim 128 --layers 61 --head-dim 576 \
  --tokens-per-block 64 --rounds 3 --requests 256,777,1500,3000,8000 --json 2>"$OUT/pair_mla_indexer.err" \
  | tee "$OUT/pair_mla_indexer.txt" | tail -2
python3 -m nixl_kv.cli pair --device cuda --layers 8 --kv-heads 8 --head-dim 128 --rounds 3 \
  --rnn layers=48,heads=128,head_dim=64,d_state=128,d_conv=4,n_groups=8,layout=xbc,ssm_dtype=float32 \
  --requests 256,777,1500,3000,8000 --json 2>"$OUT/pair_hybrid.err" | tee "$OUT/pair_hybrid.txt" | tail -2
