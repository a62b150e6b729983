"""The prefill side: run the prompt, put each rank's share of its cache in that rank's pools, respond.

Rank 0 runs the model once and splits the cache (``rank_piece``): every rank writes only its kv heads (and its
Mamba channels and heads) into its own pools, then responds, as a tensor-parallel prefill server does. The params
go back to the caller only after every rank has responded (the gather at the end of the step), bound to their
prompt (its digest) and first token.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from nixl_kv.errors import BufferExhaustedError
from nixl_kv.params_seal import prompt_digest
from nixl_kv.requests import TransferRequest
from nixl_kv.serving.engine import Engine, fail_future
from nixl_kv.serving.model_cache import CachePiece, rank_piece, whole_piece, write_piece


@dataclass
class PrefillJob:
    prompt: list[int]
    future: Future = field(default_factory=Future)  # -> Prefilled


@dataclass(frozen=True)
class Prefilled:
    request_id: int
    first_token: int
    params: bytes


@dataclass(frozen=True)
class Prefill:
    """One prefilled request as a rank gets it: its share of the cache, and what its params are bound to."""

    request_id: int
    num_tokens: int
    first_token: int
    prompt_digest: bytes
    piece: CachePiece  # this rank's share


@dataclass
class PrefillStep:
    prefills: list[Prefill] = field(default_factory=list)


class CtxEngine(Engine):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._ids = itertools.count(1)
        self._responding: dict[int, TransferRequest] = {}
        self._planned: dict[int, tuple[PrefillJob, int]] = {}  # rank 0: request id -> (job, first token)

    def plan(self, jobs: list[PrefillJob]) -> list[PrefillStep]:
        steps = [PrefillStep() for _ in range(self.lockstep.size)]
        free_blocks = self.pools.free_blocks
        for job in jobs:
            blocks = self.pools.blocks_for(len(job.prompt))
            if blocks > free_blocks:
                fail_future(job.future, BufferExhaustedError(f"{blocks} blocks needed, {free_blocks} free"))
                continue
            free_blocks -= blocks
            try:
                first_token, whole = self._prefill(job.prompt)
            except Exception as exc:
                fail_future(job.future, exc)
                continue
            request_id, digest = next(self._ids), prompt_digest(job.prompt)
            self._planned[request_id] = (job, first_token)
            for rank, step in enumerate(steps):
                piece = rank_piece(whole, self.state, rank)
                step.prefills.append(Prefill(request_id, len(job.prompt), first_token, digest, piece))
        return steps

    def _prefill(self, prompt: list[int]) -> tuple[int, CachePiece]:
        with torch.no_grad():
            output = self.model(torch.tensor([prompt], dtype=torch.long), use_cache=True)
        return int(output.logits[0, -1].argmax()), whole_piece(output.past_key_values, self.geometry)

    def apply(self, step: PrefillStep) -> list[list[tuple[int, bytes | str]]] | None:
        responded: list[tuple[int, bytes | str]] = []
        for prefill in step.prefills:
            request_id = prefill.request_id
            try:  # every rank has the same free blocks: they all succeed or all fail
                self.pools.allocate(request_id, prefill.num_tokens)
            except BufferExhaustedError as exc:
                responded.append((request_id, f"{type(exc).__name__}: {exc}"))
                continue
            write_piece(self.pools, request_id, prefill.piece)
            request = TransferRequest(
                request_id,
                num_tokens=prefill.num_tokens,
                first_gen_tokens=(prefill.first_token,),
                prompt_digest=prefill.prompt_digest,
            )
            self.transceiver.respond_and_send_async(request)
            self._responding[request_id] = request
            responded.append((request_id, request.context_phase_params))
        gathered = self.lockstep.gather(responded)
        statuses = self.transceiver.check_context_transfer_status(0, mark_complete=True)
        for request_id in statuses.completed_request_ids | statuses.error_request_ids:
            if self._responding.pop(request_id, None) is not None:
                self.pools.free(request_id)
        return gathered

    def finish(self, gathered: list[list[tuple[int, bytes | str]]]) -> None:
        for request_id, params in gathered[0]:
            job, first_token = self._planned.pop(request_id)
            if isinstance(params, str):
                fail_future(job.future, BufferExhaustedError(params))
            elif not job.future.done():
                job.future.set_result(Prefilled(request_id, first_token, params))

    def in_flight(self) -> bool:
        return bool(self._responding)

    @property
    def unpulled(self) -> int:
        """Requests whose params were handed out and whose readers are not done yet (each pins its blocks until
        then, or until its lease ends)."""
        return len(self._responding)

    def fail_all(self, error: BaseException) -> None:
        for job, _ in self._planned.values():
            fail_future(job.future, error)
        self._planned.clear()
