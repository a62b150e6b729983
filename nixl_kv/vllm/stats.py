"""nixl_kv's transfer figures in vLLM's connector stats (logged by the engine) and Prometheus metrics.

The gen worker records each finished pull: its own transfer time (the transceiver's start to end) and bytes.
vLLM moves a worker's ``KVConnectorStats`` to the logger process, aggregates them and hands ``reduce()`` to its
log line and ``data`` to ``build_prom_metrics``'s ``observe``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# transfer time buckets (seconds): from a 100 µs loopback READ to a multi-second pull
TIME_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class TransferStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=lambda: {"transfer_s": [], "bytes": [], "failed": 0})

    def record(self, seconds: float, nbytes: int) -> None:
        self.data["transfer_s"].append(seconds)
        self.data["bytes"].append(nbytes)

    def record_failure(self) -> None:
        self.data["failed"] += 1

    def take(self) -> TransferStats | None:
        """The figures since the last take (None if there are none), and start afresh."""
        if self.is_empty():
            return None
        taken = TransferStats(self.data)
        self.reset()
        return taken

    def reset(self) -> None:
        self.data = {"transfer_s": [], "bytes": [], "failed": 0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            self.data["transfer_s"] += other.data["transfer_s"]
            self.data["bytes"] += other.data["bytes"]
            self.data["failed"] += other.data["failed"]
        return self

    def reduce(self) -> dict[str, int | float]:
        times = sorted(self.data["transfer_s"])
        count = len(times)
        total = sum(self.data["bytes"])
        return {
            "Num successful transfers": count,
            "Num failed transfers": self.data["failed"],
            "Avg transfer time (ms)": round(1e3 * sum(times) / count, 3) if count else 0.0,
            "P50 transfer time (ms)": round(1e3 * times[count // 2], 3) if count else 0.0,
            "Total MB transferred": round(total / 1e6, 3),
            "Avg GB/s": round(total / sum(times) / 1e9, 3) if count and sum(times) else 0.0,
        }

    def is_empty(self) -> bool:
        return not self.data["transfer_s"] and not self.data["failed"]


class TransferPromMetrics(KVConnectorPromMetrics):
    """``vllm:nixl_kv_transfer_seconds`` (histogram), ``vllm:nixl_kv_transfer_bytes`` and
    ``vllm:nixl_kv_failed_transfers`` (counters), per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine: dict) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        seconds = self._histogram_cls(
            name="vllm:nixl_kv_transfer_seconds",
            documentation="nixl_kv: one request's KV transfer, start to end, at the gen worker.",
            buckets=list(TIME_BUCKETS),
            labelnames=labelnames,
        )
        nbytes = self._counter_cls(
            name="vllm:nixl_kv_transfer_bytes", documentation="nixl_kv: KV bytes pulled.", labelnames=labelnames
        )
        failed = self._counter_cls(
            name="vllm:nixl_kv_failed_transfers",
            documentation="nixl_kv: transfers that failed (vLLM recomputed them).",
            labelnames=labelnames,
        )
        self._seconds = {i: seconds.labels(*values) for i, values in per_engine.items()}
        self._bytes = {i: nbytes.labels(*values) for i, values in per_engine.items()}
        self._failed = {i: failed.labels(*values) for i, values in per_engine.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for seconds in transfer_stats_data.get("transfer_s", ()):
            self._seconds[engine_idx].observe(seconds)
        self._bytes[engine_idx].inc(sum(transfer_stats_data.get("bytes", ())))
        if transfer_stats_data.get("failed"):
            self._failed[engine_idx].inc(transfer_stats_data["failed"])
