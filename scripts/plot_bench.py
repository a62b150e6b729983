"""Plot a `nixl-kv bench` JSON file: bandwidth against request size for nixl_kv and each baseline.

Usage: python3 scripts/plot_bench.py bench.json bench.png   (needs matplotlib)
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = [
    ("gbps", "nixl_kv"),
    ("raw_read_gbps", "raw NIXL READ, one descriptor"),
    ("per_block_read_gbps", "naive loop, one READ per block"),
    ("memcpy_peer_gbps", "cudaMemcpyPeer"),
    ("nccl_sendrecv_gbps", "NCCL send/recv"),
]


def main() -> None:
    with open(sys.argv[1]) as handle:
        data = json.load(handle)
    sweep = data["sweep"]
    mib = [row["bytes"] / len(row["gbps_per_round"]) / 2**20 for row in sweep]
    figure, axes = plt.subplots(figsize=(8, 5))
    for key, label in SERIES:
        points = [(x, row[key]) for x, row in zip(mib, sweep, strict=True) if row.get(key)]
        if points:
            axes.plot(*zip(*points, strict=True), marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("request size (MiB; Llama-3-8B-like, 128 KiB per token)")
    axes.set_ylabel("GB/s")
    axes.set_title(f"nixl_kv on {data['device']}, {data['date']}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.savefig(sys.argv[2], dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
