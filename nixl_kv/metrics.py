"""Transfer metrics: counters readable from Python, Prometheus export, and per-rank CSV summaries.

Counters are per side (ctx, gen) of a transceiver, and are exported as ``nixl_kv_*`` Prometheus metrics
labelled by side and instance. ``prometheus_client`` is a dependency of nixl-kv; where it cannot be imported (a
source checkout on PYTHONPATH, as on the GPU machine) the counters stay readable from Python and a warning says
once that nothing is exported. The CSV summary (one file per rank and side,
under ``time_output_path``) gets a row per request whose outcome the sync group agreed on, with its timing
merged across the ranks that took part (earliest start, latest end, bytes summed).
"""

from __future__ import annotations

import csv
import logging
import os
import threading
import weakref
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

COUNTERS = ("bytes", "requests", "failures", "timeouts", "cancellations", "forged_messages")


@dataclass
class SideCounters:
    bytes: int = 0
    requests: int = 0
    failures: int = 0
    timeouts: int = 0
    cancellations: int = 0
    forged_messages: int = 0  # control messages about a live request whose proof was not its secret: dropped
    poisoned_slots: int = 0


class _Prometheus:
    """The process-wide Prometheus collector (registered once; None without prometheus_client). It reads every
    live transceiver's counters when scraped, so counting costs a request only an addition under a lock (the
    library's own counters took 5-10 µs a request through labelled series)."""

    _lock = threading.Lock()
    _collector: Any = None  # False once prometheus_client proved missing
    _tracked: weakref.WeakSet[TransferMetrics] = weakref.WeakSet()

    @classmethod
    def track(cls, metrics: TransferMetrics) -> bool:
        """Export ``metrics`` from now on; False when nothing can be exported."""
        with cls._lock:
            if cls._collector is None:
                try:
                    import prometheus_client as prom
                except ImportError:
                    log.warning(
                        "prometheus_client cannot be imported: nixl_kv_* metrics are not exported "
                        "(it is a dependency of nixl-kv: pip install nixl-kv, or prometheus_client>=0.26.0); "
                        "TransferMetrics.snapshot() still counts"
                    )
                    cls._collector = False
                    return False
                cls._collector = _Collector(cls._tracked)
                prom.REGISTRY.register(cls._collector)
            if cls._collector is False:
                return False
            cls._tracked.add(metrics)
            return True


class _Collector:
    """``nixl_kv_<counter>_total`` and ``nixl_kv_poisoned_slots`` by side and instance (summed over transceivers
    of one instance id in this process)."""

    def __init__(self, tracked: weakref.WeakSet[TransferMetrics]) -> None:
        self._tracked = tracked

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["side", "instance"]
        families = {
            name: CounterMetricFamily(f"nixl_kv_{name}", f"KV transfer {name}", labels=labels) for name in COUNTERS
        }
        poisoned = GaugeMetricFamily("nixl_kv_poisoned_slots", "staging slots held back", labels=labels)
        totals: dict[tuple[str, str], dict[str, int]] = {}
        for metrics in list(self._tracked):
            for side, counters in metrics.snapshot().items():
                total = totals.setdefault((side, metrics.instance_id), dict.fromkeys(counters, 0))
                for name, value in counters.items():
                    total[name] += value
        for (side, instance), total in totals.items():
            for name, family in families.items():
                family.add_metric([side, instance], total[name])
            poisoned.add_metric([side, instance], total["poisoned_slots"])
        yield from families.values()
        yield poisoned


class TransferMetrics:
    """Counters of one transceiver, exported to Prometheus when scraped (the library is imported at start-up,
    never on the request path: the import alone took 52 ms in a first status check)."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self._lock = threading.Lock()
        self._sides = {"ctx": SideCounters(), "gen": SideCounters()}
        self._paths: Counter[str] = Counter()  # gen: per-peer reads by the path the plan chose (``gen.plan.path_of``)
        _Prometheus.track(self)

    def add(self, side: str, **increments: int) -> None:
        with self._lock:
            counters = self._sides[side]
            for name, value in increments.items():
                setattr(counters, name, getattr(counters, name) + value)

    def set_poisoned(self, side: str, count: int) -> None:
        with self._lock:
            self._sides[side].poisoned_slots = count

    def count_path(self, path: str) -> None:
        with self._lock:
            self._paths[path] += 1

    def paths(self) -> dict[str, int]:
        """How many per-peer reads took each path (the gen side; for benchmarks and tests)."""
        with self._lock:
            return dict(self._paths)

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {side: asdict(counters) for side, counters in self._sides.items()}


@dataclass(frozen=True)
class TransferTiming:
    request_id: int
    start_s: float
    end_s: float
    bytes: int


class TransferSummary:
    """``<path>/<instance>_<rank>_<side>_transfer_summary.csv``, opened on first use, flushed per check."""

    HEADER = ("request_id", "start_s", "end_s", "transfer_ms", "bytes", "outcome")

    def __init__(self, path: str, instance_id: str, rank: int, side: str) -> None:
        self.file_path = os.path.join(path, f"{instance_id}_{rank}_{side}_transfer_summary.csv") if path else ""
        self._handle: Any = None

    def write(self, rows: list[tuple[TransferTiming, str]]) -> None:
        if not self.file_path or not rows:
            return
        if self._handle is None:
            os.makedirs(os.path.dirname(self.file_path), exist_ok=True)
            self._handle = open(self.file_path, "w", newline="")  # noqa: SIM115 - kept open across checks
            csv.writer(self._handle).writerow(self.HEADER)
        writer = csv.writer(self._handle)
        for timing, outcome in rows:
            transfer_ms = (timing.end_s - timing.start_s) * 1000
            writer.writerow(
                (
                    timing.request_id,
                    f"{timing.start_s:.6f}",
                    f"{timing.end_s:.6f}",
                    f"{transfer_ms:.3f}",
                    timing.bytes,
                    outcome,
                )
            )
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def merge_timings(per_rank: list[list[TransferTiming]]) -> dict[int, TransferTiming]:
    """Earliest start, latest end and summed bytes per request over the ranks that reported it."""
    merged: dict[int, TransferTiming] = {}
    for timings in per_rank:
        for t in timings:
            seen = merged.get(t.request_id)
            merged[t.request_id] = (
                t
                if seen is None
                else TransferTiming(
                    t.request_id, min(seen.start_s, t.start_s), max(seen.end_s, t.end_s), seen.bytes + t.bytes
                )
            )
    return merged
