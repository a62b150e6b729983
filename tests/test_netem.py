"""The userspace netem (nixl_kv.harness.netem) between two network namespaces: UDP datagrams with sequence numbers
and send times from one namespace to the other show its delay, its reordering and its loss; a TCP stream, what it
carries. Needs root, iproute2 and /dev/net/tun (CI here runs as root): the namespaces are created and removed here."""

from __future__ import annotations

import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PID = os.getpid()
NS_A, NS_B = f"nkv-nt-a-{PID}", f"nkv-nt-b-{PID}"
TAP_A, TAP_B = f"nkvta{PID}", f"nkvtb{PID}"  # (a device name has at most 15 bytes)
ADDR_A, ADDR_B = "10.250.9.1", "10.250.9.2"
PORT = "47001"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not os.path.exists("/dev/net/tun"),
    reason="needs root, iproute2 and /dev/net/tun",
)

RECEIVER = """
import json, socket, struct, sys, time
count = int(sys.argv[1])
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.SOL_SOCKET, 33, 1 << 24)  # SO_RCVBUFFORCE (root)
sock.bind(("0.0.0.0", int(sys.argv[2])))
print("bound", flush=True)
got = []
sock.settimeout(5.0)
try:
    while len(got) < count:
        data = sock.recv(64)
        seq, sent = struct.unpack("!Id", data)
        got.append((seq, time.monotonic() - sent))
        sock.settimeout(0.5)  # (the last ones lost: half a second after the one before)
except TimeoutError:
    pass
print(json.dumps(got))
"""
SENDER = """
import socket, struct, sys, time
count, gap_s = int(sys.argv[3]), float(sys.argv[4])
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.connect((sys.argv[1], int(sys.argv[2])))
for seq in range(count):
    sock.send(struct.pack("!Id", seq, time.monotonic()))  # (CLOCK_MONOTONIC: one clock in every namespace)
    time.sleep(gap_s)
"""
STREAM_RECEIVER = """
import hashlib, socket, sys, time
listener = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
conn, _ = listener.accept()
digest, size, start = hashlib.sha256(), 0, time.monotonic()
while data := conn.recv(1 << 20):
    digest.update(data)
    size += len(data)
print(size, digest.hexdigest(), time.monotonic() - start)
"""
STREAM_SENDER = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = bytes(range(256)) * 4096
for _ in range(int(sys.argv[3])):
    conn.sendall(block)
