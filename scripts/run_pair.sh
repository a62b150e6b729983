#!/usr/bin/env bash
# The main job: a ctx and a gen instance as separate processes, KV moved with NIXL READs, every element verified.
# Arguments go to `nixl-kv pair` (see `nixl-kv pair --help`); with none, a Llama-3-8B-like shape on the CPU.
source "$(dirname "$0")/_env.sh"
exec nixl-kv pair "$@"
