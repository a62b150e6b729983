"""A ctx instance on a host that will die (``tests.dead_host``): prefills requests, prints their params, waits.

Usage: python -m tests.ctx_host REQUESTS NUM_TOKENS LEASE_MS. Request i (from 1) is filled from global coordinates
with seed i and responded to; its params are printed as "PARAMS <base64>", then "READY"; the process then waits to
be killed (at most 300 s).
"""

from __future__ import annotations

import base64
import sys
import time

from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.harness.fill import expected
from nixl_kv.requests import TransferRequest
from nixl_kv.transceiver import CacheTransceiver
from tests.conftest import Shape


def main() -> None:
    requests, num_tokens, lease_ms = (int(argument) for argument in sys.argv[1:4])
    shape = Shape(num_blocks=max(64, requests * -(-num_tokens // Shape.tokens_per_block)))
    cache = shape.cache()
    transceiver = CacheTransceiver(cache, shape.state(), CacheTransceiverConfig(lease_ms=lease_ms))
    for request_id in range(1, requests + 1):
        cache.allocate(request_id, num_tokens)
        cache.write_tokens(request_id, expected(request_id, shape.where(num_tokens), shape.dtype.itemsize))
        request = TransferRequest(request_id, num_tokens=num_tokens)
        transceiver.respond_and_send_async(request)
        print("PARAMS", base64.b64encode(request.context_phase_params).decode(), flush=True)
    print("READY", flush=True)
    time.sleep(300)


if __name__ == "__main__":
    main()
