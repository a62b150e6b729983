"""The gen side's admit + plan of one request, hot: two transceivers in one process (DRAM, UCX loopback), one
128-token request of ``nixl-kv pair --layers 2 --kv-heads 2 --head-dim 64 --tokens-per-block 32 --dtype bfloat16``
admitted and planned ``--rounds`` times over (never entered: nothing is pinned or read). Prints the mean in µs.

Why: a request's Python steps cost several times more in the pair (caches cold) than here; this is the figure a
change to those steps moves first. Usage: ``.venv/bin/python scripts/bench_admit_plan.py [--rounds 2000]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nixl_kv.dtypes import DataType  # noqa: E402
from nixl_kv.requests import TransferRequest  # noqa: E402
from tests.conftest import Pair, Shape, make_side  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    shape = Shape(layers=2, heads=2, tokens_per_block=32, head_dim=64, dtype=DataType.BFLOAT16, num_blocks=256)
    pair = Pair(shape, make_side(shape), make_side(shape))
    try:
        receiver = pair.gen.transceiver._receiver
        params = pair.prefill(1, 128).context_phase_params
        pair.gen.cache.allocate(2, 128)

        def admit_and_plan() -> None:
            request = TransferRequest(2, context_phase_params=params)
            request.transfer_start = time.monotonic()
            receiver._planner.plan(receiver._admit.admit(request, Future()))

        for _ in range(50):  # the template is made, the ctx state decoded
            admit_and_plan()
        start = time.perf_counter()
        for _ in range(args.rounds):
            admit_and_plan()
        print(f"admit + plan: {(time.perf_counter() - start) / args.rounds * 1e6:.1f} µs (mean of {args.rounds})")
    finally:
        for side in (pair.ctx, pair.gen):
            side.transceiver.close()


if __name__ == "__main__":
    main()
