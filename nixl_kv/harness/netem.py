"""A userspace netem: delay, jitter (so reordering) and random loss between two TAP devices.

Why it exists: the soak (scripts/soak.sh) wants delay, reordering and loss on the link between its two network
namespaces, and this machine's kernel has no sch_netem (CONFIG_NET_SCH_NETEM is not set: ``tc qdisc add ... netem``
fails; only tbf, htb and ingress are there). TUN/TAP is, so this process relays Ethernet frames between two TAP
devices and applies the impairments itself.

How it is used (as root)::

    python -m nixl_kv.harness.netem --a tap-a --b tap-b --delay-ms 5 --jitter-ms 4 --loss 0.005 >netem.out &
    # once netem.out holds the line "ready": the devices exist (down, MTU set); move them where they belong
    ip link set tap-a netns NS_A && ip -n NS_A addr add 10.0.0.1/24 dev tap-a && ip -n NS_A link set tap-a up
    ip link set tap-b netns NS_B && ip -n NS_B addr add 10.0.0.2/24 dev tap-b && ip -n NS_B link set tap-b up
    ...
    kill -TERM %1; wait   # netem.out gets one JSON line of stats

Its file descriptors stay attached to the devices when they move to another namespace. The devices are not
persistent: they disappear when the relay exits, wherever they are. Both ends must use the same MTU (``--mtu``
sets both; a large one keeps the per-frame cost of Python from capping throughput too low).

The model: every frame read from one device is written to the other, unless dropped (probability ``--loss``, at
arrival); a frame that is kept waits ``--delay-ms`` plus a uniform random jitter in [-``--jitter-ms``,
+``--jitter-ms``] (at least 0), in a heap by release time, so a frame overtakes an earlier one when the jitter
exceeds the gap between them: that is the reordering. The random numbers come from one ``random.Random(--seed)``.
Single-threaded: one poll loop whose timeout runs to the next release; a write that would block keeps its frame for
the next turn (no frame is lost except by the loss model; a write to a device that is down fails with EIO and is
counted as ``undeliverable``, as a frame sent to an unplugged port would be).

Stats (the JSON line at exit), per direction (``a_to_b``, ``b_to_a``) and summed: ``frames`` relayed, ``bytes``
relayed, ``dropped`` by the loss model, ``reordered`` (frames released after a frame that arrived later in the same
direction), ``undeliverable``; and ``pending`` (frames still waiting when it stopped).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import heapq
import json
import math
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
SIOCSIFMTU = 0x8922
IFNAMSIZ = 16
FRAME_OVERHEAD = 18  # an Ethernet header and one VLAN tag: a read of MTU + this takes any frame whole
READ_BATCH = 64  # frames read from one device per turn of the loop, so that neither direction starves the other
IN, OUT = select.POLLIN, select.POLLOUT


@dataclass(frozen=True)
class Config:
    a: str
    b: str
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    mtu: int = 9000
    seed: int = 0

    def latency(self, rng: random.Random) -> float:
        """A frame's time in the relay: the delay plus uniform jitter, never negative."""
        if not self.jitter_s:
            return self.delay_s
        return max(0.0, self.delay_s + rng.uniform(-self.jitter_s, self.jitter_s))


@dataclass
class DirectionStats:
    frames: int = 0
    bytes: int = 0
    dropped: int = 0
    reordered: int = 0
    undeliverable: int = 0


@dataclass
class Direction:
    """One way through the relay: frames read from ``src`` are written to ``dst``."""

    name: str
    src: int
    dst: int
    stats: DirectionStats = field(default_factory=DirectionStats)
    outbox: deque[bytes] = field(default_factory=deque)  # released, not yet written (the write would block)
    arrivals: int = 0  # frames read so far: a frame's arrival index
    latest_released: int = -1  # the highest arrival index released so far


