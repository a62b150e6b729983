#!/usr/bin/env bash
# A router, a ctx and a gen server on localhost serve 32 prompts (8 at a time); every output is checked against
# plain transformers generate(do_sample=False). Arguments go to nixl_kv.serving.check (--help lists them), e.g.
#   scripts/run_disagg.sh --ctx-tp 2 --gen-tp 1 --kind bamba --dtype bfloat16
source "$(dirname "$0")/_env.sh"
exec python -m nixl_kv.serving.check "$@"
