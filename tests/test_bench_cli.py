"""``nixl-kv bench --device cpu`` end to end with tiny settings: every section present, every run verified."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _runs(value: Any) -> Iterator[dict]:
    """Every pair run's summary in the bench JSON (each sits under a ``pair`` key)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "pair":
                yield item
            else:
                yield from _runs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _runs(item)


def test_cpu_bench_runs_every_section_and_verifies_every_run(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    command = [
        sys.executable, "-m", "nixl_kv.cli", "bench", "--device", "cpu", "--sizes", "16", "--rounds", "2",
        "--concurrent", "3", "--latency-rounds", "3", "--placement", "split", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["shape"] == "small" and data["placement"] == "default"
    assert "ignored on the CPU" in result.stderr

    (row,) = data["sweep"]
    assert row["tokens"] == 16 and row["request_bytes"] == 32 * 2 * 2 * 2 * 64 * 2  # one whole block
    for figure in (row["idle"], row["busy"]):
        assert figure["gbps_min"] <= figure["gbps"] <= figure["gbps_max"] and figure["ratio_to_raw"] > 0
    assert row["busy_over_idle_gbps"] > 0 and row["memcpy_peer_gbps"] is None
    assert set(data["mismatched"]) == {"block_major_to_nhd", "tp2_to_tp4", "70b_tp8_to_tp4"}
    assert data["mismatched"]["70b_tp8_to_tp4"]["layers"] == 5
    burst = data["concurrent_128_tokens"]
    assert burst["requests"] == 3 and burst["requests_per_s"] > 0 and burst["latency_p50_us"] > 0
    latency = data["latency_128_tokens"]
    assert latency["rounds"] == 3 and latency["busy_over_idle_p50"] > 0
    for run in (latency["idle"], latency["busy"]):
        assert run["min_us"] <= run["p50_us"] <= run["p99_us"] <= run["max_us"]
    assert data["first_contact"]["first_request_ms"] > 0

    # sweep idle + busy, three mismatched, the burst, latency idle + busy: every element of every request verified
    runs = list(_runs(data))
    assert [run["verified"] for run in runs] == [2, 2, 2, 2, 2, 6, 3, 3]
    assert all(run["ok"] and run["requests"] == run["verified"] and not run["mismatched_elements"] for run in runs)

    assert "busy/idle" in result.stderr and "one 128-token request at a time (3 rounds)" in result.stderr
    headline = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(headline) == {"concurrent_128_tokens", "latency_128_tokens", "first_contact"}
    assert not list(_runs(headline))  # the file has every run's summary; stdout only the figures
