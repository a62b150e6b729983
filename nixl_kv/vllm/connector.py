"""``NixlKvConnector``: vLLM's ``KVConnectorBase_V1`` over nixl_kv, for a prefill and a decode instance.

Load it by module path::

    --kv-transfer-config '{"kv_connector": "NixlKvConnector", "kv_connector_module_path": "nixl_kv.vllm",
                           "kv_role": "kv_producer", "kv_load_failure_policy": "recompute"}'

vLLM builds one instance in the scheduler (role SCHEDULER: ``nixl_kv.vllm.scheduler``) and one in every worker
(role WORKER: ``nixl_kv.vllm.worker``); each hook here only hands over to that side. Options, in
``kv_connector_extra_config``: ``transfer_timeout_ms`` (a pull's deadline, default 10000), ``lease_ms`` (how long
the prefill instance keeps a request's blocks for its reader, default 30000), ``backend`` (the transfer agent,
default NIXL), ``kv_digest_file`` (each side appends a digest of every request's KV there: ``nixl_kv.vllm.digest``),
``allow_cpu_mla`` (run an MLA model on vLLM's CPU build: ``_check_cpu_mla``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.errors import NotSupportedError
from nixl_kv.vllm.groups import CacheGroups, cache_groups
from nixl_kv.vllm.kv_layout import AttentionShape, MambaModel
from nixl_kv.vllm.metadata import StepMetadata, WorkerHandshake
from nixl_kv.vllm.scheduler import SchedulerSide
from nixl_kv.vllm.stats import TransferPromMetrics, TransferStats
from nixl_kv.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MS = 10_000
DEFAULT_LEASE_MS = 30_000


class NixlKvConnector(KVConnectorBase_V1, SupportsHMA):
    """``SupportsHMA``: vLLM keeps its hybrid KV cache manager on; the groups it gives are ``groups.CacheGroups``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            log.warning("nixl_kv: kv_load_failure_policy is %r: a failed pull fails its request instead of "
                        "recomputing it", transfer.kv_load_failure_policy)  # fmt: skip
        groups = cache_groups(kv_cache_config, vllm_config.cache_config.block_size)
        _check_cpu_mla(groups, bool(transfer.get_from_extra_config("allow_cpu_mla", False)))
        self._groups = groups
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._handshake: WorkerHandshake | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(groups)
            return
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ValueError("nixl_kv.vllm: pipeline-parallel instances are not supported")
        config = CacheTransceiverConfig(
            backend=transfer.get_from_extra_config("backend", "NIXL"),
            kv_transfer_timeout_ms=int(transfer.get_from_extra_config("transfer_timeout_ms", DEFAULT_TIMEOUT_MS)),
            lease_ms=int(transfer.get_from_extra_config("lease_ms", DEFAULT_LEASE_MS)),
            enable_inflight_cancel=True,
        )
        from vllm.platforms import current_platform

        shape = AttentionShape(
            model.get_num_kv_heads(parallel),
            model.get_head_size(),
            groups.block_size,
            mla=groups.mla,
            cpu=current_platform.is_cpu(),
        )
        self._worker = WorkerSide(
            shape,
            model.get_total_num_kv_heads(),
            parallel.tensor_parallel_size,
            CacheTransceiverConfig.from_env(config),
            groups,
            _mamba_model(model.hf_text_config) if groups.mamba is not None else None,
            transfer.get_from_extra_config("kv_digest_file", None),
        )

    # --- worker ------------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._handshake = WorkerHandshake(self._worker.register(kv_caches))

    def get_handshake_metadata(self) -> WorkerHandshake | None:
        return self._handshake

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start(self._step_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: a request is scheduled only once its KV has arrived

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # nothing moves per layer: the reader pulls once the prompt is complete

    def wait_for_save(self) -> None:
        self._worker.save(self._step_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self._worker.finished()
        return results.sent or None, results.received or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = self._worker.finished()
        return KVConnectorTransferResults(results.sent, results.received, results.failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._worker.load_errors()
        return errors if self._groups.single else set()  # several groups: failed_recving alone says it

    def get_kv_connector_stats(self) -> TransferStats | None:
        return None if self._worker is None else self._worker.stats.take()  # the scheduler asks too

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def _step_metadata(self) -> StepMetadata:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, StepMetadata):
            raise TypeError(f"nixl_kv.vllm: unexpected connector metadata {type(metadata).__name__}")
        return metadata

    # --- scheduler ---------------------------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        handshake = metadata.get(0)
        if isinstance(handshake, WorkerHandshake):
            self._scheduler.set_maker(handshake.maker)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        self._scheduler.plan_responses(scheduler_output.num_scheduled_tokens, self._kv_cache_manager.get_block_ids)
        return self._scheduler.take_step()

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.received(set(connector_output.finished_recving or ()))

    def on_new_request(self, request: Any) -> None:
        self._scheduler.on_new_request(request)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        completed = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        return self._scheduler.finished(request, completed)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Every group's blocks (the KV and the Mamba state) stay until the worker reports the request sent: the
        scheduler side noted them per group when it responded."""
        return self.request_finished(request, [])

    # --- both ----------------------------------------------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TransferStats:
        return TransferStats(data) if data is not None else TransferStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict
    ) -> TransferPromMetrics:
        return TransferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _mamba_model(hf_config: Any) -> MambaModel:
    """A hybrid's Mamba2 figures from its config (Granite-4.0-H, Bamba, NemotronH and Mamba2 name them alike)."""

    def first(*names: str) -> int:
        for name in names:
            value = getattr(hf_config, name, None)
            if isinstance(value, int):
                return value
        raise ValueError(f"nixl_kv.vllm: the model config names none of {names}")

    return MambaModel(
        num_heads=first("mamba_n_heads", "mamba_num_heads", "num_heads"),
        n_groups=first("mamba_n_groups", "n_groups"),
        hidden_size=first("hidden_size"),
    )


def _check_cpu_mla(groups: CacheGroups, allowed: bool) -> None:
    """vLLM's CPU_MLA backend decodes a prompt differently by the batch it runs in: four identical greedy requests
    sent at once to one aggregated server gave four different continuations, and a prompt's last token computed by
    its decode path (as a decode instance computes it on a loaded latent cache) gives other tokens than its prefill
    path. The connector moves the latent cache byte for byte (``kv_digest_file`` shows it), but a pair's tokens then
    differ from aggregated vLLM's, so an MLA model on the CPU build needs ``allow_cpu_mla``; refused by name
    otherwise. vLLM's GPU MLA backends are not refused."""
    from vllm.platforms import current_platform

    if not groups.mla or not current_platform.is_cpu():
        return
    if not allowed:
        raise NotSupportedError(
            "nixl_kv.vllm: MLA on vLLM's CPU build is refused: its CPU_MLA backend computes a token differently by "
            "batch and by path (prefill or decode), so a pair decodes other tokens than aggregated vLLM although "
            'the latent cache moves byte for byte; set kv_connector_extra_config {"allow_cpu_mla": true} to run it'
        )
    log.warning(
        "nixl_kv: MLA on vLLM's CPU build (allow_cpu_mla): the latent cache moves byte for byte, but CPU_MLA computes "
        "the decode's first token by another path than aggregated vLLM, so tokens may differ"
    )