conn.close()
"""


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10).stdout


def in_netns(netns: str, code: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", netns, sys.executable, "-c", code, *args]


@pytest.fixture(scope="module", autouse=True)
def namespaces() -> Iterator[None]:
    def remove() -> None:
        for netns in (NS_A, NS_B):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)

    remove()
    try:
        ip("netns", "add", NS_A)
        ip("netns", "add", NS_B)
        yield
    finally:
        remove()


@dataclass
class RelayRun:
    process: subprocess.Popen[str]
    stats: dict[str, Any] = field(default_factory=dict)
    stderr: str = ""


def _read_line(process: subprocess.Popen[str], timeout_s: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    return process.stdout.readline() if ready else ""


@contextmanager
def relay(*options: str) -> Iterator[RelayRun]:
    """The relay between TAP_A (moved into NS_A, ADDR_A) and TAP_B (NS_B, ADDR_B); its stats once it stopped (the
    neighbours are static, so no ARP request crosses the impaired link)."""
    command = [sys.executable, "-m", "nixl_kv.harness.netem", "--a", TAP_A, "--b", TAP_B, *options]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    run = RelayRun(process)
    try:
        assert _read_line(process, 10) == "ready\n", process.poll()
        macs = {}
        for netns, tap, address in ((NS_A, TAP_A, ADDR_A), (NS_B, TAP_B, ADDR_B)):
            ip("link", "set", tap, "netns", netns)
            ip("-n", netns, "addr", "add", f"{address}/24", "dev", tap)
            ip("-n", netns, "link", "set", tap, "up")
            macs[netns] = json.loads(ip("-j", "-n", netns, "link", "show", tap))[0]["address"]
        ip("-n", NS_A, "neigh", "replace", ADDR_B, "lladdr", macs[NS_B], "dev", TAP_A, "nud", "permanent")
        ip("-n", NS_B, "neigh", "replace", ADDR_A, "lladdr", macs[NS_A], "dev", TAP_B, "nud", "permanent")
        yield run
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        out, run.stderr = process.communicate(timeout=10)
        lines = out.splitlines()
        run.stats = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    assert process.returncode == 0 and run.stats, (process.returncode, out, run.stderr)
    for netns, tap in ((NS_A, TAP_A), (NS_B, TAP_B)):  # the devices went with the relay
        assert tap not in ip("-n", netns, "link", "show"), netns


def datagrams(count: int, gap_s: float) -> list[tuple[int, float]]:
    """Send ``count`` datagrams from NS_A to NS_B, ``gap_s`` apart: (sequence number, latency) in arrival order."""
    receiver = subprocess.Popen(in_netns(NS_B, RECEIVER, str(count), PORT), stdout=subprocess.PIPE, text=True)
    try:
        assert _read_line(receiver, 10) == "bound\n"
        subprocess.run(in_netns(NS_A, SENDER, ADDR_B, PORT, str(count), str(gap_s)), check=True, timeout=30)
        out, _ = receiver.communicate(timeout=30)
    finally:
        receiver.kill()
        receiver.wait()
    return [(seq, latency) for seq, latency in json.loads(out)]


def out_of_order(got: list[tuple[int, float]]) -> int:
    """Datagrams that arrived after one sent later."""
    late, highest = 0, -1
    for seq, _ in got:
        late += seq < highest
        highest = max(highest, seq)
    return late


def test_a_delay_without_jitter_delays_every_datagram_and_keeps_their_order() -> None:
    with relay("--delay-ms", "30") as run:
        got = datagrams(200, 0.0005)
    assert [seq for seq, _ in got] == list(range(200))  # every one, in order
    latencies = sorted(latency for _, latency in got)
    assert latencies[0] >= 0.030, latencies[:5]  # none earlier than the delay
    assert latencies[len(latencies) // 2] < 0.030 + 0.1, latencies  # (and not much later, on a loaded machine)
    to_b = run.stats["a_to_b"]
    assert to_b["frames"] >= 200 and to_b["bytes"] >= 200 * 54 and run.stats["reordered"] == 0, run.stats
    assert run.stats["dropped"] == 0, run.stats


def test_jitter_reorders_datagrams_and_loses_none() -> None:
    with relay("--delay-ms", "10", "--jitter-ms", "8", "--seed", "7") as run:
        got = datagrams(300, 0.0005)
    assert sorted(seq for seq, _ in got) == list(range(300))  # every one arrived
    late = out_of_order(got)
    assert late > 10, got[:50]  # overtaken: frames 0.5 ms apart, released 2 to 18 ms after they came
    assert min(latency for _, latency in got) >= 0.002
    assert run.stats["a_to_b"]["reordered"] >= late, (late, run.stats)  # (the relay also counts other frames)
    assert run.stats["dropped"] == 0, run.stats


def test_loss_drops_about_the_fraction_asked() -> None:
    with relay("--loss", "0.5", "--seed", "3") as run:
        got = datagrams(400, 0.0002)
    received = len({seq for seq, _ in got})
    assert 120 <= received <= 280, received  # 200 expected; the standard deviation is 10
    assert [seq for seq, _ in got] == sorted(seq for seq, _ in got)  # no jitter: what arrives is in order
    dropped = run.stats["a_to_b"]["dropped"]
    assert 400 - received <= dropped <= 400 - received + 20, (received, run.stats)  # (+ IPv6 chatter, if any)


def test_a_tcp_stream_crosses_intact_with_an_mtu_of_9000() -> None:
    blocks = 50  # 1 MiB each
    receiver = subprocess.Popen(in_netns(NS_B, STREAM_RECEIVER, PORT), stdout=subprocess.PIPE, text=True)
    try:
        with relay("--mtu", "9000") as run:
            assert _read_line(receiver, 10) == "listening\n"
            subprocess.run(in_netns(NS_A, STREAM_SENDER, ADDR_B, PORT, str(blocks)), check=True, timeout=60)
            size, digest, seconds = receiver.communicate(timeout=60)[0].split()
    finally:
        receiver.kill()
        receiver.wait()
    expected = hashlib.sha256(bytes(range(256)) * 4096 * blocks).hexdigest()
    assert int(size) == blocks << 20 and digest == expected
    print(f"{blocks << 20} bytes through the relay in {float(seconds):.2f} s: {blocks / float(seconds):.0f} MiB/s")
    assert blocks / float(seconds) > 5, seconds  # (over 300 MiB/s on an idle 2-core VM)
    assert run.stats["a_to_b"]["bytes"] > blocks << 20  # in frames of up to 9000 bytes (of 1500: 35,000 of them)
    assert run.stats["a_to_b"]["frames"] < (blocks << 20) / 4000, run.stats


def test_a_device_name_too_long_is_refused() -> None:
    command = [sys.executable, "-m", "nixl_kv.harness.netem", "--a", "x" * 16, "--b", TAP_B]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 1 and "ready" not in result.stdout and "15 bytes" in result.stderr, result
