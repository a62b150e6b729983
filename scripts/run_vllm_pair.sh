#!/usr/bin/env bash
# A real vLLM prefill and decode pair through nixl_kv's connector (or --connector nixl: vLLM's own NixlConnector),
# with the router, against aggregated vLLM on the same tiny checkpoint: a table, exit 0 only if every output is
# identical. Makes (or reuses) .venv-vllm; stops everything it started. Arguments: --help.
source "$(dirname "$0")/vllm_env.sh"
cd "$ROOT"
exec "$NIXL_KV_VLLM_PYTHON" -m nixl_kv.vllm.pair "$@"
