"""The floor of one READ shape, three ways in one run: NIXL's Python binding, nixl_kv's compiled core as the library
calls it (``NixlAgent``: post, poll, release), and the plain C loop of NIXL's C API (``nixl_kv._core``'s ``floor``:
make + post + poll + release with no Python between rounds). Two processes: a peer that registers the source and
polls its notifications every ``--peer-poll-us`` (as nixl_kv's progress loop does), and the reader.

Every READ is checked: the destination must hold the source's bytes after each way. Prints each way's p50 and p99
and the core's ratio to the C loop (issue 32's milestone 1: at most 1.2), then one JSON line. Usage:
``.venv/bin/python scripts/bench_floor.py [--descriptors 4] [--kib 32] [--rounds 2000] [--memory DRAM|VRAM]``
(VRAM: cupy, both processes on GPU 0, UCX's cuda_ipc with GET zero-copy).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import time
from typing import Any

import numpy as np

from nixl_kv.agents.nixl_agent import NixlAgent
from nixl_kv.interfaces import TransferStatus
from nixl_kv.layout import MemoryKind, MemoryRegion

PEER = "floor-peer"
READ_TIMEOUT_S = 10.0  # a READ not done by then ends the run
CHUNKS = 10  # each way runs in this many turns, interleaved with the others


def buffer(nbytes: int, memory: MemoryKind, fill: bool) -> Any:
    """The source (a known pattern) or the destination (zeros), in DRAM (numpy) or VRAM (cupy)."""
    pattern = (np.arange(nbytes, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8) if fill else None
    if memory is MemoryKind.DRAM:
        return pattern if fill else np.zeros(nbytes, dtype=np.uint8)
    import cupy

    return cupy.asarray(pattern) if fill else cupy.zeros(nbytes, dtype=cupy.uint8)


def address(array: Any) -> int:
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr


def host(array: Any) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


def serve_peer(nbytes: int, memory: str, poll_s: float, ready: Any, stop: Any) -> None:
    """The READ target: registers the source, then polls its notifications every ``poll_s`` until told to stop."""
    kind = MemoryKind(memory)
    agent = NixlAgent(PEER)
    source = buffer(nbytes, kind, fill=True)
    agent.register([MemoryRegion(address(source), nbytes, 0, kind)])
    ready.put((agent.metadata(), address(source)))
    while True:
        agent.poll_notifications()
        time.sleep(poll_s)
        try:
            stop.get_nowait()
            break
        except queue.Empty:
            pass
    agent.close()


def rows(base: int, descriptors: int, size: int) -> np.ndarray:
    """``descriptors`` entries of ``size`` bytes, spaced two apart (never merged into one)."""
    return np.array([[base + 2 * i * size, size, 0] for i in range(descriptors)], dtype=np.uint64)


def through_core(agent: NixlAgent, lists: tuple[Any, Any], indices: np.ndarray, rounds: int) -> list[float]:
    """Microseconds of each READ as the library posts and polls it through the core."""
    local, remote = lists
    micros = []
    for _ in range(rounds):
        start = time.perf_counter()
        transfer = agent.read(local, indices, remote, indices, b"")
        deadline = start + READ_TIMEOUT_S
        while (state := agent.status(transfer)) is TransferStatus.IN_PROGRESS and time.perf_counter() < deadline:
            pass
        agent.release_transfer(transfer)
        micros.append((time.perf_counter() - start) * 1e6)
        if state is not TransferStatus.DONE:
            raise RuntimeError(f"a READ through the core ended {state.value}")
    return micros


class BindingReader:
    """READs through NIXL's Python binding: its own agent in the reader's process, lists prepped once."""

    def __init__(self, metadata: bytes, memory: MemoryKind, spans: tuple[np.ndarray, np.ndarray]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from nixl_kv.agents.nixl_agent import unseal_metadata

        self.agent = nixl_agent("floor-binding", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        local_rows, remote_rows = spans
        first, last = local_rows[0], local_rows[-1]
        region = (int(first[0]), int(last[0] + last[1] - first[0]), 0, "")
        self.registration = self.agent.register_memory([region], memory.value)
        self.agent.add_remote_agent(unseal_metadata(metadata))
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, memory.value)
        self.remote = self.agent.prep_xfer_dlist(PEER, remote_rows, memory.value)
        self.indices = np.arange(len(local_rows), dtype=np.int32)

    def reads(self, rounds: int) -> list[float]:
        """Microseconds of each READ: make, post, poll, release."""
        agent, micros = self.agent, []
        for _ in range(rounds):
            start = time.perf_counter()
            transfer = agent.make_prepped_xfer("READ", self.local, self.indices, self.remote, self.indices, b"")
            state = agent.transfer(transfer)
            deadline = start + READ_TIMEOUT_S
            while state == "PROC" and time.perf_counter() < deadline:
                state = agent.check_xfer_state(transfer)
            transfer.release()
            micros.append((time.perf_counter() - start) * 1e6)
            if state != "DONE":
                raise RuntimeError(f"a READ through NIXL's Python binding ended {state}")
        return micros

    def close(self) -> None:
        self.local.release()
        self.remote.release()
        self.agent.remove_remote_agent(PEER)
        self.agent.deregister_memory(self.registration)


def summary(micros: list[float]) -> dict[str, float]:
    ordered = sorted(micros[1:])  # the first READ pays the connection
    return {"p50_us": statistics.median(ordered), "p99_us": ordered[int(0.99 * (len(ordered) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--descriptors", type=int, default=4)
    parser.add_argument("--kib", type=int, default=32, help="bytes of each descriptor, in KiB")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--memory", choices=["DRAM", "VRAM"], default="DRAM")
    parser.add_argument("--peer-poll-us", type=float, default=50.0, help="the peer's sleep between polls")
    args = parser.parse_args()
    memory = MemoryKind(args.memory)
    size = args.kib * 1024
    nbytes = 2 * args.descriptors * size
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    ready, stop = mp.get_context("spawn").Queue(), mp.get_context("spawn").Queue()
    peer = mp.get_context("spawn").Process(
        target=serve_peer, args=(nbytes, memory.value, args.peer_poll_us / 1e6, ready, stop)
    )
    peer.start()
    reader = NixlAgent("floor-reader")
    try:
        metadata, source = ready.get(timeout=120)
        target = buffer(nbytes, memory, fill=False)
        expected = host(buffer(nbytes, memory, fill=True))
        reader.register([MemoryRegion(address(target), nbytes, 0, memory)])
        reader.load_remote(metadata, PEER)
        spans = (rows(address(target), args.descriptors, size), rows(source, args.descriptors, size))
        lists = (reader.prepare(None, spans[0], memory), reader.prepare(PEER, spans[1], memory))
        indices = np.arange(args.descriptors, dtype=np.int32)

        def checked(micros: Any) -> list[float]:
            got, mask = host(target), np.zeros(nbytes, dtype=bool)
            for i in range(args.descriptors):
                mask[2 * i * size : (2 * i + 1) * size] = True
            if not np.array_equal(got[mask], expected[mask]):
                raise RuntimeError("the READ's bytes differ from the source")
            target.fill(0)
            return list(micros)

        binding = BindingReader(metadata, memory, spans)
        ways = {
            "binding": lambda n: binding.reads(n),
            "core": lambda n: through_core(reader, lists, indices, n),
            "c_loop": lambda n: reader._agent.floor(lists[0], lists[1], indices, n),
        }
        micros: dict[str, list[float]] = {way: [] for way in ways}
        chunk = max(1, args.rounds // CHUNKS)
        try:
            for _ in range(CHUNKS):  # interleaved, so a busy moment of the machine costs every way alike
                for way, run in ways.items():
                    micros[way] += checked(run(chunk))
        finally:
            binding.close()
        results = {way: summary(found) for way, found in micros.items()}
    finally:
        stop.put(True)
        peer.join(timeout=30)
        if peer.is_alive():
            peer.kill()
        reader.close()
    floor = results["c_loop"]["p50_us"]
    print(f"{memory.value}: {args.descriptors} x {args.kib} KiB, {args.rounds} rounds, peer polling every "
          f"{args.peer_poll_us:.0f} us")  # fmt: skip
    print("| way | p50 us | p99 us | p50 / C loop |\n|---|---:|---:|---:|")
    for way, figures in results.items():
        print(f"| {way} | {figures['p50_us']:.1f} | {figures['p99_us']:.1f} | {figures['p50_us'] / floor:.2f} |")
    record = {"memory": memory.value, "descriptors": args.descriptors, "kib": args.kib, "rounds": args.rounds}
    record |= {f"{way}_{key}": round(value, 2) for way, figures in results.items() for key, value in figures.items()}
    record["core_over_c_loop"] = round(results["core"]["p50_us"] / floor, 3)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
