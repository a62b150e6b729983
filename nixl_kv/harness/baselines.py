"""Baselines that need no nixl_kv: cudaMemcpyPeer (the link) and an NCCL send/recv (two-sided), per size."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time


def memcpy_peer_gbps(sizes: list[int], repeats: int = 5) -> dict[int, float] | None:
    """cudaMemcpyPeer from GPU 0 to GPU 1 with peer access on (same GPU when there is one); None without cupy."""
    try:
        import cupy
    except ImportError:
        return None
    count = cupy.cuda.runtime.getDeviceCount()
    source_device, target_device = 0, min(1, count - 1)
    if source_device != target_device:
        with cupy.cuda.Device(target_device):
            cupy.cuda.runtime.deviceEnablePeerAccess(source_device)
    largest = max(sizes)
    with cupy.cuda.Device(source_device):
        source = cupy.ones(largest, dtype=cupy.uint8)
    with cupy.cuda.Device(target_device):
        target = cupy.zeros(largest, dtype=cupy.uint8)
    results = {}
    for size in sizes:
        seconds = []
        for _ in range(repeats + 1):  # the first is a warm-up
            cupy.cuda.runtime.deviceSynchronize()
            start = time.perf_counter()
            cupy.cuda.runtime.memcpyPeer(target.data.ptr, target_device, source.data.ptr, source_device, size)
            with cupy.cuda.Device(target_device):
                cupy.cuda.runtime.deviceSynchronize()
            seconds.append(time.perf_counter() - start)
        results[size] = size / statistics.median(seconds[1:]) / 1e9
    return results


_NCCL_RANK = r"""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
rank, sizes, repeats = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
device = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(device)
dist.init_process_group("nccl", init_method=os.environ["NIXL_KV_NCCL_INIT"], rank=rank, world_size=2)
buffer = torch.ones(max(sizes), dtype=torch.uint8, device=device)
out = {}
for size in sizes:
    seconds = []
    for _ in range(repeats + 1):
        dist.barrier(); torch.cuda.synchronize(); start = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(buffer[:size], 1 - rank)
        torch.cuda.synchronize(); seconds.append(time.perf_counter() - start)
    out[size] = size / statistics.median(seconds[1:]) / 1e9
if rank == 1:
    print("NCCL " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def nccl_sendrecv_gbps(sizes: list[int], repeats: int = 5, timeout_s: float = 300) -> dict[int, float] | None:
    """A two-sided NCCL send/recv of the same bytes between two processes; None without torch or a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, NIXL_KV_NCCL_INIT=f"tcp://127.0.0.1:{port}", NCCL_NVLS_ENABLE="0")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _NCCL_RANK, str(rank), json.dumps(sizes), str(repeats)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        output = ranks[1].communicate(timeout=timeout_s)[0]
        ranks[0].wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for process in ranks:
            process.kill()
        return None
    line = next((line for line in output.splitlines() if line.startswith("NCCL ")), None)
    return {int(k): v for k, v in json.loads(line[5:]).items()} if line else None
