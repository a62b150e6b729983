#!/usr/bin/env bash
# On the GPU machine (no package index): `nixl-kv bench` on VRAM, ctx on GPU 0 and gen on GPU 1, every baseline in
# the same run. Writes $OUT/bench.json (then: python3 scripts/plot_bench.py bench.json bench.png, anywhere).
# Needs the wheels in .whl (see scripts/gpu_check.sh).
source "$(dirname "$0")/_gpu_env.sh"
python3 -m nixl_kv.cli bench --device cuda --out "$OUT/bench.json" "$@" 2> >(grep -v "PerformanceWarning\|views\[0\]" >&2)
