#!/usr/bin/env bash
# A real SGLang prefill and decode pair through nixl_kv's transfer backend (or --backend nixl: SGLang's own NIXL
# backend), against aggregated SGLang on the same tiny checkpoint: a table, exit 0 only if every output is identical.
# Makes (or reuses) .venv-sglang; stops everything it started. Arguments: --help.
source "$(dirname "$0")/sglang_env.sh"
cd "$ROOT"
exec "$NIXL_KV_SGLANG_PYTHON" -m nixl_kv.sglang.pair "$@"
