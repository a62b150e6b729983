#!/usr/bin/env bash
# On the GPU machine (no package index): `nixl-kv bench` on VRAM, ctx on GPU 0 and gen on GPU 1, every baseline in
# the same run. Writes $OUT/bench.json (then: python3 scripts/plot_bench.py bench.json bench.png, anywhere).
# Needs the wheels in .whl (see scripts/gpu_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m nixl_kv.cli bench --device cuda --out "$OUT/bench.json" "$@" 2> >(grep -v "PerformanceWarning\|views\[0\]" >&2)
