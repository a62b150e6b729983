"""One instance of ``nixl-kv pair``: the ctx or the gen instance, one process per rank.

Rank 0 talks to the router (one JSON command per line on stdin, one JSON reply per line on stdout) and
broadcasts each command to the other ranks; every rank does its part and rank 0 gathers the results. A
multi-rank instance runs under mpiexec. The two instances share nothing but the ContextPhaseParams bytes
the router forwards, and NIXL.
"""

from __future__ import annotations

import argparse
import base64
import collections
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import numpy as np

from nixl_kv.cache import PagedKVCache
from nixl_kv.comm import CacheTransceiverComm, MpiComm, SingleProcessComm
from nixl_kv.config import ENV_PREFIX, CacheTransceiverConfig
from nixl_kv.dtypes import DataType
from nixl_kv.errors import BufferExhaustedError
from nixl_kv.harness import faults as faults_module
from nixl_kv.harness.fill import Slice, count_mismatches, expected, indexer_expected, rnn_expected
from nixl_kv.interfaces import TransferStatus
from nixl_kv.layout import LayoutKind, MemoryKind
from nixl_kv.memory import allocate, array_module, region_of
from nixl_kv.progress import ContextProgress
from nixl_kv.registry import agent_class
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.rnn import rnn_share
from nixl_kv.rnn_cache import RnnStatePools
from nixl_kv.state import AttentionType, CacheState, ConvSectionLayout, ModelConfig, ParallelConfig, RnnConfig
from nixl_kv.topology import Share, holds_request, position, share
from nixl_kv.transceiver import CacheTransceiver


@dataclass(frozen=True)
class RnnSpec:
    """The Mamba part of a hybrid model (``--rnn``): its layers are split evenly over PP."""

    layers: int = 2
    heads: int = 4
    head_dim: int = 64
    d_state: int = 16
    d_conv: int = 4
    n_groups: int = 1
    layout: str = ConvSectionLayout.XBC.value
    conv_dtype: str = DataType.FLOAT32.value
    ssm_dtype: str = DataType.FLOAT32.value

    def config(self, pp: int) -> RnnConfig:
        base, extra = divmod(self.layers, pp)
        return RnnConfig(
            num_heads=self.heads,
            head_dim=self.head_dim,
            d_state=self.d_state,
            d_conv=self.d_conv,
            n_groups=self.n_groups,
            hidden_size=self.heads * self.head_dim,
            conv_section_layout=ConvSectionLayout(self.layout),
            conv_dtype=DataType(self.conv_dtype),
            ssm_dtype=DataType(self.ssm_dtype),
            layers_per_pp_rank=tuple(base + (1 if i < extra else 0) for i in range(pp)),
        )


