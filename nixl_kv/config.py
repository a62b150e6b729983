"""CacheTransceiverConfig: the knobs of the reference's config, in Python style, with NIXL_KV_ overrides."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass

ENV_PREFIX = "NIXL_KV_"
MAX_HOLD_PROMISE_MS = 10_000  # readers take a promise further than 10 s from now for a torn copy (nixl_kv.holds)
DIRECT_MIN_RUN_BYTES = {"DRAM": 8 << 10, "VRAM": 1 << 20}  # measured defaults, see direct_min_run_bytes


@dataclass(frozen=True)
class CacheTransceiverConfig:
    """
    backend: transfer agent name in the registry (NIXL), or DEFAULT: chosen by the environment (the first
        ``NIXL_KV_USE_<NAME>=1`` of a registered agent), else NIXL.
    max_tokens_in_buffer: tokens of this rank's share one staging slot holds (staged transfers).
    num_staging_slots: staging slots per rank (staged transfers in flight at once).
    kv_transfer_timeout_ms: deadline of a transfer from its start, checked by the status checks: observe-only
        (logged, counted) unless ``enable_inflight_cancel``, which cancels a timed-out transfer on every rank of
        its sync group and ends it in error. Independently, no gen transfer outlives the ctx lease.
    kv_transfer_sender_future_timeout_ms: how long a ctx status check waits on one transfer when asked for progress.
    kv_transfer_poll_interval_ms: how long a gen status check waits for progress.
    lease_ms: how long the ctx side keeps a request's blocks pinned for its readers.
    direct_min_run_bytes: gen side; a slice that is not made of whole blocks or chunks is read directly only
        if its contiguous runs are at least this long, else staged (0: direct wherever the layouts allow it; a
        huge value: always staged). None: by pool memory, from measurements. DRAM 8 KiB:
        scripts/bench_direct_vs_staged.sh on the 2-core CPU machine, ctx TP2 -> gen TP4, had staged ahead at
        4 KiB runs (1.22 against 1.02 GB/s) and direct ahead from 8 KiB (1.87 against 0.97 GB/s). VRAM 1 MiB:
        scripts/bench_gpu_threshold.sh on 2 H200s, ctx TP2 -> gen TP4, had staged ahead by 7.6x at 16 KiB runs
        (63.5 against 8.4 GB/s) and 17x at 8 KiB; partial-head runs never exceed 64 KiB for 8 heads of 128.
    enable_inflight_cancel: see ``kv_transfer_timeout_ms`` (needs it set; status checks must then be finite).
    time_output_path: a folder for per-rank CSV transfer summaries (both sides); empty for none.
    progress_poll_us: how long the progress loop sleeps between polls while transfers are pending; 0 spins
        (lowest latency, one core busy per instance rank: for hosts with cores to spare, not a 2-core box).
    agent_progress_thread: start the agent's own progress thread (NIXL's, in C++, spinning): transfers that need
        the target to progress (UCX over TCP, connection set-up) then advance while this process's Python threads
        are busy. Costs a core per rank.
    hold_promise_ms: ctx side; a request's blocks are kept at least this long after its hold is posted, even if
        it ends sooner (cancel, early finish). A gen rank on the same host then checks the hold board while its
        KV READ is in flight, instead of after it: one READ round trip less per request. The price is that much
        longer a hold on the blocks of requests that end early: a ctx request's future ends when its readers are
        done, and its blocks come back to the cache at most this long after it was responded. 0: no promise (every
        gen READ checks after it). At most 10000. The gen side trusts a promise only from a process on its clock:
        the same boot id and time-namespace offsets. VMs restored from one snapshot share a boot id but not the
        clock: set 0 there.
    gil_switch_interval_us: if set, the process's GIL switch interval (``sys.setswitchinterval``) at start-up.
        Posting a NIXL transfer releases the GIL; with a Python thread that computes (a server's model loop),
        taking it back waits up to the interval, 5 ms by default (measured: 5.3 ms per post, while status checks,
        descriptor lists and notification polls mostly keep it). 50-200 us keeps a transfer's few calls from waiting
        milliseconds, at the price of more frequent switches for the busy thread. A process-wide setting: the
        last transceiver created sets it.
    """

    backend: str = "NIXL"
    max_tokens_in_buffer: int = 8192
    num_staging_slots: int = 4
    kv_transfer_timeout_ms: int | None = None
    kv_transfer_sender_future_timeout_ms: int | None = None
    kv_transfer_poll_interval_ms: int | None = None
    lease_ms: int = 60_000
    direct_min_run_bytes: int | None = None
    enable_inflight_cancel: bool = False
    time_output_path: str = ""
    progress_poll_us: int = 50
    agent_progress_thread: bool = False
    gil_switch_interval_us: int | None = None
    hold_promise_ms: int = 20

    def __post_init__(self) -> None:
        positive = ("max_tokens_in_buffer", "num_staging_slots", "lease_ms")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"CacheTransceiverConfig.{name} must be at least 1, got {getattr(self, name)}")
        optional = ("kv_transfer_timeout_ms", "kv_transfer_sender_future_timeout_ms", "kv_transfer_poll_interval_ms")
        for name in optional:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"CacheTransceiverConfig.{name} must be at least 1 ms, got {value}")
        if self.gil_switch_interval_us is not None and self.gil_switch_interval_us < 1:
            raise ValueError("CacheTransceiverConfig.gil_switch_interval_us must be at least 1")
        if not 0 <= self.hold_promise_ms <= MAX_HOLD_PROMISE_MS:
            raise ValueError(f"CacheTransceiverConfig.hold_promise_ms must be within 0..{MAX_HOLD_PROMISE_MS}")
        if self.progress_poll_us < 0:
            raise ValueError("CacheTransceiverConfig.progress_poll_us must not be negative")
        if self.direct_min_run_bytes is not None and self.direct_min_run_bytes < 0:
            raise ValueError("CacheTransceiverConfig.direct_min_run_bytes must not be negative")
        if self.enable_inflight_cancel and self.kv_transfer_timeout_ms is None:
            raise ValueError("enable_inflight_cancel needs kv_transfer_timeout_ms: a finite deadline to act on")

    @classmethod
    def from_env(cls, base: CacheTransceiverConfig | None = None, environ: Mapping[str, str] | None = None):
        """``base`` (or the defaults) with every field overridden by ``NIXL_KV_<FIELD>`` where set."""
        environ = os.environ if environ is None else environ
        base = base or cls()
        hints = typing.get_type_hints(cls)
        changes = {}
        for spec in dataclasses.fields(cls):
            name = ENV_PREFIX + spec.name.upper()
            if name in environ:
                changes[spec.name] = _parse(name, environ[name], hints[spec.name])
        return dataclasses.replace(base, **changes)


def _parse(name: str, text: str, hint: object) -> object:
    value = text.strip()
    if hint is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{name}: expected 1/0/true/false, got {text!r}")
    if hint is str:
        return value
    if value.lower() in ("", "none") and type(None) in typing.get_args(hint):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {text!r}") from None
