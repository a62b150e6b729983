"""The short soak: ctx and gen in two network namespaces over UCX TCP (scripts/soak.sh, 15 rounds a phase, ~1,000
requests, about 3 minutes).

Needs root and iproute2 (CI here runs as root): the script creates and removes its own namespaces, and the TAP
devices of its userspace netem relay (nixl_kv.harness.netem, on /dev/net/tun) for the delayed, reordered phase."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_namespaces_with_faults_a_mixed_pairing_deadlines_a_stopped_and_a_killed_ctx_and_the_link_down() -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "soak.sh"), "15"], capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
        for line in result.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| phase")
    }
    clean, faulty = rows["clean link"], rows["clean link, faults in 10% of requests"]
    mixed, limited = rows["ctx tp=2 -> gen pp=2, faults in 10%"], rows["200 Mbit/s link, faults in 10%"]
    stopped, killed = rows["ctx stopped past the lease, then resumed"], rows["ctx killed mid-run"]
    down, deadline = rows["link down 5 s mid-run, faults in 10%"], rows["200 Mbit/s link, 200 ms deadline"]
    for row, requests in (
        (clean, 60),
        (faulty, 60),
        (mixed, 60),
        (limited, 60),
        (stopped, 60),
        (killed, 32),
        (down, 600),
        (deadline, 60),
    ):
        assert int(row[0]) == requests and row[5] == "0" and row[7] == "no" and row[8] == "none", row  # no wrong
        # element, no hang, nothing left after close
    for row in (clean, faulty, mixed, limited, stopped, killed):
        assert row[4] == "0", row  # every request ended as its fault (or none) says it must
    assert int(clean[1]) == 60 and faulty[3] != "-" and mixed[3] != "-"  # faults were injected in those phases
    assert stopped[3] == "4 ctx-stop" and int(stopped[1]) == 56  # the stopped round's requests failed: stopped past the
    assert 2.9 <= float(stopped[6].split()[0]) <= 3.05  # lease and ended by their deadline (a READ in flight is given
    # up 1% of the budget, at most 20 ms, ahead of it), not long before it; the rounds after it verified
    assert killed[3] == "4 ctx-kill" and int(killed[1]) == 28  # the requests of the round it died in failed
    assert 500 <= int(down[1]) < 600  # requests in flight while the link was down failed by their deadline
    assert int(deadline[2]) > 0 and float(deadline[6].split()[0]) <= 0.7  # requests that missed it ended by then
    assert float(limited[-1]) < 0.1 < float(clean[-1])  # the bytes did cross the rate-limited link
    if shutil.which("nft"):  # random TCP loss both ways (nftables): transfers may fail by their deadline, never wrong
        lossy = rows["2% of TCP segments lost, faults in 10%"]
        assert int(lossy[0]) == 60 and lossy[5] == "0" and lossy[7] == "no" and lossy[8] == "none", lossy
    if Path("/dev/net/tun").exists():  # frames delayed 5 +- 4 ms (so reordered) and 0.5% dropped by the userspace
        # netem relay: transfers may fail by their deadline, never with wrong bytes, a hang or a leak
        jittery = rows["5+-4 ms delay, reordered, 0.5% lost, faults in 10%"]
        assert int(jittery[0]) == 60 and jittery[5] == "0" and jittery[7] == "no" and jittery[8] == "none", jittery
        relay = re.search(
            r"netem relay in the 5\+-4 ms delay.* phase: (\d+) frames relayed, (\d+) reordered, (\d+) dropped, "
            r"\d+ undeliverable; exit status 0\)",
            result.stdout,
        )
        assert relay and int(relay[1]) > 1000 and int(relay[2]) > 0 and int(relay[3]) > 0, result.stdout[-1000:]
    totals = re.search(
        r"totals: (\d+) requests, (\d+) with an injected fault .*, 0 wrong elements, 0 hangs", result.stdout
    )
    assert totals and int(totals[2]) >= 0.05 * int(totals[1]), result.stdout[-500:]  # at least 5% faulted
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count("nkv-soak") == 0