@dataclass(frozen=True)
class InstanceSpec:
    """What one instance runs: the model, its parallel layout, and where its pools live."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str
    num_blocks: int
    attention: str = "mha"  # mha, or mla: kv factor 1 and one latent head per layer
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 0
    layer_split: tuple[int, ...] = ()
    layout: str = LayoutKind.BLOCK_MAJOR.value
    device: str = "cpu"
    gpu_base: int = 0  # with device cuda, rank r uses GPU (gpu_base + r) % GPU count
    one_gpu: bool = False  # with device cuda, every rank uses GPU gpu_base % GPU count (placement split)
    lease_ms: int = 60_000
    timeout_ms: int | None = None
    max_tokens_in_buffer: int = 8192
    direct_min_run_bytes: int | None = None
    layerwise: bool = False  # ctx: respond layer-wise and mark one layer done every LAYER_STEP_S
    reuse_prefix_blocks: int = 0  # gen: already holds this many leading blocks of every request
    indexer_dim: int = 0  # MLA: also move a DSA indexer-K cache of this index dim (quant block 128)
    rnn: RnnSpec | None = None  # hybrid: also move Mamba state
    num_slots: int = 1  # Mamba state slots per rank (requests in flight)
    backend: str = "NIXL"  # the transfer agent (registry name), for the transceivers and the raw READ baseline
    busy_thread: bool = False  # every rank runs a pure-Python CPU-bound thread, as a server's model loop holds the GIL

    @classmethod
    def from_json(cls, text: str) -> InstanceSpec:
        values = json.loads(text)
        rnn = values.pop("rnn", None)
        return cls(**values, rnn=RnnSpec(**rnn) if rnn else None)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def kv_factor(self) -> int:
        return 1 if self.attention == "mla" else 2

    @property
    def data_type(self) -> DataType:
        return DataType(self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over the whole model (indexer-K and Mamba state left out)."""
        return self.layers * self.kv_factor * self.kv_heads * self.head_dim * self.data_type.itemsize

    def layers_per_pp_rank(self) -> tuple[int, ...]:
        if self.layer_split:
            return tuple(self.layer_split)
        base, extra = divmod(self.layers, self.pp)
        return tuple(base + (1 if i < extra else 0) for i in range(self.pp))

    def parallel(self, rank: int) -> ParallelConfig:
        dp = bool(self.dp)
        return ParallelConfig(
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            enable_attention_dp=dp,
            dp_rank=rank % self.tp if dp else 0,
            dp_size=self.tp if dp else 1,
            attention_layers_per_pp_rank=self.layers_per_pp_rank(),
        )

    def cache_state(self, rank: int) -> CacheState:
        return CacheState(
            model=ModelConfig((self.kv_heads,) * self.layers, self.head_dim, self.tokens_per_block),
            parallel=self.parallel(rank),
            dtype=self.data_type,
            attention_type=AttentionType.MLA if self.attention == "mla" else AttentionType.DEFAULT,
            kv_factor=self.kv_factor,
            has_indexer_k_cache=self.indexer_dim > 0,
            indexer_dim=self.indexer_dim,
            rnn=self.rnn.config(self.pp) if self.rnn else None,
        )

    def build_cache(self, rank: int, held: Share, device_id: int) -> PagedKVCache:
        state = self.cache_state(rank)
        rnn = None
        if state.rnn is not None:
            mine = rnn_share(state.rnn, state.parallel, rank)
            rnn = RnnStatePools(
                num_layers=len(mine.layers),
                num_slots=self.num_slots,
                conv_channels=mine.num_channels,
                d_conv=state.rnn.d_conv,
                conv_dtype=state.rnn.conv_dtype,
                num_heads=len(mine.heads),
                head_dim=state.rnn.head_dim,
                d_state=state.rnn.d_state,
                ssm_dtype=state.rnn.ssm_dtype,
                per_layer=self.layout != LayoutKind.BLOCK_MAJOR.value,  # vLLM-style per-layer pools go together
                memory=self.memory,
                device_id=device_id,
            )
        return PagedKVCache(
            indexer_bytes_per_token=state.indexer_bytes_per_token,
            rnn=rnn,
            num_blocks=self.num_blocks,
            num_layers=len(held.layers),
            num_heads=len(held.heads),
            tokens_per_block=self.tokens_per_block,
            head_dim=self.head_dim,
            dtype=self.data_type,
            kv_factor=self.kv_factor,
            kind=LayoutKind(self.layout),
            memory=self.memory,
            device_id=device_id,
        )

    @property
    def memory(self) -> MemoryKind:
        return MemoryKind.VRAM if self.device == "cuda" else MemoryKind.DRAM

    def select_device(self, rank: int) -> int:
        """The GPU this rank uses (made current), or 0 on the CPU."""
        if self.device != "cuda":
            return 0
        cupy = array_module(MemoryKind.VRAM)
        device_id = (self.gpu_base + (0 if self.one_gpu else rank)) % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(device_id).use()
        return device_id

    def dp_rank_of(self, index: int) -> int:
        """With attention DP, request ``index`` of a round is served by DP rank ``index % tp``."""
        return index % self.tp if self.dp else 0


ALLOCATE_WAIT_S = 5.0
ALLOCATE_RETRY_S = 1e-3  # ctx ranks whose blocks differ try again after this (``Instance._allocate_agreed``)


def _layers(where: Slice) -> range:
    return range(where.layer_start, where.layer_start + where.num_layers)


def _tokens(where: Slice) -> range:
    return range(where.token_start, where.token_start + where.num_tokens)


