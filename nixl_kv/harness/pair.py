"""``nixl-kv pair``: a ctx and a gen instance as separate processes, end to end, every element verified.

This process is the router: it asks the ctx instance to prefill (fill from DESIGN §7) and respond, forwards
each ContextPhaseParams to the gen instance, and collects what the gen instance verified. Every wait on a
worker has a deadline; a worker that dies or stalls ends the run with an error, never a hang.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import IO, Any

from nixl_kv.comm import mpiexec_path
from nixl_kv.dtypes import DataType
from nixl_kv.errors import NotSupportedError
from nixl_kv.harness import faults
from nixl_kv.harness.pair_worker import (
    CHANNEL_ENV,
    MPI_JOB_ENVIRONMENT,
    SHARED_WORLD_BACKENDS,
    InstanceSpec,
    RnnSpec,
    spec_json,
)
from nixl_kv.rnn import check_split
from nixl_kv.state import ConvSectionLayout
from nixl_kv.topology import head_duplication

WORKER_START_S = 60.0
RAW_READ_REPEATS = 5
RAW_REQUEST_READ_REPEATS = 101  # one request's bytes are few: many READs of them, for a p50 to set beside the requests'
STOPPED_PAST_LEASE_S = 1.0  # --ctx-fault stop: how much longer than the lease the ctx instance stays stopped
CTX_FAULTS = ("stop", "kill")


PLACEMENTS = ("default", "split")  # GPUs: ranks in order, ctx first; or every ctx rank on GPU 0, every gen rank on 1
LAYOUTS = {"block_major": "block_major", "nhd": "per_layer_nhd", "hnd": "per_layer_hnd", "hknd": "per_layer_hknd"}


CTX_HEADROOM_BYTES = 1 << 30


@dataclass(frozen=True)
class ParallelSpec:
    """One instance's SPEC: ``tp=,pp=,cp=,dp=`` (dp 0/1: attention DP), ``layers=3:3:2:2`` (uneven PP split),
    ``layout=block_major|nhd|hnd|hknd`` (its pool layout) and ``tokens_per_block=`` (its block size, where it
    differs from ``--tokens-per-block``; one instance's must be a whole multiple of the other's)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 0
    layers: tuple[int, ...] = ()
    layout: str = "block_major"
    tokens_per_block: int = 0  # 0: the model's (--tokens-per-block)

    @classmethod
    def parse(cls, text: str) -> ParallelSpec:
        """Unknown keys and bad values are errors."""
        values: dict[str, Any] = {}
        for key, value in _items(text, cls.__dataclass_fields__, "SPEC"):
            if key == "layout":
                if value not in LAYOUTS:
                    raise ValueError(f"bad layout {value!r}: one of {', '.join(LAYOUTS)}")
                values[key] = LAYOUTS[value]
            elif key == "layers":
                values[key] = tuple(int(part) for part in value.split(":"))
            else:
                values[key] = int(value)
        spec = cls(**values)
        if min(spec.tp, spec.pp, spec.cp, values.get("tokens_per_block", 1)) < 1 or spec.dp not in (0, 1):
            raise ValueError(f"bad SPEC {text!r}: tp, pp, cp must be >= 1, dp 0 or 1 and tokens_per_block >= 1")
        if spec.layers and (len(spec.layers) != spec.pp or min(spec.layers) < 1):
            raise ValueError(f"bad SPEC {text!r}: layers needs pp={spec.pp} positive counts")
        return spec

    def instance(self, model: InstanceSpec, num_blocks: int) -> InstanceSpec:
        if self.layers and sum(self.layers) != model.layers:
            raise ValueError(f"SPEC layers {':'.join(map(str, self.layers))} do not sum to {model.layers} layers")
        if model.layers < self.pp:
            raise ValueError(f"{model.layers} layers cannot be split over pp={self.pp}")
        spec = replace(
            model,
            num_blocks=num_blocks,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            dp=self.dp,
            layer_split=self.layers,
            layout=self.layout,
            tokens_per_block=self.tokens_of(model),
        )
        head_duplication(spec.parallel(0), model.kv_heads)  # NotSupportedError when heads do not split over TP
        if model.rnn is not None:
            if model.rnn.layers < self.pp:
                raise ValueError(f"{model.rnn.layers} Mamba layers cannot be split over pp={self.pp}")
            check_split(model.rnn.config(self.pp), spec.parallel(0))
            if self.layers:
                raise ValueError("layers= (an uneven attention split) is not supported with --rnn")
        return spec

    def tokens_of(self, model: InstanceSpec) -> int:
        """This instance's tokens per block."""
        return self.tokens_per_block or model.tokens_per_block

    def blocks_for(self, model: InstanceSpec, requests: Iterable[int]) -> int:
        """The blocks one round of ``requests`` takes here."""
        tokens = self.tokens_of(model)
        return sum(-(-n // tokens) for n in requests)


def parse_rnn(text: str) -> RnnSpec:
    """``layers=2,heads=4,head_dim=64,d_state=16,d_conv=4,n_groups=1,layout=xbc,conv_dtype=float32,...``;
    keys not given keep RnnSpec's defaults. Unknown keys and bad values are errors."""
    values: dict[str, Any] = {}
    for key, value in _items(text, RnnSpec.__dataclass_fields__, "--rnn"):
        if key == "layout":
            ConvSectionLayout(value)  # ValueError names the bad value
        elif key.endswith("dtype"):
            DataType(value)
        else:
            least = 2 if key == "d_conv" else 1
            if not value.isdigit() or int(value) < least:
                raise ValueError(f"bad --rnn item {key}={value}: expected an integer of at least {least}")
        values[key] = value if key == "layout" or key.endswith("dtype") else int(value)
    return RnnSpec(**values)


def _items(text: str, keys: Iterable[str], what: str) -> Iterator[tuple[str, str]]:
    """The ``key=value`` items of a comma-separated option; an unknown key or an item without ``=`` is an error."""
    keys = list(keys)
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in keys:
            raise ValueError(f"bad {what} item {item!r}: expected key=value with keys {', '.join(keys)}")
        yield key, value


@dataclass(frozen=True)
class PairOptions:
    ctx: ParallelSpec
    gen: ParallelSpec
    model: InstanceSpec
    requests: tuple[int, ...]
    rounds: int
    step_timeout_s: float = 300.0
    placement: str = "default"  # one of PLACEMENTS; only GPUs are placed
    connect_ahead: bool = False  # the gen instance meets the ctx instance before the first request
    raw_read: bool = True  # measure the raw READ baselines after the rounds (the soak skips them: it gives no ratio)
    faults: float = 0.0  # this fraction of requests gets one of harness.faults.FAULTS
    ctx_fault: str = ""  # "stop" or "kill": every ctx process, in the middle round (harness.faults.CTX_FAULTS)
    ctx_netns: str = ""  # run the ctx instance inside this network namespace (``ip netns exec``; root)
    gen_netns: str = ""


@dataclass
class RequestResult:
    round: int
    request_id: int
    tokens: int
    bytes: int
    seconds: float
    verified: bool
    mismatched: int
    error: str | None
    fault: str = ""  # the fault injected into it (harness.faults), "" for none
    latency_s: float | None = None  # gen side: from before request_and_receive_async to the check reporting it done


@dataclass
class PairReport:
    results: list[RequestResult] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
    round_bytes: list[int] = field(default_factory=list)
    raw_seconds: list[float] = field(default_factory=list)
    per_block_seconds: list[float] = field(default_factory=list)
    raw_bytes: int = 0
    raw_request_seconds: list[float] = field(default_factory=list)  # one descriptor of one request's bytes
    raw_request_bytes: int = 0
    cpu_s: dict[str, list[float]] = field(default_factory=lambda: {"ctx": [], "gen": []})  # per round, all ranks
    loop_passes: dict[str, list[int]] = field(default_factory=lambda: {"ctx": [], "gen": []})  # likewise
    ctx_errors: dict[str, str] = field(default_factory=dict)
    leaks: dict[str, dict[str, int]] = field(default_factory=dict)  # per instance: what its agent held after close
    rss_growth_kb: dict[str, int] = field(default_factory=dict)  # per instance: resident memory, ready to close
    forged_messages: dict[str, int] = field(default_factory=dict)  # per instance: control messages it dropped
    paths: dict[str, int] = field(default_factory=dict)  # gen per-peer reads by the path chosen (``gen.plan.path_of``)
    backend: str = "NIXL"  # the transfer agent of the run and of its raw READ

    @property
    def verified(self) -> int:
        return sum(r.verified for r in self.results)

    @property
    def unexpected(self) -> list[RequestResult]:
        """Requests that did not end as they must: every request without a fault verifies, each fault has its
        rule (harness.faults.as_expected), and no completed request holds a wrong element."""
        return [r for r in self.results if r.mismatched or not faults.as_expected(r.fault, r.verified, r.error)]

    @property
    def ok(self) -> bool:
        faulted = {str(r.request_id) for r in self.results if r.fault}
        ctx_errors = set(self.ctx_errors) - faulted  # a faulted request may end in error on the ctx side too
        return bool(self.results) and not self.unexpected and not ctx_errors and not self.leaked

    @property
    def leaked(self) -> bool:
        return any(self.leaks.values())

    def steady_results(self) -> list[RequestResult]:
        """The requests of every round but the first (which pays first contact), or of the only one, that reported
        complete (they have a latency)."""
        first_only = all(r.round == 0 for r in self.results)
        return [r for r in self.results if r.latency_s is not None and (first_only or r.round > 0)]

    def steady_latencies_s(self) -> list[float]:
        """Latencies of the requests of every round but the first (which pays first contact), or of the only one."""
        return [r.latency_s for r in self.steady_results() if r.latency_s is not None]

    def cpu_us_per_request(self, role: str) -> float | None:
        """The side's CPU microseconds (every process and thread of it) over the rounds after the first, per request:
        the gen's over each pull, the ctx's from responding until every reader was counted."""
        rounds = steady_rounds(self.cpu_s[role])
        count = len(self.steady_results())
        return 1e6 * sum(rounds) / count if rounds and count else None

    def loop_passes_per_request(self, role: str) -> float | None:
        """The side's progress-loop passes (every rank) over the same span, per request: the loop's share of that
        CPU, as a count that a loaded machine does not blur."""
        rounds = steady_rounds(self.loop_passes[role])
        count = len(self.steady_results())
        return sum(rounds) / count if rounds and count else None

    def request_bytes(self) -> int | None:
        """The bytes every steady request moved, None where they differ (or none has a latency): a raw READ of one
        request's bytes is like for like only when there is one such size."""
        sizes = {r.bytes for r in self.steady_results()}
        return sizes.pop() if len(sizes) == 1 else None

    def summary(self) -> dict[str, Any]:
        total_bytes, seconds = sum(self.round_bytes), sum(self.round_seconds)
        latencies = self.steady_latencies_s()
        ours = [b / s / 1e9 for b, s in zip(self.round_bytes, self.round_seconds, strict=True) if s > 0]
        steady = steady_rounds(ours)
        raw = [self.raw_bytes / s / 1e9 for s in self.raw_seconds if s > 0]
        per_block = [self.raw_bytes / s / 1e9 for s in self.per_block_seconds if s > 0]
        raw_median = statistics.median(raw) if raw else None
        p50 = 1e6 * percentile(latencies, 0.5) if latencies else None
        raw_request_us = [1e6 * s for s in self.raw_request_seconds]
        like_for_like = bool(raw_request_us) and self.raw_request_bytes == self.request_bytes()
        raw_request_p50 = percentile(raw_request_us, 0.5) if like_for_like else None
        return {
            "requests": len(self.results),
            "verified": self.verified,
            "failed": len(self.results) - self.verified,
            "mismatched_elements": sum(r.mismatched for r in self.results),
            "bytes": total_bytes,
            "seconds": seconds,
            "seconds_per_round": list(self.round_seconds),
            "gbps": statistics.median(steady) if steady else None,
            "gbps_per_round": ours,
            "raw_read_gbps": raw_median,
            "raw_read_gbps_all": raw,
            "per_block_read_gbps": statistics.median(per_block) if per_block else None,
            "ratio_to_raw": statistics.median(steady) / raw_median if steady and raw_median else None,
            "latency_p50_us": p50,
            "latency_p99_us": 1e6 * percentile(latencies, 0.99) if latencies else None,
            "latency_us_all": [1e6 * s for s in latencies],
            # the request's cost beyond its READ: p50 latency minus the p50 of a raw one-descriptor READ of the same
            # bytes in the same run; None where the steady requests differ in size (no like-for-like READ)
            "raw_request_bytes": self.raw_request_bytes,
            "raw_request_read_us_all": raw_request_us,
            "raw_request_read_p50_us": raw_request_p50,
            "extra_over_raw_us": p50 - raw_request_p50 if p50 is not None and raw_request_p50 is not None else None,
            "first_round_ms": 1e3 * self.round_seconds[0] if self.round_seconds else None,
            "gen_cpu_us_per_request": self.cpu_us_per_request("gen"),
            "ctx_cpu_us_per_request": self.cpu_us_per_request("ctx"),
            "gen_loop_passes_per_request": self.loop_passes_per_request("gen"),
            "ctx_loop_passes_per_request": self.loop_passes_per_request("ctx"),
            "ctx_errors": self.ctx_errors,
            "slowest_failure_s": max((r.seconds for r in self.results if not r.verified), default=None),
            "faults": {
                fault: sum(r.fault == fault for r in self.results) for fault in (*faults.FAULTS, *faults.CTX_FAULTS)
            },
            "unexpected": len(self.unexpected),
            "forged_messages": self.forged_messages,
            "paths": self.paths,
            "leaks": self.leaks,
            "rss_growth_kb": self.rss_growth_kb,
            "ok": self.ok,
            "backend": self.backend,
        }


def steady_rounds(values: list[float]) -> list[float]:
    """The figures of the rounds after the first (which pays first contact), or of the only one."""
    return values[1:] or values


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest rank: the smallest value that at least ``fraction`` of the values do not exceed (one of them)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


class Worker:
    """A ctx or gen instance: replies are read by a thread so every wait can have a deadline.

    Its rank 0 takes commands on the process's stdin and answers on its stdout, or, where both instances run as one
    MPI job (``fifos``, see ``launch``), on the two named pipes of its role in that folder: a job's stdin reaches one
    rank only, and all its ranks share one stdout."""

    def __init__(self, role: str, process: subprocess.Popen[str], fifos: str = "") -> None:
        self.role = role
        self.ready_rss_kb = 0
        self.process = process
        self._fifos = fifos
        self._commands: IO[str] | None = None if fifos else process.stdin
        self._quit = False
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        """Until the instance closes its replies (or exits). A named pipe opens once the instance opened its end."""
        stream = open(self._fifo("replies")) if self._fifos else self.process.stdout  # noqa: SIM115 - closed below
        assert stream is not None
        with stream:
            for line in stream:
                if line.startswith("{"):
                    self.replies.put(json.loads(line))
        self.replies.put(None)

    def _fifo(self, what: str) -> str:
        return os.path.join(self._fifos, f"{self.role}.{what}")

    def send(self, **command: Any) -> None:
        if self._commands is None:
            self._commands = _open_fifo_for_writing(self._fifo("commands"), WORKER_START_S)
        self._commands.write(json.dumps(command) + "\n")
        self._commands.flush()

    def expect(self, op: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:  # in slices: an instance of a job that died before it opened its replies sends no end
            try:
                reply = self.replies.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                if self.process.poll() is not None and self.replies.empty():
                    reply = None
                    break
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"{self.role} instance gave no {op!r} within {timeout_s:.0f} s") from None
        if reply is None:
            raise RuntimeError(f"{self.role} instance exited (code {self.process.poll()}) while we waited for {op!r}")
        if reply.get("op") != op:
            raise RuntimeError(f"{self.role} instance answered {reply.get('op')!r}, expected {op!r}")
        return reply

    def signal(self, number: int) -> None:
        """Send ``number`` to every process of the instance (mpiexec and its ranks, or the one worker)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, number)

    def quit(self) -> None:
        """Ask the instance to quit (at most once); ``stop`` collects its goodbye. Every instance of a run is asked
        before any is waited for: the two instances of one MPI job end together."""
        if not self._quit:
            self._quit = True
            with contextlib.suppress(OSError, RuntimeError):
                self.send(op="quit")

    def stop(self) -> dict[str, Any]:
        """Quit; returns the instance's goodbye (its leaks and resident memory), empty if it had to be killed."""
        try:
            self.quit()
            bye = self.expect("bye", 30)
            self.process.wait(timeout=30)
            return bye
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
            return {}
        finally:
            if self._fifos:  # open ends stay usable; the folder goes
                shutil.rmtree(self._fifos, ignore_errors=True)


def _open_fifo_for_writing(path: str, timeout_s: float) -> IO[str]:
    """Open a named pipe for writing once its reader has (never blocking without a deadline); then a write to a pipe
    whose reader exited fails (EPIPE), as on a process's stdin."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:  # ENXIO: no reader yet
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise RuntimeError(f"cannot open {path} for writing: {exc}") from exc
            time.sleep(0.01)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "w")


def _worker_command(role: str, spec: InstanceSpec) -> list[str]:
    """One instance's ranks: ``-n <ranks> python -m nixl_kv.harness.pair_worker <role> <spec>``."""
    return ["-n", str(spec.world_size), sys.executable, "-m", "nixl_kv.harness.pair_worker", role, spec_json(spec)]


def launch(ctx_spec: InstanceSpec, gen_spec: InstanceSpec, ctx_netns: str = "", gen_netns: str = "") -> list[Worker]:
    """The ctx and the gen instance. Each is a process of its own (an mpiexec job when it has several ranks), or,
    when their transfer agents must share one MPI world (``SHARED_WORLD_BACKENDS``: MPI), both are the two
    applications of one MPMD mpiexec job, each talking through named pipes in a temporary folder.
    Each process gets its own process group: a fault signals every process of the instance."""
    if ctx_spec.backend not in SHARED_WORLD_BACKENDS:
        workers = []
        for role, spec, netns in (("ctx", ctx_spec, ctx_netns), ("gen", gen_spec, gen_netns)):
            command = _worker_command(role, spec)
            command = [mpiexec_path(), *command] if spec.world_size > 1 else command[2:]
            command = ["ip", "netns", "exec", netns, *command] if netns else command
            pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
            workers.append(Worker(role, subprocess.Popen(command, text=True, start_new_session=True, **pipes)))
        return workers
    if ctx_netns or gen_netns:
        raise NotSupportedError(f"{ctx_spec.backend}: both instances run in one MPI job, not in network namespaces")
    fifos = tempfile.mkdtemp(prefix="nixl-kv-pair-")
    for role in ("ctx", "gen"):
        for what in ("commands", "replies"):
            os.mkfifo(os.path.join(fifos, f"{role}.{what}"))
    command = [mpiexec_path(), *_worker_command("ctx", ctx_spec), ":", *_worker_command("gen", gen_spec)]
    environment = {**MPI_JOB_ENVIRONMENT, **os.environ, CHANNEL_ENV: fifos}
    job = subprocess.Popen(command, text=True, stdout=sys.stderr, env=environment, start_new_session=True)
    return [Worker("ctx", job, fifos), Worker("gen", job, fifos)]


def _rounds_held(round_bytes: int) -> int:
    """Rounds of ctx blocks the pools hold: a round's blocks come back only when their hold promise runs out
    (``hold_promise_ms``), and a round that waited for them would start idle (this VM then ran a request 2x
    slower). Up to 64 rounds within CTX_HEADROOM_BYTES."""
    return max(1, min(64, CTX_HEADROOM_BYTES // max(1, round_bytes)))


def run_pair(options: PairOptions, progress: Any = None) -> PairReport:
    """Run the pair; ``progress(text)`` is called as work advances."""
    say = progress or (lambda _text: None)
    if options.model.attention == "mla" and options.ctx.cp > 1:
        raise NotSupportedError(f"MLA needs ctx CP 1 (got cp={options.ctx.cp}); gen CP is supported")
    if options.model.indexer_dim and options.model.attention != "mla":
        raise NotSupportedError("the indexer-K cache (--indexer-dim) belongs to MLA models (--attention mla)")
    model = replace(options.model, num_slots=len(options.requests))
    ctx_blocks = options.ctx.blocks_for(model, options.requests)
    held = _rounds_held(ctx_blocks * options.ctx.tokens_of(model) * options.model.kv_bytes_per_token)
    ctx_model = replace(model, num_slots=model.num_slots * held)
    ctx_spec = replace(options.ctx.instance(ctx_model, ctx_blocks * held), timeout_ms=None)  # a gen-side deadline
    gen_spec = options.gen.instance(model, options.gen.blocks_for(model, options.requests))
    gen_spec = replace(gen_spec, gpu_base=ctx_spec.world_size)
    if options.placement == "split":  # mismatched TP on two GPUs: the link between ctx and gen, not within
        ctx_spec, gen_spec = replace(ctx_spec, one_gpu=True), replace(gen_spec, gpu_base=1, one_gpu=True)
    elif options.placement != "default":
        raise ValueError(f"bad placement {options.placement!r}: one of {', '.join(PLACEMENTS)}")
    report = PairReport(backend=options.model.backend)
    if options.ctx_fault and ctx_spec.backend in SHARED_WORLD_BACKENDS:
        raise NotSupportedError(
            f"--ctx-fault with {ctx_spec.backend}: both instances are one MPI job, which mpiexec ends when a rank dies"
        )
    ctx, gen = launch(ctx_spec, gen_spec, options.ctx_netns, options.gen_netns)
    try:
        ctx_ready = ctx.expect("ready", WORKER_START_S)
        gen_ready = gen.expect("ready", WORKER_START_S)
        gen_ranks = gen_ready["ranks"]
        ctx.ready_rss_kb, gen.ready_rss_kb = ctx_ready.get("rss_kb", 0), gen_ready.get("rss_kb", 0)
        say(f"ctx instance ({ctx_ready['ranks']} ranks) and gen instance ({gen_ranks} ranks) are up")
        if options.connect_ahead:
            gen.send(op="connect", state=ctx_ready["state"])
            gen.expect("connected", options.step_timeout_s)
            say("the gen instance met the ctx instance ahead of the first request")
        for round_index in range(options.rounds):
            _run_round(options, round_index, ctx, gen, report, say)
            if options.ctx_fault == "kill" and round_index == options.rounds // 2:
                say("the ctx instance was killed: no more rounds, no raw READ")
                return report
        if not options.raw_read:
            return report
        say(f"measuring a raw {report.backend} READ of the same bytes")
        block_bytes = options.model.kv_bytes_per_token * ctx_spec.tokens_per_block
        request_bytes = report.request_bytes() or 0
        _measure_raw(ctx, gen, max(report.round_bytes), block_bytes, report, options.step_timeout_s, request_bytes)
    finally:
        for worker in (ctx, gen):
            worker.quit()
        for worker in (ctx, gen):
            bye = worker.stop()
            report.leaks[worker.role] = {name: count for name, count in bye.get("live", {}).items() if count}
            if bye and worker.ready_rss_kb:
                report.rss_growth_kb[worker.role] = bye.get("rss_kb", 0) - worker.ready_rss_kb
            report.forged_messages[worker.role] = bye.get("forged_messages", 0)
            report.paths.update(bye.get("paths", {}))
    return report


def _run_round(options: PairOptions, round_index: int, ctx: Worker, gen: Worker, report: PairReport, say: Any) -> None:
    count = len(options.requests)
    ids = [round_index * count + i for i in range(count)]
    say(f"round {round_index + 1}/{options.rounds}: ctx prefills {count} requests")
    ctx.send(op="send", requests=[[rid, n] for rid, n in zip(ids, options.requests, strict=True)])
    items = []
    for rid, tokens in zip(ids, options.requests, strict=True):
        reply = ctx.expect("params", options.step_timeout_s)
        if reply["request_id"] != rid:
            raise RuntimeError(f"ctx instance sent params for request {reply['request_id']}, expected {rid}")
        items.append([rid + 1_000_000, rid, tokens, reply["params"], faults.choose(options.faults, rid)])
    ctx.expect("sent", options.step_timeout_s)
    say(f"round {round_index + 1}/{options.rounds}: gen pulls and verifies {count} requests")
    ctx_fault = options.ctx_fault if round_index == options.rounds // 2 else ""
    if ctx_fault:
        for item in items:
            item[4] = f"ctx-{ctx_fault}"
    faulted_at = time.monotonic()
    if ctx_fault:  # after its params were handed out, before the gen reads: a race with the READs could miss
        ctx.signal(signal.SIGSTOP if ctx_fault == "stop" else signal.SIGKILL)
        say(f"round {round_index + 1}/{options.rounds}: ctx instance {'stopped' if ctx_fault == 'stop' else 'killed'}")
    gen.send(op="receive", items=items)
    if cancelled := [item[1] for item in items if item[4] == "ctx-cancel"]:  # while the gen reads them
        ctx.send(op="cancel", request_ids=cancelled)
    received = gen.expect("received", options.step_timeout_s)
    if ctx_fault == "stop":  # kept stopped past the lease (a ctx host that hung), then resumed
        time.sleep(max(0.0, faulted_at + options.model.lease_ms / 1000 + STOPPED_PAST_LEASE_S - time.monotonic()))
        ctx.signal(signal.SIGCONT)
    if ctx_fault != "kill":
        ctx.send(op="settle")
        settled = ctx.expect("settled", options.step_timeout_s)
        report.ctx_errors.update({str(k): v for k, v in settled["errors"].items()})
        report.cpu_s["ctx"].append(settled["cpu_s"])
        report.loop_passes["ctx"].append(settled["passes"])
    report.cpu_s["gen"].append(received["cpu_s"])
    report.loop_passes["gen"].append(received["passes"])
    report.round_seconds.append(received["seconds"])
    report.round_bytes.append(sum(r["bytes"] for r in received["results"]))
    tokens = dict(zip(ids, options.requests, strict=True))
    for r in received["results"]:
        report.results.append(RequestResult(round=round_index, tokens=tokens[r["request_id"]], **r))
    verified = sum(r["verified"] for r in received["results"])
    say(f"round {round_index + 1}/{options.rounds}: {verified}/{count} verified in {received['seconds'] * 1e3:.1f} ms")


def _measure_raw(
    ctx: Worker,
    gen: Worker,
    nbytes: int,
    block_bytes: int,
    report: PairReport,
    timeout_s: float,
    request_bytes: int = 0,
) -> None:
    """In the same run: one READ of the same bytes as one descriptor, and a naive loop of one READ per block; with
    ``request_bytes`` (the one size of the steady requests), one descriptor of one request's bytes, many times."""
    request_bytes = request_bytes if 0 < request_bytes <= nbytes else 0
    request_repeats = RAW_REQUEST_READ_REPEATS if request_bytes else 0
    ctx.send(op="baseline_source", nbytes=nbytes)
    source = ctx.expect("baseline_source", timeout_s)
    ctx.send(op="baseline_serve", repeats=1)  # the reader's last READ signals; the timed ones carry no notification
    gen.send(
        op="baseline_read",
        metadata=source["metadata"],
        name=source["name"],
        row=source["row"],
        repeats=RAW_READ_REPEATS,
        block_bytes=block_bytes,
        request_bytes=request_bytes,
        request_repeats=request_repeats,
    )
    result = gen.expect("baseline_result", timeout_s)
    ctx.expect("baseline_served", timeout_s)
    report.raw_seconds, report.per_block_seconds = result["seconds"], result["per_block_seconds"]
    report.raw_bytes = result["nbytes"]
    report.raw_request_seconds, report.raw_request_bytes = result["request_seconds"], result["request_nbytes"]


def format_table(report: PairReport) -> str:
    lines = [f"{'round':>5} {'request':>8} {'tokens':>7} {'MiB':>9} {'ms':>9} {'GB/s':>7}  verified"]
    for r in report.results:
        gbps = r.bytes / r.seconds / 1e9 if r.seconds > 0 else 0.0
        status = "yes" if r.verified else f"NO ({r.error or f'{r.mismatched} mismatched elements'})"
        lines.append(
            f"{r.round:>5} {r.request_id:>8} {r.tokens:>7} {r.bytes / 2**20:>9.1f} {r.seconds * 1e3:>9.2f} "
            f"{gbps:>7.2f}  {status}"
        )
    s = report.summary()
    lines.append("")
    lines.append(
        f"total: {s['requests']} requests, {s['verified']} verified, {s['mismatched_elements']} mismatched elements, "
        f"{s['bytes'] / 2**20:.1f} MiB in {s['seconds'] * 1e3:.1f} ms"
    )
    if s["gbps"] and s["raw_read_gbps"] and s["per_block_read_gbps"]:
        lines.append(
            f"nixl_kv: {s['gbps']:.2f} GB/s (median of the rounds after the first); raw {report.backend} READ of the "
            f"same bytes as one descriptor: {s['raw_read_gbps']:.2f} GB/s; ratio {s['ratio_to_raw']:.2f}; a naive "
            f"loop of one READ per block: {s['per_block_read_gbps']:.2f} GB/s"
        )
    if s["latency_p50_us"] is not None:
        rounds = "rounds after the first" if len(report.round_seconds) > 1 else "one round"
        lines.append(
            f"latency (gen side, request to reported complete, {rounds}): p50 {s['latency_p50_us']:.0f} µs, "
            f"p99 {s['latency_p99_us']:.0f} µs; first round {s['first_round_ms']:.1f} ms"
        )
    if s["extra_over_raw_us"] is not None:
        lines.append(
            f"over its READ: p50 {s['extra_over_raw_us']:.0f} µs more than a raw {report.backend} READ of one "
            f"request's {s['raw_request_bytes']} bytes as one descriptor (p50 {s['raw_request_read_p50_us']:.0f} µs)"
        )
    elif s["latency_p50_us"] is not None and s["raw_read_gbps"] is not None:
        lines.append("over its READ: not measured (the requests differ in size: no raw READ of the same bytes)")
    if s["gen_cpu_us_per_request"] is not None and s["ctx_cpu_us_per_request"] is not None:
        lines.append(
            f"CPU per request: gen {s['gen_cpu_us_per_request']:.0f} µs, ctx {s['ctx_cpu_us_per_request']:.0f} µs "
            f"(every thread, rounds after the first); progress-loop passes per request: gen "
            f"{s['gen_loop_passes_per_request']:.1f}, ctx {s['ctx_loop_passes_per_request']:.1f}"
        )
    if s["ctx_errors"]:
        lines.append(f"ctx side errors: {s['ctx_errors']}")
    if report.leaked:
        lines.append(f"LEFT AFTER CLOSE: {s['leaks']}")
    return "\n".join(lines)
