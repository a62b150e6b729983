"""The short soak: ctx and gen in two network namespaces over UCX TCP (scripts/soak.sh, 780 requests, ~35 s).

Needs root and iproute2 (CI here runs as root): the script creates and removes its own namespaces."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_namespaces_clean_with_faults_rate_limited_and_a_link_down_longer_than_the_lease() -> None:
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
    limited, down = rows["200 Mbit/s link"], rows["link down 5 s mid-run"]
    for row, requests in ((clean, 60), (faulty, 60), (limited, 60), (down, 600)):
        assert int(row[0]) == requests and row[5] == "0" and row[7] == "no" and row[8] == "none", row  # no wrong
        # element, no hang, nothing left after close
    assert int(clean[1]) == int(limited[1]) == 60 and clean[4] == limited[4] == faulty[4] == "0"
    assert faulty[3] != "-"  # faults were injected, and each request ended as its fault says it must
    assert 500 <= int(down[1]) < 600  # requests in flight while the link was down failed by their deadline
    assert float(limited[-1]) < 0.1 < float(clean[-1])  # the bytes did cross the rate-limited link
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count("nkv-soak") == 0