class Relay:
    def __init__(self, config: Config, fd_a: int, fd_b: int) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.directions = (Direction("a_to_b", fd_a, fd_b), Direction("b_to_a", fd_b, fd_a))
        self.by_src = {d.src: i for i, d in enumerate(self.directions)}
        self.heap: list[tuple[float, int, int, int, bytes]] = []  # (release, seq, direction, arrival, frame)
        self.seq = 0
        self.read_size = config.mtu + FRAME_OVERHEAD

    def receive(self, index: int, now: float) -> None:
        """Read what waits on one direction's source (up to READ_BATCH frames): drop or schedule each frame."""
        direction = self.directions[index]
        for _ in range(READ_BATCH):
            try:
                frame = os.read(direction.src, self.read_size)
            except BlockingIOError:
                return
            arrival = direction.arrivals
            direction.arrivals += 1
            if self.config.loss and self.rng.random() < self.config.loss:
                direction.stats.dropped += 1
                continue
            heapq.heappush(self.heap, (now + self.config.latency(self.rng), self.seq, index, arrival, frame))
            self.seq += 1

    def release(self, now: float) -> None:
        """Move every frame whose time has come to its direction's outbox, counting those that overtook others."""
        while self.heap and self.heap[0][0] <= now:
            _, _, index, arrival, frame = heapq.heappop(self.heap)
            direction = self.directions[index]
            if arrival < direction.latest_released:
                direction.stats.reordered += 1
            else:
                direction.latest_released = arrival
            direction.outbox.append(frame)

    def flush(self, direction: Direction) -> bool:
        """Write the direction's outbox; False when a write would block (the rest waits for POLLOUT)."""
        while direction.outbox:
            frame = direction.outbox[0]
            try:
                os.write(direction.dst, frame)
            except BlockingIOError:
                return False
            except OSError as error:
                if error.errno != errno.EIO:  # EIO: the device is down (or moving between namespaces)
                    raise
                direction.stats.undeliverable += 1
            else:
                direction.stats.frames += 1
                direction.stats.bytes += len(frame)
            direction.outbox.popleft()
        return True

    def timeout_ms(self, now: float) -> int | None:
        """Until the next release (None: nothing waits)."""
        if not self.heap:
            return None
        return max(0, math.ceil((self.heap[0][0] - now) * 1e3))

    def run(self, wake_fd: int, stopped: list[bool]) -> None:
        """Relay until ``stopped[0]`` (a signal handler sets it; its wake-up byte arrives on ``wake_fd``)."""
        poller = select.poll()
        for direction in self.directions:
            poller.register(direction.src, IN)
        poller.register(wake_fd, IN)
        blocked = {d.dst: False for d in self.directions}
        while not stopped[0]:
            self.release(time.monotonic())
            for direction in self.directions:
                now_blocked = not self.flush(direction)
                if now_blocked != blocked[direction.dst]:
                    poller.modify(direction.dst, IN | OUT if now_blocked else IN)
                    blocked[direction.dst] = now_blocked
            events = poller.poll(self.timeout_ms(time.monotonic()))
            now = time.monotonic()
            for fd, event in events:
                if fd == wake_fd:
                    _drain(wake_fd)
                elif event & IN:
                    self.receive(self.by_src[fd], now)
                elif event & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    raise OSError(f"poll reports {event:#x} on a TAP device: it is gone (its namespace removed?)")

    def stats(self) -> dict[str, object]:
        per_direction = {d.name: asdict(d.stats) for d in self.directions}
        totals = {key: sum(s[key] for s in per_direction.values()) for key in asdict(DirectionStats())}
        pending = len(self.heap) + sum(len(d.outbox) for d in self.directions)
        return {**totals, "pending": pending, **per_direction}


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except BlockingIOError:
        pass


def open_tap(name: str) -> int:
    """A new TAP device ``name`` (Ethernet frames, no packet information header) and its non-blocking fd."""
    if not 0 < len(name.encode()) < IFNAMSIZ:
        raise ValueError(f"a device name has 1 to {IFNAMSIZ - 1} bytes")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def set_mtu(name: str, mtu: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        fcntl.ioctl(sock, SIOCSIFMTU, struct.pack("16si20x", name.encode(), mtu))


def stop_on_signals() -> tuple[int, list[bool]]:
    """SIGTERM and SIGINT set the returned flag and wake the poll loop through the returned fd."""
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    stopped = [False]

    def stop(_signum: int, _frame: object) -> None:
        stopped[0] = True

    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return wake_read, stopped


def parse_args(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(prog="python -m nixl_kv.harness.netem", description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="name of the first TAP device (created here)")
    parser.add_argument("--b", required=True, help="name of the second TAP device (created here)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="each frame's delay, each way")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter added to the delay: +-this")
    parser.add_argument("--loss", type=float, default=0.0, help="probability that a frame is dropped")
    parser.add_argument("--mtu", type=int, default=9000, help="MTU of both devices")
    parser.add_argument("--seed", type=int, default=0, help="seed of the loss and jitter draws")
    args = parser.parse_args(argv)
    if args.delay_ms < 0 or args.jitter_ms < 0 or not 0 <= args.loss <= 1 or args.mtu < 68:
        parser.error("--delay-ms and --jitter-ms must be >= 0, --loss in [0, 1], --mtu >= 68")
    return Config(args.a, args.b, args.delay_ms / 1e3, args.jitter_ms / 1e3, args.loss, args.mtu, args.seed)


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    fds: list[int] = []
    try:
        for name in (config.a, config.b):
            fds.append(open_tap(name))
            set_mtu(name, config.mtu)
    except (OSError, ValueError) as error:
        print(f"netem: cannot create TAP device {name!r}: {error}", file=sys.stderr)
        for fd in fds:
            os.close(fd)
        return 1
    relay = Relay(config, *fds)
    wake_fd, stopped = stop_on_signals()
    print("ready", flush=True)
    status = 0
    try:
        relay.run(wake_fd, stopped)
    except OSError as error:
        print(f"netem: {error}", file=sys.stderr)
        status = 1
    finally:
        print(json.dumps(relay.stats()), flush=True)
        for fd in fds:
            os.close(fd)
    return status


if __name__ == "__main__":
    sys.exit(main())
