"""The short soak: ctx and gen in two network namespaces over UCX TCP (scripts/soak.sh, 720 requests, ~30 s).

Needs root and iproute2 (CI here runs as root): the script creates and removes its own namespaces."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_namespaces_clean_rate_limited_and_a_link_down_longer_than_the_lease() -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "soak.sh"), "15"], capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in result.stdout.splitlines() if "| " in line}
    clean, limited, down = rows["clean link"], rows["200 Mbit/s link"], rows["link down 5 s mid-run"]
    for row, requests in ((clean, 60), (limited, 60), (down, 600)):
        cells = [cell.strip() for cell in row]
        assert int(cells[0]) == requests and cells[3] == "0" and cells[5] == "no" and cells[6] == "none", row
    assert int(clean[1]) == int(limited[1]) == 60  # every request verified
    assert int(down[1]) >= 500  # those in flight while the link was down failed by their deadline, the rest arrived
    assert float(limited[-1]) < 0.1 < float(clean[-1])  # the bytes did cross the rate-limited link
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count("nkv-soak") == 0
