# Shared set-up of scripts/run_pair.sh and scripts/test.sh: create or reuse .venv and install nixl-kv into it.
# Sourced, not run. Set NIXL_KV_VENV to use another virtual environment.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NIXL_KV_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.nixl_kv_installed"
# Also when a compiled module (nixl_kv._fastpath, nixl_kv._core: built in place by the editable install) is missing or
# older than its sources.
stale() {  # module, then its sources
  local built=("$ROOT"/nixl_kv/"$1".*.so) source
  [ -f "${built[0]}" ] || return 0
  for source in "${@:2}"; do [ "$ROOT/$source" -nt "${built[0]}" ] && return 0; done
  return 1
}
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || [ "$ROOT/setup.py" -nt "$stamp" ] \
  || stale _fastpath nixl_kv/_fastpath.pyx \
  || stale _core nixl_kv/_core.pyx nixl_kv/csrc/nixl_capi.c nixl_kv/csrc/nixl_capi.h; then
  echo "[setup] installing nixl-kv and its test extras (nixl brings torch: about a minute the first time)" >&2
  log="$VENV/install.log"
  if ! { "$VENV/bin/python" -m pip install -q --upgrade pip && "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "[setup] installation failed (log above, also in $log)" >&2
    exit 1
  fi
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
