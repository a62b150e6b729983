"""A ctx instance in its own process, for tests that kill it: prints its params, then prefills slowly.

Usage: python -m tests.ctx_process LEASE_MS NUM_TOKENS. Prints "PARAMS <base64 ContextPhaseParams>", marks only
the first of its layers done (a layer-wise request stays in flight), then waits to be killed.
"""

from __future__ import annotations

import base64
import sys
import time

from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.harness.fill import expected
from nixl_kv.progress import ContextProgress
from nixl_kv.requests import TransferRequest
from nixl_kv.transceiver import CacheTransceiver
from tests.conftest import Shape


def main() -> None:
    lease_ms, num_tokens = int(sys.argv[1]), int(sys.argv[2])
    shape = Shape()
    cache = shape.cache()
    transceiver = CacheTransceiver(cache, shape.state(), CacheTransceiverConfig(lease_ms=lease_ms))
    cache.allocate(1, num_tokens)
    cache.write_tokens(1, expected(1, shape.where(num_tokens), shape.dtype.itemsize))
    progress = ContextProgress(shape.layers)
    request = TransferRequest(1, num_tokens=num_tokens)
    transceiver.respond_and_send_layer_wise([request], progress)
    progress.mark_layer_done(0)
    print("PARAMS", base64.b64encode(request.context_phase_params).decode(), flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
