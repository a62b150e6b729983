"""What a notification costs the next READ to the same peer, over NIXL's UCX backend (DRAM, two processes).

Issue 25's request path sends a notification to its ctx peer after nearly every request (the release of its
hold) and READs from that peer for the next one. This measures, in one run against one peer process that polls its
notifications every ``--peer-poll-us`` (as nixl_kv's progress loop does while requests are held):

- a READ alone (the ceiling);
- a READ after a notification to the peer sent by the same agent (progressed for 0.5 ms after it);
- a READ after a notification sent by a second agent of the same process (its own UCX worker and endpoint),
  progressed alike;
- the second READ after such a notification (the first, untimed, went just before it);
- a READ carrying its own notification (NIXL sends it once the READ is over).

It prints each case's p50 and its ratio to the READ alone. Usage:
``.venv/bin/python scripts/bench_notify_taint.py [--kib 128] [--repeats 300] [--peer-poll-us 50]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from nixl_kv.agents.nixl_agent import NixlAgent
from nixl_kv.interfaces import TransferStatus
from nixl_kv.layout import MemoryKind, MemoryRegion

PEER = "taint-peer"
SETTLE_S = 500e-6  # how long the sender is progressed after its notification, before the READ is posted
READ_TIMEOUT_S = 10.0  # a READ not done by then ends the run (a loopback READ takes microseconds)


def serve_peer(nbytes: int, poll_s: float, ready: Any, stop: Any) -> None:
    """The READ target: registers a buffer, then polls its notifications every ``poll_s`` until told to stop."""
    agent = NixlAgent(PEER)
    source = np.arange(nbytes, dtype=np.uint8)
    agent.register([MemoryRegion(source.ctypes.data, source.nbytes, 0, MemoryKind.DRAM)])
    ready.put((agent.metadata(), source.ctypes.data))
    while True:
        agent.poll_notifications()
        time.sleep(poll_s)
        try:
            stop.get_nowait()
            break
        except queue.Empty:
            pass
    agent.close()


def read_once(agent: NixlAgent, lists: tuple[Any, Any], note: bytes = b"") -> float:
    """Seconds of one READ of the whole buffer, post to DONE; RuntimeError if it fails or outlives READ_TIMEOUT_S."""
    local, remote = lists
    index = np.array([0], dtype=np.int32)
    start = time.perf_counter()
    transfer = agent.read(local, index, remote, index, note)
    deadline = start + READ_TIMEOUT_S
    while (state := agent.status(transfer)) is TransferStatus.IN_PROGRESS and time.perf_counter() < deadline:
        pass
    seconds = time.perf_counter() - start
    agent.release_transfer(transfer)
    if state is not TransferStatus.DONE:
        raise RuntimeError(f"READ ended {state.value} after {seconds:.1f} s")
    return seconds


def timed_reads(agent: NixlAgent, lists: tuple[Any, Any], repeats: int, before: Callable[[], None], note: bytes):
    """Microseconds of each READ, ``before`` run ahead of each (untimed)."""
    seconds = []
    for _ in range(repeats):
        before()
        seconds.append(read_once(agent, lists, note))
    return [s * 1e6 for s in seconds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kib", type=int, default=128, help="bytes of each READ, in KiB (one descriptor)")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--peer-poll-us", type=float, default=50.0, help="the peer's sleep between polls")
    args = parser.parse_args()
    nbytes = args.kib * 1024
    ready, stop = mp.Queue(), mp.Queue()
    peer = mp.Process(target=serve_peer, args=(nbytes, args.peer_poll_us / 1e6, ready, stop))
    peer.start()
    metadata, address = ready.get(timeout=60)
    reader, other = NixlAgent("taint-reader"), NixlAgent("taint-notifier")
    target = np.zeros(nbytes, dtype=np.uint8)
    reader.register([MemoryRegion(target.ctypes.data, target.nbytes, 0, MemoryKind.DRAM)])
    for agent in (reader, other):
        agent.load_remote(metadata, PEER)
    rows = lambda base: np.array([[base, nbytes, 0]], dtype=np.uint64)  # noqa: E731
    lists = (
        reader.prepare(None, rows(target.ctypes.data), MemoryKind.DRAM),
        reader.prepare(PEER, rows(address), MemoryKind.DRAM),
    )
    message = b"r" * 40  # about a ReadDone's size

    def notify_and_progress(sender: NixlAgent) -> Callable[[], None]:
        """Notify the peer, then progress the sender for SETTLE_S (its send completes only as it progresses)."""

        def before() -> None:
            sender.notify(PEER, message)
            settle = time.perf_counter() + SETTLE_S
            while time.perf_counter() < settle:
                sender.poll_notifications()

        return before

    after_reader = notify_and_progress(reader)
    cases = [
        ("READ alone", lambda: None, b""),
        ("READ after a notification (same agent)", after_reader, b""),
        ("READ after a notification (second agent)", notify_and_progress(other), b""),
        ("second READ after a notification (same agent)", lambda: (after_reader(), read_once(reader, lists)), b""),
        ("READ carrying a notification", lambda: None, message),
    ]
    try:
        results = [
            (label, statistics.median(timed_reads(reader, lists, args.repeats, before, note)))
            for label, before, note in cases
        ]
        if not np.array_equal(target, np.arange(nbytes, dtype=np.uint8)):
            raise RuntimeError("the READ's bytes differ from the source")
    finally:
        stop.put(True)
        peer.join(timeout=30)
        if peer.is_alive():
            peer.kill()
        reader.close()
        other.close()
    ceiling = results[0][1]
    print(f"{args.kib} KiB READs, {args.repeats} each, peer polling every {args.peer_poll_us:.0f} us")
    print("| case | p50 us | ratio to the READ alone |\n|---|---:|---:|")
    for label, p50 in results:
        print(f"| {label} | {p50:.1f} | {p50 / ceiling:.2f} |")


if __name__ == "__main__":
    main()
