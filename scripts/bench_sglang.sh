#!/usr/bin/env bash
# nixl_kv's SGLang backend, SGLang's own NIXL backend and aggregated SGLang in one run, on the same tiny checkpoint and
# prompts (256, 1024, 4096 tokens; concurrency 1 and 8): TTFT p50/p99 at the client, the transfer's own time, and
# whether every output is identical. Makes (or reuses) .venv-sglang; stops everything it started. Arguments: --help.
source "$(dirname "$0")/sglang_env.sh"
cd "$ROOT"
exec "$NIXL_KV_SGLANG_PYTHON" -m nixl_kv.sglang.bench "$@"
