"""CacheTransceiverConfig: the knobs of the reference's config, in Python style."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheTransceiverConfig:
    """
    backend: transfer agent name in the registry (NIXL).
    max_tokens_in_buffer: tokens of this rank's share one staging slot holds (staged transfers).
    num_staging_slots: staging slots per rank (staged transfers in flight at once).
    kv_transfer_timeout_ms: deadline of a transfer from its start; None means the lease bounds it.
    kv_transfer_sender_future_timeout_ms: how long a ctx status check waits on one transfer when asked for progress.
    kv_transfer_poll_interval_ms: how long a gen status check waits for progress.
    lease_ms: how long the ctx side keeps a request's blocks pinned for its readers.
    direct_min_run_bytes: gen side; a direct READ whose contiguous runs are shorter is staged instead
        (0: direct wherever the layouts allow it; a huge value: always staged). 8 KiB by measurement:
        scripts/bench_direct_vs_staged.sh on the 2-core CPU machine, ctx TP2 -> gen TP4, had staged ahead at
        4 KiB runs (1.22 against 1.02 GB/s) and direct ahead from 8 KiB (1.87 against 0.97 GB/s).
    """

    backend: str = "NIXL"
    max_tokens_in_buffer: int = 8192
    num_staging_slots: int = 4
    kv_transfer_timeout_ms: int | None = None
    kv_transfer_sender_future_timeout_ms: int | None = None
    kv_transfer_poll_interval_ms: int | None = None
    lease_ms: int = 60_000
    direct_min_run_bytes: int = 8192