CHANNEL_ENV = f"{ENV_PREFIX}PAIR_CHANNEL"
# Transfer agents whose two instances must share one MPI world: ``nixl-kv pair`` runs both in one MPMD mpiexec job.
SHARED_WORLD_BACKENDS = ("MPI",)
# That job's environment unless the user set it: MPICH's progress thread serves the MPI agent's READs while the
# target's Python is busy (agents/mpi_agent.py: progress).
MPI_JOB_ENVIRONMENT = {"MPIR_CVAR_ASYNC_PROGRESS": "1"}


class Channel:
    """Where rank 0 of an instance takes commands and answers the router: stdin and stdout, or, when both instances
    run in one MPI job (``CHANNEL_ENV`` names a folder), the named pipes ``<role>.commands`` and ``<role>.replies``
    there. The replies pipe opens first (the router's reader is waiting); the commands pipe at the first command,
    after ``ready``, once the router has a command to write."""

    def __init__(self, role: str = "") -> None:
        folder = os.environ.get(CHANNEL_ENV, "") if role else ""
        self._commands_path = os.path.join(folder, f"{role}.commands") if folder else ""
        self._commands: TextIO | None = None if folder else sys.stdin
        self._replies: TextIO = open(os.path.join(folder, f"{role}.replies"), "w") if folder else sys.stdout  # noqa: SIM115

    def command(self) -> dict[str, Any]:
        if self._commands is None:
            self._commands = open(self._commands_path)  # noqa: SIM115 - read until the process ends
        return json.loads(self._commands.readline() or '{"op": "quit"}')

    def emit(self, reply: dict[str, Any]) -> None:
        self._replies.write(json.dumps(reply) + "\n")
        self._replies.flush()


_channel = Channel()


def emit(**reply: Any) -> None:
    _channel.emit(reply)


