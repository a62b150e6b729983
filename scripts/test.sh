#!/usr/bin/env bash
# The whole test suite (lint included), on a fresh machine or a reused venv. Arguments go to pytest.
source "$(dirname "$0")/_env.sh"
source scripts/system_deps.sh
source scripts/vllm_env.sh  # the venv tests/test_vllm.py runs real vLLM servers from
source scripts/sglang_env.sh  # the venv tests/test_sglang.py runs real SGLang servers from
ruff check .
ruff format --check .
status=0
python -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
