"""Plot a `nixl-kv bench` JSON file: bandwidth against request size for nixl_kv and each baseline.

Usage: python3 scripts/plot_bench.py bench.json bench.png   (needs matplotlib)
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = [  # (section of the sweep row, key): the idle and busy runs have sections, the other baselines do not
    (("idle", "gbps"), "nixl_kv"),
    (("busy", "gbps"), "nixl_kv, busy thread in every worker"),
    (("idle", "raw_read_gbps"), "raw NIXL READ, one descriptor"),
    (("idle", "per_block_read_gbps"), "naive loop, one READ per block"),
    ((None, "memcpy_peer_gbps"), "cudaMemcpyPeer"),
    ((None, "nccl_sendrecv_gbps"), "NCCL send/recv"),
]


def value(row: dict, section: str | None, key: str) -> float | None:
    """Files written before the busy runs keep the idle figures in the row itself."""
    if section is None:
        return row.get(key)
    return row.get(section, row if section == "idle" else {}).get(key)


def request_mib(row: dict) -> float:
    if "request_bytes" in row:
        return row["request_bytes"] / 2**20
    return row["bytes"] / len(row["gbps_per_round"]) / 2**20  # older files: bytes of all rounds


def main() -> None:
    with open(sys.argv[1]) as handle:
        data = json.load(handle)
    sweep = data["sweep"]
    mib = [request_mib(row) for row in sweep]
    figure, axes = plt.subplots(figsize=(8, 5))
    for (section, key), label in SERIES:
        points = [(x, value(row, section, key)) for x, row in zip(mib, sweep, strict=True) if value(row, section, key)]
        if points:
            axes.plot(*zip(*points, strict=True), marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_xlabel(f"request size (MiB; {data.get('shape', 'llama8b')} shape)")
    axes.set_ylabel("GB/s")
    axes.set_title(f"nixl_kv on {data['device']}, {data['date']}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.savefig(sys.argv[2], dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