class Instance:
    """This rank's part of the instance: its cache, its transceiver, and which requests it holds."""

    def __init__(self, role: str, spec: InstanceSpec, comm: CacheTransceiverComm) -> None:
        self.role, self.spec, self.comm = role, spec, comm
        self.parallel = spec.parallel(comm.rank)
        self.device_id = spec.select_device(comm.rank)
        self.xp = array_module(spec.memory)
        self.cache = spec.build_cache(comm.rank, self.share(spec.tokens_per_block), self.device_id)
        self.cache_state = spec.cache_state(comm.rank)
        config = CacheTransceiverConfig.from_env(  # NIXL_KV_* variables tune a pair run too
            CacheTransceiverConfig(
                lease_ms=spec.lease_ms,
                kv_transfer_timeout_ms=spec.timeout_ms,
                enable_inflight_cancel=spec.timeout_ms is not None,
                max_tokens_in_buffer=spec.max_tokens_in_buffer,
                direct_min_run_bytes=spec.direct_min_run_bytes,
                backend=spec.backend,
            )
        )
        self.transceiver = CacheTransceiver(self.cache, self.cache_state, config, comm)
        self.requests: list[TransferRequest] = []
        self._forger: faults_module.Forger | None = None

    def share(self, num_tokens: int) -> Share:
        blocks = -(-num_tokens // self.spec.tokens_per_block)
        return share(self.parallel, self.comm.rank, self.spec.kv_heads, blocks)

    def holds(self, index: int) -> bool:
        return holds_request(self.parallel, self.comm.rank, self.spec.dp_rank_of(index))

    def where(self, num_tokens: int) -> Slice:
        held, tokens_per_block = self.share(num_tokens), self.spec.tokens_per_block
        first, last = held.blocks.start * tokens_per_block, min(held.blocks.stop * tokens_per_block, num_tokens)
        return Slice(
            held.layers.start,
            len(held.layers),
            held.heads.start,
            len(held.heads),
            self.spec.kv_factor,
            self.spec.head_dim,
            first,
            max(0, last - first),
        )

    def allocate(self, request_id: int, num_tokens: int) -> Slice:
        """Blocks for this rank's share of the request (none when its CP share is empty). The pools hold one
        round: the last round's ctx blocks come back when their hold promise runs out (``hold_promise_ms``)."""
        where = self.where(num_tokens)
        deadline = time.monotonic() + ALLOCATE_WAIT_S
        while True:
            try:
                self.cache.allocate(request_id, where.num_tokens)
                return where
            except BufferExhaustedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1e-3)

    def _allocate_agreed(self, requests: list[tuple[int, int]]) -> list[Slice]:
        """Blocks (and state slots) for the ctx rank's requests of a round, the same on every rank that holds the same
        share of them (the TP and PP ranks of one CP rank), as one scheduler's block table gives them in an engine:
        the gen reads every such rank at the blocks the params name (one rank's), and each rank's hold token covers
        its own blocks, so ranks that disagree fail those requests ("hold token does not match"). Each rank's pools
        hold earlier rounds' blocks until their hold promise runs out (``hold_promise_ms``), at a slightly different
        moment on each rank, so a round that starts within it can find their free blocks different: then every rank
        gives the round's blocks back and tries again a moment later, until they agree."""
        deadline, tries = time.monotonic() + ALLOCATE_WAIT_S, 0
        while True:
            placed = [self.allocate(request_id, num_tokens) for request_id, num_tokens in requests]
            if self.comm.size == 1:
                return placed
            group = (position(self.parallel, self.comm.rank).cp_rank, tuple(requests))
            mine = tuple((tuple(self.cache.block_ids(rid).tolist()), self._slot(rid)) for rid, _ in requests)
            every = self.comm.allgather((group, mine, time.monotonic() > deadline))  # (every rank decides alike)
            first: dict[Any, Any] = {}
            if all(first.setdefault(key, held) == held for key, held, _ in every):
                if tries and self.comm.rank == 0:
                    print(f"[pair] ctx ranks' blocks differed: allocated {tries + 1} times", file=sys.stderr)
                return placed
            tries += 1
            for request_id, _ in requests:
                self._free(request_id)  # (not pinned yet: back at once)
            if any(late for *_, late in every):
                raise RuntimeError(f"ctx ranks did not agree on the blocks of requests {[r for r, _ in requests]}")
            time.sleep(ALLOCATE_RETRY_S)

    def _slot(self, request_id: int) -> int | None:
        return self.cache.rnn_slot(request_id) if self.cache.rnn is not None else None

    # --- ctx ---------------------------------------------------------------------------------------------
    def send(self, requests: list[list[int]]) -> list[tuple[int, str]]:
        """Prefill (fill) and respond; layer-wise, the batch's layers are then marked done one by one."""
        batch = []
        held = [
            (request_id, num_tokens) for index, (request_id, num_tokens) in enumerate(requests) if self.holds(index)
        ]
        for (request_id, num_tokens), where in zip(held, self._allocate_agreed(held), strict=True):
            self._write(request_id, request_id, where)
            if self.cache_state.rnn is not None:
                mine = rnn_share(self.cache_state.rnn, self.parallel, self.comm.rank)
                conv, ssm = rnn_expected(request_id, mine, self.cache_state.rnn, self.xp)
                self.cache.rnn.write(self.cache.rnn_slot(request_id), conv, ssm)
            batch.append(TransferRequest(request_id, num_tokens=num_tokens))
        if self.spec.layerwise:
            progress = ContextProgress(self.cache.num_layers)
            self.transceiver.respond_and_send_layer_wise(batch, progress)
            threading.Thread(target=_prefill_layers, args=(progress,), daemon=True).start()
        else:
            for request in batch:
                self.transceiver.respond_and_send_async(request)
        self.requests.extend(batch)
        self.mark = self._usage()  # settle counts from here: the pull, not the harness's fill
        return [(r.request_id, base64.b64encode(r.context_phase_params).decode()) for r in batch]

    def cancel(self, request_ids: list[int]) -> None:
        """Cancel this rank's part of these requests (``ctx-cancel``), as a ctx server whose client went away."""
        wanted = set(request_ids)
        for request in self.requests:
            if request.request_id in wanted:
                self.transceiver.cancel_request(request)

    def settle(self) -> tuple[dict[int, str], float]:
        """Errors of the batch's requests, and this process's CPU seconds and loop passes since they were
        responded to."""
        self.transceiver.check_context_transfer_status(None, mark_complete=True)
        usage = self._since(self.mark)
        errors = {r.request_id: r.error or "" for r in self.requests if r.state is not RequestState.CONTEXT_COMPLETE}
        for request in self.requests:
            self._free(request.request_id)
        self.requests.clear()
        return errors, usage

    def _usage(self) -> tuple[float, int]:
        """This process's CPU seconds (every thread) and its progress loop's passes, so far."""
        return time.process_time(), self.transceiver.loop_passes

    def _since(self, mark: tuple[float, int]) -> tuple[float, int]:
        cpu_s, passes = self._usage()
        return cpu_s - mark[0], passes - mark[1]

    # --- gen ---------------------------------------------------------------------------------------------
    def receive(self, items: list[list[Any]]) -> tuple[float, tuple[float, int], list[dict[str, Any]]]:
        """Items are (gen request id, ctx request id, tokens, params, fault); this rank's share of all is pulled at
        once. ``fault`` (harness.faults) is injected into that request. Returns the pull's seconds, this process's
        CPU seconds and loop passes over it (every thread; not the harness's allocation and verification), and the
        results."""
        mine, faults = [], {}
        for index, (gen_id, ctx_id, num_tokens, params, fault) in enumerate(items):
            if self.holds(index):
                where = self.allocate(gen_id, num_tokens)
                self._hold_prefix(gen_id, ctx_id, where)
                data = base64.b64decode(params)
                if fault == "corrupt":
                    data = faults_module.corrupt(data, gen_id)
                elif fault == "forge":
                    self._forger = self._forger or faults_module.Forger()
                    self._forger.forge(data)
                faults[gen_id] = fault
                request = TransferRequest(
                    gen_id, context_phase_params=data, reused_blocks=self.spec.reuse_prefix_blocks
                )
                mine.append((request, where))
        start, started, mark = time.perf_counter(), {}, self._usage()
        for request, _ in mine:
            started[request.request_id] = time.perf_counter()
            self.transceiver.request_and_receive_async(request)
            if faults[request.request_id] == "cancel":
                self.transceiver.cancel_request(request)
        completed_at = self._wait_all()
        seconds, usage = time.perf_counter() - start, self._since(mark)
        results = []
        ctx_ids = {gen_id: ctx_id for gen_id, ctx_id, *_ in items}
        for request, where in mine:
            ok = request.state is RequestState.GENERATION_TRANS_COMPLETE
            done = completed_at.get(request.request_id)
            mismatched = 0
            if ok:
                mismatched = self._mismatches(request.request_id, ctx_ids[request.request_id], where)
            results.append(
                {
                    "request_id": ctx_ids[request.request_id],
                    "bytes": request.transfer_bytes,
                    "seconds": request.transfer_end - request.transfer_start,
                    "latency_s": None if done is None else done - started[request.request_id],
                    "verified": ok and mismatched == 0,
                    "mismatched": mismatched,
                    "error": request.error,
                    "fault": faults[request.request_id],
                }
            )
            self._free(request.request_id)
        return seconds, usage, results

    def _hold_prefix(self, gen_id: int, ctx_id: int, where: Slice) -> None:
        """Prefix reuse: the gen side already holds the first blocks (here: the content they must have)."""
        held_tokens = self.spec.reuse_prefix_blocks * self.spec.tokens_per_block - where.token_start
        count = min(max(0, held_tokens), where.num_tokens)
        self._write(gen_id, ctx_id, dataclasses.replace(where, num_tokens=count))

    def _write(self, request_id: int, seed: int, where: Slice) -> None:
        """The request's first tokens of this rank's share: KV and, with DSA, indexer-K."""
        if not where.num_tokens:
            return
        self.cache.write_tokens(request_id, expected(seed, where, self.spec.data_type.itemsize, self.xp))
        if self.cache.indexer_layout is not None:
            values = indexer_expected(
                seed, _layers(where), _tokens(where), self.cache_state.indexer_bytes_per_token, self.xp
            )
            self.cache.write_indexer(request_id, values)

    def _mismatches(self, request_id: int, seed: int, where: Slice) -> int:
        """Elements of the request's KV, indexer-K and Mamba state on this rank that differ from the fill."""
        mismatched = 0
        if where.num_tokens:
            actual = self.cache.read_tokens(request_id, where.num_tokens)
            mismatched += count_mismatches(actual, seed, where, self.xp)
            if self.cache.indexer_layout is not None:
                got = self.cache.read_indexer(request_id, where.num_tokens)
                bytes_per_token = self.cache_state.indexer_bytes_per_token
                mismatched += int(
                    (got != indexer_expected(seed, _layers(where), _tokens(where), bytes_per_token, self.xp)).sum()
                )
        if self.cache_state.rnn is not None:
            mine = rnn_share(self.cache_state.rnn, self.parallel, self.comm.rank)
            conv, ssm = self.cache.rnn.read(self.cache.rnn_slot(request_id))
            want_conv, want_ssm = rnn_expected(seed, mine, self.cache_state.rnn, self.xp)
            mismatched += int((conv != want_conv).sum()) + int((ssm != want_ssm).sum())
        return mismatched

    def _wait_all(self) -> dict[int, float]:
        """Every request to a terminal state, polling for one completion at a time (as a server's loop would):
        when each check that reported a request complete returned, by request id. Every rank of a sync group
        makes the same checks: they agree on each outcome, so they become idle at the same check."""
        completed_at: dict[int, float] = {}
        deadline = time.monotonic() + self.spec.lease_ms / 1000 + 5
        while not self.transceiver.check_gen_transfer_complete() and time.monotonic() < deadline:
            statuses = self.transceiver.check_gen_transfer_status(at_least=1)
            now = time.perf_counter()
            completed_at.update(dict.fromkeys(statuses.completed_request_ids, now))
        return completed_at

    def _free(self, request_id: int) -> None:
        self.cache.free(request_id)

    def close(self) -> None:
        if self._forger is not None:
            self._forger.close()
        self.transceiver.close()


