"""The decode side: pull a request's cache into every rank's pools, rebuild the model's cache, decode greedily.

Every rank pulls its own share (its kv heads, its Mamba channels); rank 0 gathers the shares it read, rebuilds the
model's cache from them alone, and decodes. A finished request's blocks stay in the pools (``held``), so that a
later prompt with the same leading blocks reads only the rest (``reused_blocks``); the oldest go when blocks run
short or more than ``max_held`` are kept. Only a prompt checked against its params (``ReceiveJob.verified``) is
matched: blocks held under a prompt they were not made for would hand wrong KV to every later request.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from nixl_kv.errors import BufferExhaustedError
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.serving.engine import Engine, fail_future
from nixl_kv.serving.model_cache import CachePiece, join_pieces, model_cache, read_piece

MAX_HELD = 16  # finished requests kept for prefix reuse


@dataclass
class ReceiveJob:
    """``future`` resolves to a Received once the transfer ended (or fails with its error); then ``emit`` gets each
    decoded token, and None at the end, or the error that stopped the decoding. ``verified``: the prompt was checked
    against the params' digest (``binding.check_binding``); only such a prompt is kept for prefix reuse."""

    params: bytes
    prompt: list[int]
    first_token: int
    max_tokens: int
    emit: Callable[[int | BaseException | None], None]
    eos_token_id: int | None = None
    verified: bool = False
    future: Future = field(default_factory=Future)
    cancelled: bool = False


@dataclass(frozen=True)
class Received:
    request_id: int
    transfer_bytes: int
    transfer_ms: float
    reused_blocks: int


@dataclass
class ReceiveStep:
    free: list[int] = field(default_factory=list)
    receives: list[tuple[int, int, bytes, int, int]] = field(default_factory=list)  # id, tokens, params, from, blocks


class TransferFailed(RuntimeError):
    """The request's transfer ended in error; the message is the transceiver's (its first word names the type).
    ``started``: the params were handed to the transceiver (else they are still good: no room for them here)."""

    def __init__(self, message: str, started: bool = True) -> None:
        super().__init__(message)
        self.started = started


@dataclass
class _Decoding:
    job: ReceiveJob
    cache: object
    last_token: int
    produced: int = 1


