#!/usr/bin/env bash
# Long-form fuzzing, not part of CI: 100,000 mutated inputs each for the wire decoder (params, ctx state, every
# control message) and agent metadata, and 2,000 mutated params through a real gen transceiver. Arguments go to
# scripts/fuzz.py (--inputs N, --requests N, --seed S, --only decoder|metadata|transceiver).
source "$(dirname "$0")/_env.sh"
python scripts/fuzz.py "$@" 2>&1 | grep -a -E "^(decoder|agent metadata|transceiver|FAIL|  input)"
exit "${PIPESTATUS[0]}"
