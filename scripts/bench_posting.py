"""Posting cost against transfer time at 100k descriptors, through nixl_kv's NIXL agent (DRAM, loopback).

Prepares strided lists once, then for contiguous and scattered index arrays of 100k 4 KiB entries times the
request's descriptor preparation (make_prepped_xfer with the index arrays) against the whole READ. On DRAM the
UCX copy runs inside transfer() itself, so the post call cannot be told apart from the copy there.
Usage: .venv/bin/python scripts/bench_posting.py
"""

import statistics
import time

import numpy as np

from nixl_kv.agents.nixl_agent import NixlAgent
from nixl_kv.layout import MemoryKind, MemoryRegion

ENTRIES, UNIT, REPEATS = 100_000, 4096, 5


def main() -> None:
    ctx, gen = NixlAgent("bench-ctx"), NixlAgent("bench-gen")
    source = np.random.default_rng(0).integers(0, 255, ENTRIES * UNIT, dtype=np.uint8)
    target = np.zeros_like(source)
    for agent, array in ((ctx, source), (gen, target)):
        agent.register([MemoryRegion(array.ctypes.data, array.nbytes, 0, MemoryKind.DRAM)])
    gen.load_remote(ctx.metadata())
    rows = lambda a: np.array([[a.ctypes.data, UNIT, 0, UNIT, ENTRIES]], dtype=np.uint64)  # noqa: E731
    start = time.perf_counter()
    remote, local = (
        gen.prepare("bench-ctx", rows(source), MemoryKind.DRAM),
        gen.prepare(None, rows(target), MemoryKind.DRAM),
    )
    print(f"prepare two strided lists of {ENTRIES} entries: {(time.perf_counter() - start) * 1e3:.2f} ms")
    for label, indices in (
        ("contiguous", np.arange(ENTRIES, dtype=np.int32)),
        ("scattered", np.random.default_rng(1).permutation(ENTRIES).astype(np.int32)),
    ):
        posting, total = [], []
        for _ in range(REPEATS):
            begin = time.perf_counter()
            transfer = gen._agent.make_prepped_xfer("READ", local, indices, remote, indices, b"")
            posted = time.perf_counter()
            state = gen._agent.transfer(transfer)
            while state == "PROC":
                state = gen._agent.check_xfer_state(transfer)
                ctx.poll_notifications()
            end = time.perf_counter()
            transfer.release()
            posting.append(posted - begin)
            total.append(end - begin)
        assert np.array_equal(target[indices.astype(np.int64)[:3] * UNIT], source[indices.astype(np.int64)[:3] * UNIT])
        p, t = statistics.median(posting), statistics.median(total)
        rate = ENTRIES * UNIT / t / 1e9
        print(f"{label:>10}: descriptors {p * 1e3:.2f} ms of {t * 1e3:.2f} ms ({100 * p / t:.1f}%), {rate:.2f} GB/s")
    gen.close()
    ctx.close()


if __name__ == "__main__":
    main()