class GenEngine(Engine):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._ids = itertools.count(1)
        self._receiving: dict[int, TransferRequest] = {}
        self._tokens: dict[int, int] = {}  # request id -> prompt tokens
        self._jobs_by_id: dict[int, ReceiveJob] = {}  # rank 0
        self._held: OrderedDict[int, np.ndarray | None] = OrderedDict()  # request id -> prompt, oldest first
        self._decoding: list[_Decoding] = []

    # --- rank 0: plan ---------------------------------------------------------------------------------------------
    def plan(self, jobs: list[ReceiveJob]) -> list[ReceiveStep]:
        step = ReceiveStep()
        needed_blocks, keep = 0, set()
        for job in jobs:
            request_id = next(self._ids)
            source, blocks = self._longest_prefix(job.prompt)
            if source is not None:
                keep.add(source)
            self._jobs_by_id[request_id] = job
            step.receives.append((request_id, len(job.prompt), job.params, source or 0, blocks))
            needed_blocks += self.pools.blocks_for(len(job.prompt))
        step.free = self._evict(needed_blocks, len(jobs), keep)
        return [step] * self.lockstep.size

    def _longest_prefix(self, prompt: list[int]) -> tuple[int | None, int]:
        """The held request sharing the most whole leading blocks with ``prompt`` (the last token always moves)."""
        best, best_blocks, wanted = None, 0, np.asarray(prompt[: len(prompt) - 1])
        for request_id, held in self._held.items():
            if held is None:
                continue
            length = min(len(held), len(wanted))
            differ = np.flatnonzero(held[:length] != wanted[:length])
            blocks = int(differ[0] if len(differ) else length) // self.options.tokens_per_block
            if blocks > best_blocks:
                best, best_blocks = request_id, blocks
        return best, best_blocks

    def _evict(self, needed_blocks: int, needed_slots: int, keep: set[int]) -> list[int]:
        free_blocks = self.pools.free_blocks
        rnn = self.pools.rnn
        free_slots = rnn.slots.free_blocks if rnn is not None else needed_slots
        evicted = []
        for request_id in list(self._held):
            short = free_blocks < needed_blocks or free_slots < needed_slots
            if not (short or len(self._held) > MAX_HELD) or request_id in keep:
                continue
            del self._held[request_id]
            evicted.append(request_id)
            free_blocks += len(self.pools.block_ids(request_id))
            free_slots += 1
        return evicted

    # --- every rank: apply ----------------------------------------------------------------------------------------
    def apply(self, step: ReceiveStep) -> tuple[dict[int, TransferFailed], dict[int, TransferRequest], list | None]:
        for request_id in step.free:
            self.pools.free(request_id)
        failed: dict[int, TransferFailed] = {}
        for request_id, num_tokens, params, source, blocks in step.receives:
            try:  # the same on every rank (same free blocks, same calls)
                self.pools.allocate(request_id, num_tokens)
            except BufferExhaustedError as exc:
                failed[request_id] = TransferFailed(f"{type(exc).__name__}: {exc}", started=False)
                continue
            if blocks:
                tokens = blocks * self.options.tokens_per_block
                self.pools.write_tokens(request_id, self.pools.read_tokens(source, tokens))
            request = TransferRequest(request_id, context_phase_params=params, reused_blocks=blocks)
            try:
                self.transceiver.request_and_receive_async(request)
            except Exception as exc:  # refused before any READ (undecodable params): this request only
                failed[request_id] = TransferFailed(f"{type(exc).__name__}: {exc}")
                self.pools.free(request_id)
                continue
            self._receiving[request_id] = request
            self._tokens[request_id] = num_tokens
        statuses = self.transceiver.check_gen_transfer_status(0)
        done: dict[int, TransferRequest] = {}
        pieces: dict[int, tuple[CachePiece, int]] = {}  # what this rank read, and its bytes
        for request_id in statuses.completed_request_ids | statuses.error_request_ids:
            request, num_tokens = self._receiving.pop(request_id), self._tokens.pop(request_id)
            done[request_id] = request
            if request.state is RequestState.GENERATION_TRANS_COMPLETE:
                pieces[request_id] = (read_piece(self.pools, request_id, num_tokens), request.transfer_bytes)
            else:
                self.pools.free(request_id)
        return failed, done, self.lockstep.gather(pieces)

    # --- rank 0: finish and decode --------------------------------------------------------------------------------
    def finish(self, outcome: tuple[dict[int, TransferFailed], dict[int, TransferRequest], list | None]) -> None:
        failed, done, gathered = outcome
        for request_id, error in failed.items():
            fail_future(self._jobs_by_id.pop(request_id).future, error)
        for request_id, request in done.items():
            job = self._jobs_by_id.pop(request_id)
            if request.state is not RequestState.GENERATION_TRANS_COMPLETE:
                fail_future(job.future, TransferFailed(request.error or "the transfer failed"))
                continue
            # a prompt not checked against its params is never matched: its blocks wait for eviction only
            self._held[request_id] = np.asarray(job.prompt) if job.verified else None
            per_rank = [pieces[request_id] for pieces in gathered]
            whole = join_pieces([piece for piece, _ in per_rank], self.state, self.geometry)
            cache = model_cache(whole, self.geometry, self.model.config)
            transfer_ms = (request.transfer_end - request.transfer_start) * 1e3
            moved = sum(nbytes for _, nbytes in per_rank)
            job.future.set_result(Received(request_id, moved, transfer_ms, request.reused_blocks))
            job.emit(job.first_token)
            self._decoding.append(_Decoding(job, cache, job.first_token))

    def in_flight(self) -> bool:
        return bool(self._receiving)

    def has_local_work(self) -> bool:
        return bool(self._decoding)

    @property
    def decoding(self) -> int:
        """Requests past their transfer, being decoded (for ``/health``)."""
        return len(self._decoding)

    def local_work(self) -> None:
        """One greedy token for every request being decoded (round robin keeps concurrent clients fair)."""
        still = []
        for entry in self._decoding:
            job = entry.job
            if job.cancelled or entry.produced >= job.max_tokens or entry.last_token == job.eos_token_id:
                job.emit(None)
                continue
            output = decode_step(self.model, entry.cache, entry.last_token, len(job.prompt) + entry.produced - 1)
            entry.last_token = int(output.logits[0, -1].argmax())
            entry.produced += 1
            job.emit(entry.last_token)
            still.append(entry)
        self._decoding = still

    def fail_all(self, error: BaseException) -> None:
        for job in self._jobs_by_id.values():
            fail_future(job.future, error)
        self._jobs_by_id.clear()
        for entry in self._decoding:
            entry.job.emit(error)  # a decoding cut short is a failure, never a finished completion
        self._decoding.clear()


def decode_step(model: torch.nn.Module, cache: object, token: int, position: int) -> object:
    """Feed one token at ``position``, as ``generate`` does: explicit positions, because a hybrid model's cache
    cannot tell its length from its first layer when that layer is a Mamba layer."""
    with torch.no_grad():
        return model(
            torch.tensor([[token]]),
            past_key_values=cache,
            use_cache=True,
            position_ids=torch.tensor([[position]]),
            cache_position=torch.tensor([position]),
            attention_mask=torch.ones((1, position + 1), dtype=torch.long),
        )