LAYER_STEP_S = 0.002
MAX_NAIVE_BLOCKS = 4096  # the per-block baseline loop stops splitting beyond this many READs


def _prefill_layers(progress: ContextProgress) -> None:
    """Stands in for the model: one layer of the batch finishes every LAYER_STEP_S."""
    for layer in range(progress.num_layers):
        time.sleep(LAYER_STEP_S)
        progress.mark_layer_done(layer)


@contextmanager
def busy_thread(enabled: bool) -> Iterator[None]:
    """While the block runs, a daemon thread spins in pure Python: a server's forward loop competes with the
    transceiver's threads for the GIL, and latency figures measured without one flatter it."""
    if not enabled:
        yield
        return
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=spin, name="busy-model-loop", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def merge_results(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per request: verified only if every rank that holds part of it verified its part."""
    merged: dict[int, dict[str, Any]] = {}
    for results in per_rank:
        for r in results:
            into = merged.setdefault(
                r["request_id"],
                {
                    "request_id": r["request_id"],
                    "bytes": 0,
                    "seconds": 0.0,
                    "latency_s": 0.0,
                    "verified": True,
                    "mismatched": 0,
                    "error": None,
                    "fault": r["fault"],
                },
            )
            into["bytes"] += r["bytes"]
            into["seconds"] = max(into["seconds"], r["seconds"])
            into["latency_s"] = _later(into["latency_s"], r["latency_s"])
            into["verified"] = into["verified"] and r["verified"]
            into["mismatched"] += r["mismatched"]
            into["error"] = into["error"] or r["error"]
    return [merged[rid] for rid in sorted(merged)]


def _later(a: float | None, b: float | None) -> float | None:
    """A request's latency over ranks: the last rank's; unknown if any rank never saw it complete."""
    return None if a is None or b is None else max(a, b)


class RawReadBaseline:
    """A plain READ of one descriptor between the two processes, on the run's own transfer agent (``backend``):
    the ceiling ours is compared with. It goes through the agent interface and nothing else."""

    def __init__(self, role: str, nbytes: int, memory: MemoryKind, device_id: int, backend: str) -> None:
        self.agent = agent_class(backend)(f"pair-baseline-{role}-{time.time_ns()}")
        self.memory = memory
        self.buffer = allocate((nbytes,), np.dtype(np.uint8), memory, device_id)
        self.buffer.fill(1)
        region = region_of(self.buffer, memory, device_id)
        self.row = (region.address, nbytes, device_id)
        self.agent.register([region])

    def describe(self) -> None:
        metadata = base64.b64encode(self.agent.metadata()).decode()
        emit(op="baseline_source", metadata=metadata, name=self.agent.name, row=self.row)

    def serve(self, repeats: int, timeout_s: float = 120.0) -> None:
        """Make progress as the READ target (transports without hardware offload need it) until ``repeats``
        notifications came (the reader's READs carry none but its last, untimed one)."""
        seen, deadline = 0, time.monotonic() + timeout_s
        while seen < repeats and time.monotonic() < deadline:
            seen += len(self.agent.poll_notifications())
        emit(op="baseline_served", reads=seen)

    def read(
        self,
        metadata: str,
        name: str,
        row: list[int],
        repeats: int,
        block_bytes: int,
        request_bytes: int = 0,
        request_repeats: int = 0,
    ) -> None:
        """The same bytes as one descriptor (the ceiling) and as a naive loop of one READ per block; then, where
        ``request_bytes`` is given, one descriptor of one request's bytes (the first of the source), ``request_repeats``
        times: the per-request latency is compared with that."""
        self.agent.load_remote(base64.b64decode(metadata), name)
        count = max(1, min(row[1] // max(block_bytes, 1), MAX_NAIVE_BLOCKS))
        size = row[1] // count
        one = self._timed(name, row, self.row, 1, size * count, repeats)
        per_block = self._timed(name, row, self.row, count, size, repeats)
        request = []
        if 0 < request_bytes <= row[1] and request_repeats:
            request = self._timed(name, row, self.row, 1, request_bytes, request_repeats)
        self._timed(name, row, self.row, 1, min(size, row[1]), 1, b"baseline")  # the target's signal: all done
        self.agent.forget_remote(name)
        emit(
            op="baseline_result",
            seconds=one,
            per_block_seconds=per_block,
            nbytes=size * count,
            request_seconds=request,
            request_nbytes=request_bytes if request else 0,
        )

    def _timed(
        self, peer: str, remote_row: list[int], local_row: tuple, count: int, size: int, repeats: int, note: bytes = b""
    ) -> list[float]:
        """Seconds of each repeat: ``count`` READs of ``size`` bytes, each posted after the last one ended; none
        carries a notification (one would slow the next READ to the peer) but the last of all when ``note`` is
        given."""

        def rows(base: list[int] | tuple) -> np.ndarray:
            return np.array([(base[0] + i * size, size, base[2]) for i in range(count)], dtype=np.uint64)

        remote = self.agent.prepare(peer, rows(remote_row), self.memory)
        local = self.agent.prepare(None, rows(local_row), self.memory)
        seconds = []
        for repeat in range(repeats):
            start = time.perf_counter()
            for index in range(count):
                notification = note if (repeat, index) == (repeats - 1, count - 1) else b""
                picked = np.array([index])
                transfer = self.agent.read(local, picked, remote, picked, notification)
                state, deadline = self.agent.status(transfer), time.perf_counter() + 60
                while state is TransferStatus.IN_PROGRESS and time.perf_counter() < deadline:
                    state = self.agent.status(transfer)
                self.agent.release_transfer(transfer)
                if state is not TransferStatus.DONE:
                    raise RuntimeError(f"baseline READ ended in {state}")
            seconds.append(time.perf_counter() - start)
        self.agent.release_prepared(remote)
        self.agent.release_prepared(local)
        return seconds

    def close(self) -> None:
        self.agent.close()


def serve(role: str, spec: InstanceSpec, comm: CacheTransceiverComm) -> None:
    with busy_thread(spec.busy_thread):
        _serve(role, spec, comm)


def _serve(role: str, spec: InstanceSpec, comm: CacheTransceiverComm) -> None:
    instance = Instance(role, spec, comm)
    lead = comm.rank == 0
    baseline: RawReadBaseline | None = None
    if lead:
        state = instance.transceiver.get_serialized_data_transceiver_state()
        emit(op="ready", ranks=comm.size, state=base64.b64encode(state).decode(), rss_kb=_rss_kb())
    try:
        while True:
            command = comm.bcast(_channel.command() if lead else None)
            op = command["op"]
            if op == "send":
                params = comm.allgather(instance.send(command["requests"]))
                if lead:
                    for request_id, blob in _first_per_request(params):
                        emit(op="params", request_id=request_id, params=blob)
                    emit(op="sent")
            elif op == "connect":  # the router introduces the ctx instance before its first request
                instance.transceiver.connect_to(base64.b64decode(command["state"]))
                comm.barrier()
                if lead:
                    emit(op="connected")
            elif op == "cancel":
                instance.cancel(command["request_ids"])
            elif op == "settle":
                settled = comm.allgather(instance.settle())
                if lead:
                    errors = {str(k): v for e, _ in settled for k, v in e.items()}
                    usages = [usage for _, usage in settled]
                    emit(op="settled", errors=errors, cpu_s=sum(u[0] for u in usages), passes=sum(u[1] for u in usages))
            elif op == "receive":
                gathered = comm.allgather(instance.receive(command["items"]))
                if lead:
                    emit(
                        op="received",
                        seconds=max(s for s, _, _ in gathered),
                        cpu_s=sum(usage[0] for _, usage, _ in gathered),
                        passes=sum(usage[1] for _, usage, _ in gathered),
                        results=merge_results([r for _, _, r in gathered]),
                    )
            elif lead and op == "baseline_source":
                baseline = RawReadBaseline(role, command["nbytes"], spec.memory, instance.device_id, spec.backend)
                baseline.describe()
            elif lead and op == "baseline_serve" and baseline is not None:
                baseline.serve(command["repeats"])
            elif lead and op == "baseline_read":
                baseline = RawReadBaseline(role, command["row"][1], spec.memory, instance.device_id, spec.backend)
                baseline.read(
                    command["metadata"],
                    command["name"],
                    command["row"],
                    command["repeats"],
                    command["block_bytes"],
                    command.get("request_bytes", 0),
                    command.get("request_repeats", 0),
                )
            elif op == "quit":
                break
    finally:
        if baseline is not None:
            baseline.close()
        instance.close()
    live = comm.allgather(_left_after_close(instance))
    forged = sum(comm.allgather(instance.transceiver.metrics.snapshot()[role]["forged_messages"]))
    paths = collections.Counter()
    for counts in comm.allgather(instance.transceiver.metrics.paths()):
        paths.update(counts)
    if lead:
        live_total = {name: sum(counts[name] for counts in live) for name in live[0]}
        emit(op="bye", live=live_total, rss_kb=_rss_kb(), forged_messages=forged, paths=dict(paths))


def _left_after_close(instance: Instance) -> dict[str, int]:
    """What the instance still holds after close (all zero): the agent's handles, pinned requests, staging slots
    not free (leased or poisoned)."""
    staging = instance.transceiver._staging
    return {
        **instance.transceiver._agent.live_handles,
        "pinned requests": instance.cache.pinned_requests,
        "staging slots in use": len(staging.slots) - staging.free_slots,
    }


def _rss_kb() -> int:
    """This process's resident memory (Linux), 0 where it cannot be read."""
    try:
        with open("/proc/self/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def _first_per_request(per_rank: list[list[tuple[int, str]]]) -> list[tuple[int, str]]:
    """Every rank that holds a request made its params; the router needs one per request (in request order)."""
    chosen: dict[int, str] = {}
    for params in per_rank:
        for request_id, blob in params:
            chosen.setdefault(request_id, blob)
    return sorted(chosen.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=["ctx", "gen"])
    parser.add_argument("spec", help="InstanceSpec as JSON")
    args = parser.parse_args()
    spec = InstanceSpec.from_json(args.spec)
    comm: CacheTransceiverComm = SingleProcessComm()
    if spec.backend in SHARED_WORLD_BACKENDS:  # one MPMD job: this instance is this application's ranks
        comm = MpiComm.of_application()
    elif spec.world_size > 1:
        comm = MpiComm()
    logging.basicConfig(level=logging.WARNING, format=f"[{args.role}{comm.rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("nixl").setLevel(logging.WARNING)
    if comm.size != spec.world_size:
        raise SystemExit(f"{args.role}: {comm.size} MPI ranks for tp*pp*cp = {spec.world_size}")
    global _channel
    if comm.rank == 0:
        _channel = Channel(args.role)
    serve(args.role, spec, comm)


def spec_json(spec: InstanceSpec) -> str:
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    main()
