"""What the scheduler side tells the worker side each step, and what a worker tells the scheduler once at start.

vLLM passes a ``KVConnectorMetadata`` from the scheduler to every worker with each step and gathers each worker's
``KVConnectorHandshakeMetadata`` once, after the KV caches are registered. Both are plain data (pickled across
processes when the workers are processes of their own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from nixl_kv.params import ParamsMaker


@dataclass(frozen=True)
class Respond:
    """ctx: the prompt of ``vllm_id`` is complete after this step: pin its blocks and serve its readers."""

    request_id: int  # nixl_kv's id for it (the scheduler's counter)
    vllm_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    slot: int | None = None  # its Mamba state slot (hybrid models)


@dataclass(frozen=True)
class Receive:
    """gen: pull the request's KV into its blocks (all of them, in order; the first ``reused_blocks`` are held)."""

    request_id: int
    vllm_id: str
    params: bytes
    block_ids: tuple[int, ...]
    reused_blocks: int
    slot: int | None = None  # its Mamba state slot (hybrid models)
    num_tokens: int = 0  # the prompt tokens the pull brings (with those the prefix cache holds)


@dataclass
class StepMetadata(KVConnectorMetadata):
    respond: list[Respond] = field(default_factory=list)
    receive: list[Receive] = field(default_factory=list)
    handed_out: list[str] = field(default_factory=list)  # ctx: params left the engine; report when sent
    withdrawn: list[str] = field(default_factory=list)  # ctx: finished without params (aborted): cancel, no report
    cancel: list[str] = field(default_factory=list)  # gen: the request ended while its KV was in flight


@dataclass
class WorkerHandshake(KVConnectorHandshakeMetadata):
    """A worker's ``ParamsMaker``: the scheduler makes the params that ``request_finished`` returns with it."""

    maker: ParamsMaker
