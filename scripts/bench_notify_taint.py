"""What a notification costs the next READ to the same peer, over NIXL's UCX backend (DRAM, two processes).

Issue 25's request path sends a notification to its ctx peer after nearly every request (the release of its
hold) and READs from that peer for the next one. This measures, in one run against one peer process that polls its
notifications every ``--peer-poll-us`` (as nixl_kv's progress loop does while requests are held):

- a READ alone (the ceiling);
- a READ after a ReadDone sent as nixl_kv sends it, ``NixlAgent.notify``: through the agent's control agent (same
  name, its own UCX worker and endpoint), progressed for 0.5 ms after it (issue 32's milestone 2: at most 1.3x);
- a READ after a notification sent on the READ's own agent (the data agent: how nixl_kv sent them before),
  progressed alike;
- the second READ after such a notification (the first, untimed, went just before it);
- a READ after a notification sent by another agent of the same process;
- a READ carrying its own notification (NIXL sends it once the READ is over).

The cases take turns, one READ each (after an untimed READ that clears what the last case left), so a busy moment
of the machine costs every case alike. It prints each case's
p50 and its ratio to the READ alone. Usage:
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


def timed_turns(agent: NixlAgent, lists: tuple[Any, Any], repeats: int, cases: list) -> list[list[float]]:
    """Microseconds of each case's READs, the cases taking turns; ahead of each (untimed) a READ that ends whatever
    the last case left behind (a READ pays for the notification before it, the one after it no longer does), then
    the case's ``before``."""
    micros: list[list[float]] = [[] for _ in cases]
    for _ in range(repeats):
        for found, (_, before, note) in zip(micros, cases, strict=True):
            read_once(agent, lists)
            before()
            found.append(read_once(agent, lists, note) * 1e6)
    return micros


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

    def notify_and_progress(notify: Callable[[], None], progress: Callable[[], Any]) -> Callable[[], None]:
        """Notify the peer, then progress the sender for SETTLE_S (its send completes only as it progresses)."""

        def before() -> None:
            notify()
            settle = time.perf_counter() + SETTLE_S
            while time.perf_counter() < settle:
                progress()

        return before

    data_agent = reader._agent  # the core agent that posts the READs
    after_own = notify_and_progress(lambda: data_agent.notify(PEER, message), data_agent.notifications)
    cases = [
        ("READ alone", lambda: None, b""),
        (
            "READ after a ReadDone (NixlAgent.notify: the control agent)",
            notify_and_progress(lambda: reader.notify(PEER, message), reader.poll_notifications),
            b"",
        ),
        ("READ after a notification on the READ's own agent", after_own, b""),
        (
            "second READ after a notification on the READ's own agent",
            lambda: (after_own(), read_once(reader, lists)),
            b"",
        ),
        (
            "READ after a notification from another agent",
            notify_and_progress(lambda: other.notify(PEER, message), other.poll_notifications),
            b"",
        ),
        ("READ carrying a notification", lambda: None, message),
    ]
    try:
        turns = timed_turns(reader, lists, args.repeats, cases)
        results = [(label, statistics.median(micros)) for (label, _, _), micros in zip(cases, turns, strict=True)]
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
