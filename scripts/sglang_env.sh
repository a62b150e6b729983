# Shared set-up of scripts/run_sglang_pair.sh, bench_sglang.sh and test.sh: create or reuse .venv-sglang (SGLang
# 0.5.23 on CPU torch, and nixl_kv). Sourced. Set NIXL_KV_SGLANG_VENV to use another. Exports NIXL_KV_SGLANG_PYTHON
# and NIXL_KV_SGLANG_PYTHONPATH (the two stand-ins in tests/sglang_stubs: this CPU only, see the README).
#
# `pip install sglang` does not run on a CPU: its CPU build needs packages that are not on PyPI, and its Requires-Dist
# pins CUDA ones. So: CPU torch, sglang with --no-deps, then its Requires-Dist without the CUDA-only packages.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SGLANG_VENV="${NIXL_KV_SGLANG_VENV:-$ROOT/.venv-sglang}"
sglang_stamp="$SGLANG_VENV/.nixl_kv_installed"
# sglang 0.5.23's Requires-Dist, less torch (CPU torch instead) and the CUDA-only packages (flashinfer, sglang-kernel,
# deep-ep/gemm, flash-mla, flash-attn, cutlass, tilelang, nvshmem, cuda-python, torch_memory_saver, torchaudio,
# torchcodec, quack, humming, kernels) and the tools the server does not import (py-spy, build, ninja)
SGLANG_DEPS=(
  aiohttp "anthropic>=0.20.0" blobfile==3.0.0 compressed-tensors==0.18.0 datasets distro easydict einops fastapi gguf
  interegular "llguidance>=1.7.6,<2.0.0" "mistral_common>=1.11.5" modelscope msgspec numba==0.65.1 numpy nvidia-ml-py
  openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser pillow
  "prometheus-client>=0.20.0" psutil pybase64 pydantic "python-dateutil<3" python-multipart "pyzmq>=25.1.2" regex
  requests scipy sentencepiece==0.2.1 setproctitle "smg-grpc-servicer>=0.9.0" soundfile==0.13.1 tiktoken timm==1.0.25
  tokenizers==0.23.2 tqdm transformers==5.19.0 "uvicorn>=0.51" uvloop watchfiles xgrammar==0.2.7 xxhash zstandard
  apache-tvm-ffi==0.1.11 IPython
)
if [ ! -f "$sglang_stamp" ] || [ "$ROOT/pyproject.toml" -nt "$sglang_stamp" ] \
  || [ "$ROOT/scripts/sglang_env.sh" -nt "$sglang_stamp" ]; then
  echo "[setup] installing sglang 0.5.23 (CPU) and nixl-kv into $SGLANG_VENV (a few minutes the first time)" >&2
  sglang_log="$(mktemp)"
  if ! {
    { [ -x "$SGLANG_VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$SGLANG_VENV"; } &&
    "$SGLANG_VENV/bin/python" -m pip install -q --upgrade pip &&
    "$SGLANG_VENV/bin/python" -m pip install -q torch==2.13.0+cpu nixl==1.5.1 msgpack &&
    "$SGLANG_VENV/bin/python" -m pip install -q --no-deps sglang==0.5.23 torchvision==0.28.0 &&
    "$SGLANG_VENV/bin/python" -m pip install -q "${SGLANG_DEPS[@]}" torch==2.13.0+cpu &&
    "$SGLANG_VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
  } >"$sglang_log" 2>&1; then
    cat "$sglang_log" >&2
    echo "[setup] installing SGLang failed (log above)" >&2
    exit 1
  fi
  touch "$sglang_stamp"
fi
export NIXL_KV_SGLANG_PYTHON="$SGLANG_VENV/bin/python"
export NIXL_KV_SGLANG_PYTHONPATH="$ROOT/tests/sglang_stubs"
