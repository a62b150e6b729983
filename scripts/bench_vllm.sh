#!/usr/bin/env bash
# nixl_kv's connector, vLLM's NixlConnector and aggregated vLLM side by side in one run (BENCHMARKS.md): TTFT
# p50/p99, the decode side's time, each connector's transfer time and hook time per request, decode tokens/s, identical
# outputs.
# Makes (or reuses) .venv-vllm. Arguments: --help (defaults: prompts of 256, 1024 and 4096 tokens, concurrency 1 and 8;
# --kind granite_hybrid, deepseek_mla or llama_sw: another checkpoint; --interleave: all three up at once, each cell
# through each in turn, the others paused).
source "$(dirname "$0")/vllm_env.sh"
cd "$ROOT"
exec "$NIXL_KV_VLLM_PYTHON" -m nixl_kv.vllm.bench "$@"
