"""On the GPU machine: the CUDA IPC gather (``nixl_kv.ipc_gather``) between two processes, every element verified.

A ctx process fills its requests in a VRAM ``PagedKVCache`` from global coordinates and exports its pools; this
process (the gen) maps them once, then each round copies every request's rows (``nixl_kv.runs.coalesced_rows``,
one row per run of adjacent blocks) with one kernel launch per request, or with ``--batch`` one launch for all the
round's requests (a burst), host work and the wait for the event included. Beside it, in this process, one
device-to-device copy of the same bytes (the one-copy ceiling on this GPU). Prints one JSON line: GB/s, the median
of the rounds after the first, with min-max, and the ratio to the one copy. Exits 1 if an element differs.

    python3 scripts/bench_ipc_gather.py --tokens 2048 --layout block_major --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from nixl_kv.cache import PagedKVCache
from nixl_kv.dtypes import DataType
from nixl_kv.harness.fill import Slice, count_mismatches, expected
from nixl_kv.ipc_gather import PeerPools, PoolHandle, export_pools, gather_rows
from nixl_kv.layout import KVLayout, LayoutKind, MemoryKind
from nixl_kv.runs import coalesced_rows


def _cache(args: argparse.Namespace, blocks: int) -> PagedKVCache:
    kind = {"block_major": LayoutKind.BLOCK_MAJOR, "nhd": LayoutKind.PER_LAYER_NHD}[args.layout]
    return PagedKVCache(
        blocks, args.layers, args.kv_heads, args.tokens_per_block, args.head_dim, DataType.BFLOAT16, kind=kind,
        memory=MemoryKind.VRAM,
    )  # fmt: skip


def _where(args: argparse.Namespace, tokens: int) -> Slice:
    return Slice(0, args.layers, 0, args.kv_heads, 2, args.head_dim, 0, tokens)


def _pool_blocks(args: argparse.Namespace) -> int:
    return args.requests * -(-args.tokens // args.tokens_per_block) + 8


def ctx(args: argparse.Namespace) -> None:
    import cupy

    cache = _cache(args, _pool_blocks(args))
    blocks = []
    for rid in range(args.requests):
        cache.allocate(rid, args.tokens)
        cache.write_tokens(rid, expected(rid, _where(args, args.tokens), 2, cupy))
        blocks.append(cache.block_ids(rid).tolist())
    handles = [[h.handle.hex(), *h.to_wire()[1:]] for h in export_pools(cache.layout.pools)]
    layout = cache.layout
    dims = [layout.num_blocks, layout.num_layers, layout.kv_factor, layout.num_heads, layout.tokens_per_block]
    print(json.dumps({"handles": handles, "blocks": blocks, "dims": dims}), flush=True)
    sys.stdin.read()  # until the gen is done with the mapping


def gen(args: argparse.Namespace) -> dict:
    import cupy

    command = [sys.executable, __file__, *sys.argv[1:], "--role", "ctx"]  # the last --role counts
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        told = json.loads(child.stdout.readline())
        handles = tuple(PoolHandle.from_wire((bytes.fromhex(h), *rest)) for h, *rest in told["handles"])
        cache = _cache(args, _pool_blocks(args))
        mine = cache.layout
        remote = KVLayout(
            mine.kind, *told["dims"], mine.head_dim, mine.itemsize, tuple(h.region for h in handles)
        )  # the ctx's pools, in its addresses
        for rid in range(args.requests):
            cache.allocate(rid, args.tokens)
        rows = [
            coalesced_rows(
                mine,
                mine.segment_indices(cache.block_ids(rid), range(args.layers)),
                remote,
                remote.segment_indices(np.array(told["blocks"][rid]), range(args.layers)),
                coarse=True,
                min_saved=0,
            )
            for rid in range(args.requests)
        ]
        peer = PeerPools(handles, 0)
        nbytes = args.requests * -(-args.tokens // args.tokens_per_block) * mine.block_bytes
        seconds, launches = [], 0
        for _ in range(args.rounds):
            start = time.perf_counter()
            if args.batch:
                event = gather_rows(np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows]), peer)
                launches += 1
            else:
                for local_rows, remote_rows in rows:
                    event = gather_rows(local_rows, remote_rows, peer)
                    launches += 1
            event.synchronize()
            seconds.append(time.perf_counter() - start)
        mismatched = sum(
            count_mismatches(cache.read_tokens(rid, args.tokens), rid, _where(args, args.tokens), cupy)
            for rid in range(args.requests)
        )
        peer.close()
        source, target = cupy.empty(nbytes, dtype=cupy.uint8), cupy.empty(nbytes, dtype=cupy.uint8)
        copies = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            target.data.copy_from_device(source.data, nbytes)
            cupy.cuda.get_current_stream().synchronize()
            copies.append(time.perf_counter() - start)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    later = [nbytes / s / 1e9 for s in seconds[1:] or seconds]
    copy = statistics.median([nbytes / s / 1e9 for s in copies[1:] or copies])
    return {
        "layout": args.layout,
        "tokens": args.tokens,
        "requests": args.requests,
        "batch": args.batch,
        "rows_per_request": statistics.median(len(r[0]) for r in rows),
        "launches_per_round": launches // args.rounds,
        "mib": round(nbytes / 2**20, 1),
        "verified": mismatched == 0,
        "mismatched_elements": int(mismatched),
        "gbps": round(statistics.median(later), 1),
        "gbps_min_max": [round(min(later), 1), round(max(later), 1)],
        "p50_us": round(1e6 * statistics.median(seconds[1:] or seconds), 1),
        "one_copy_gbps": round(copy, 1),
        "ratio_to_one_copy": round(statistics.median(later) / copy, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["gen", "ctx"], default="gen")
    parser.add_argument("--layout", choices=["block_major", "nhd"], default="block_major")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--batch", action="store_true", help="one launch for all the round's requests")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    args = parser.parse_args()
    if args.role == "ctx":
        ctx(args)
        return 0
    result = gen(args)
    print(json.dumps(result), flush=True)
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
