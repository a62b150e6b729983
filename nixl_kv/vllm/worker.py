"""The worker side: one ``CacheTransceiver`` over vLLM's own KV cache tensors, driven by the scheduler's metadata.

ctx: after the forward that completes a prompt (``wait_for_save``) the request is responded to, so its blocks are
pinned before the scheduler hands its params out; ``finished`` reports it sent once its readers are done (or its
lease ended) and the scheduler said the params left the engine.
gen: ``start_load_kv`` hands each pull into the request's freshly allocated blocks to the puller (its own thread,
``nixl_kv.vllm.puller``); ``finished`` reports it received once the transfer ended and no READ can still land,
failed ones also as load errors, so vLLM recomputes them and never decodes from blocks that were not received.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from nixl_kv import wire
from nixl_kv.comm import SingleProcessComm
from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.params import ParamsMaker
from nixl_kv.requests import TransferRequest
from nixl_kv.state import ContextPhaseParams
from nixl_kv.transceiver import CacheTransceiver
from nixl_kv.vllm.blocks import VllmBlocks
from nixl_kv.vllm.comm import TensorParallelComm
from nixl_kv.vllm.digest import DigestLog, kv_digest
from nixl_kv.vllm.groups import CacheGroups
from nixl_kv.vllm.kv_layout import (
    AttentionShape,
    MambaModel,
    cache_state,
    describe,
    describe_mamba,
    mamba_config,
    ordered_layers,
)
from nixl_kv.vllm.metadata import Respond, StepMetadata
from nixl_kv.vllm.puller import Pulled, Puller
from nixl_kv.vllm.stats import TransferStats

log = logging.getLogger(__name__)


@dataclass
class StepResults:
    """What one ``finished`` call reports to vLLM."""

    sent: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


@contextlib.contextmanager
def every_cpu() -> Iterator[None]:
    """Let the calling thread, and the threads it starts meanwhile, run on every CPU of the machine. vLLM binds its
    worker (and so every thread it starts) to its OMP threads' CPU: a transfer thread there waits behind the
    forward, and its spinning OMP threads (a 256-token pull took 609 ms, first contacts passed their deadline)."""
    bound = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # a cpuset narrower than the machine: stay as we are
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, bound)


class WorkerSide:
    def __init__(
        self,
        shape: AttentionShape,
        total_kv_heads: int,
        tp: int,
        config: CacheTransceiverConfig,
        groups: CacheGroups | None = None,
        mamba: MambaModel | None = None,
        digest_file: str | None = None,
    ) -> None:
        self._shape, self._total_kv_heads, self._tp, self._config = shape, total_kv_heads, tp, config
        self._groups = groups or CacheGroups(block_size=shape.block_size)
        self._mamba = mamba
        self._digest_file = digest_file
        self._digests: DigestLog | None = None  # set at register (it needs the rank)
        self._layers: list[torch.Tensor] = []  # the attention layers, in model order
        self._blocks: VllmBlocks | None = None
        self.transceiver: CacheTransceiver | None = None
        self._responding: dict[int, Respond] = {}  # ctx: our id -> what was responded
        self._sent: set[str] = set()  # ctx: transfers ended, waiting for the scheduler's hand-out
        self._handed_out: set[str] = set()  # ctx: params left the engine, transfer not ended yet
        self._withdrawn: set[str] = set()  # ctx: finished without params, transfer cancelled, not ended yet
        self._puller: Puller | None = None  # gen
        self._load_errors: set[int] = set()
        self.stats = TransferStats()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> ParamsMaker:
        groups = self._groups
        self._layers = ordered_layers(kv_caches, groups.attention_layers)
        layout, dtype = describe(self._layers, self._shape)
        rnn_layout = rnn = None
        if groups.mamba_shape is not None:
            if self._mamba is None:
                raise ValueError("a hybrid model's worker needs its Mamba model figures")
            rnn_layout = describe_mamba(ordered_layers(kv_caches, groups.mamba_layers), groups.mamba_shape)
            rnn = mamba_config(groups.mamba_shape, self._mamba, self._tp, rnn_layout.num_layers)
        self._blocks = VllmBlocks(layout, rnn_layout)
        state = cache_state(self._total_kv_heads, layout, dtype, self._tp, rnn, mla=self._shape.mla)
        comm = SingleProcessComm() if self._tp == 1 else TensorParallelComm()
        if self._digest_file:
            self._digests = DigestLog(self._digest_file, getattr(comm, "rank", 0))
        with every_cpu():  # the threads started here (progress loop, agent, puller) inherit it
            self.transceiver = CacheTransceiver(self._blocks, state, self._config, comm)
            self._puller = Puller(self.transceiver, self._blocks, threaded=self._tp == 1)
        log.info("nixl_kv: %d layers of %s pools registered (%s)", layout.num_layers, layout.kind.value, dtype.value)
        return self.transceiver.params_maker()

    # --- each step ---------------------------------------------------------------------------------------------
    def start(self, metadata: StepMetadata) -> None:
        """gen: start this step's pulls; ctx: note what the scheduler decided about responded requests."""
        for vllm_id in metadata.handed_out:
            self._handed_out.add(vllm_id)
        for vllm_id in metadata.withdrawn:
            self._withdraw(vllm_id)
        for vllm_id in metadata.cancel:
            self._puller.cancel(vllm_id)
        for receive in metadata.receive:
            self._puller.submit(receive)

    def save(self, metadata: StepMetadata) -> None:
        """ctx: the forward is over, the prompts it completed are in the pools: respond to them."""
        for respond in metadata.respond:
            request = TransferRequest(respond.request_id, num_tokens=respond.num_tokens)
            try:
                self._blocks.register(respond.request_id, respond.block_ids, respond.slot)
                self.transceiver.respond_and_send_async(request)
            except Exception as exc:  # its reader's pull fails and the decode instance recomputes: never vLLM's step
                log.error("nixl_kv: request %s could not be served: %s: %s", respond.vllm_id, type(exc).__name__, exc)
                self._blocks.forget(respond.request_id)
                self._sent.add(respond.vllm_id)  # nothing pinned: its blocks can go once the scheduler lets them
                continue
            self._responding[respond.request_id] = respond
            if self._digests is not None:
                digest = kv_digest(self._layers, respond.block_ids, respond.num_tokens, self._shape)
                self._digests.write("ctx", respond.request_id, respond.num_tokens, digest)

    def finished(self) -> StepResults:
        results = StepResults()
        if self.transceiver is None:
            return results
        # a status check is a collective over the instance's ranks: with TP every rank checks every step
        collective = self._tp > 1
        if self._responding or collective:
            statuses = self.transceiver.check_context_transfer_status(0, mark_complete=True)
            for ours in statuses.completed_request_ids | statuses.error_request_ids:
                respond = self._responding.pop(ours, None)
                if respond is None:
                    continue
                self._blocks.forget(ours)
                if respond.vllm_id in self._withdrawn:
                    self._withdrawn.discard(respond.vllm_id)
                else:
                    self._sent.add(respond.vllm_id)
        results.sent = self._sent & self._handed_out
        self._sent -= results.sent
        self._handed_out -= results.sent
        for pulled in self._puller.take():
            results.received.add(pulled.vllm_id)
            if pulled.ok:
                self.stats.record(pulled.seconds, pulled.nbytes)
                self._log_digest(pulled)
                continue
            log.warning("nixl_kv: request %s failed, vLLM recomputes it: %s", pulled.vllm_id, pulled.error)
            self.stats.record_failure()
            results.failed.add(pulled.vllm_id)
            self._load_errors.update(pulled.moved_blocks)
        return results

    def _log_digest(self, pulled: Pulled) -> None:
        """gen: the received KV's digest, before vLLM computes on it (it runs the request in a later step)."""
        receive = pulled.receive
        if self._digests is None or receive is None or receive.num_tokens == 0:
            return
        digest = kv_digest(self._layers, receive.block_ids, receive.num_tokens, self._shape)
        ctx_request = wire.decode(receive.params, ContextPhaseParams).request_id
        self._digests.write("gen", ctx_request, receive.num_tokens, digest)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._puller is not None:
            self._puller.close()
        if self.transceiver is not None:
            self.transceiver.close()

    # --- ctx ---------------------------------------------------------------------------------------------------
    def _withdraw(self, vllm_id: str) -> None:
        """The request finished without handing its params out: nobody can read it, end the transfer now."""
        if vllm_id in self._sent:  # already ended (its lease): nothing left to cancel
            self._sent.discard(vllm_id)
            return
        for ours, respond in self._responding.items():
            if respond.vllm_id == vllm_id:
                self._withdrawn.add(vllm_id)
                self.transceiver.cancel_request(TransferRequest(ours))
