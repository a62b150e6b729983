"""The scheduler side: which requests move, the params ``request_finished`` returns, and each step's metadata.

ctx (``kv_transfer_params {"do_remote_decode": true}``): in the step whose forward completes the prompt, the
worker is told to respond after it, so the blocks are pinned before ``request_finished`` returns the params, made
from the same inputs with the worker's ``ParamsMaker``. The blocks stay with the connector until the worker reports
the request sent (its readers are done, or its lease ended).
gen (``{"do_remote_prefill": true, "nixl_kv_params": ...}``, as the ctx returned them): the prompt's tokens not
already in the prefix cache are loaded asynchronously into the blocks vLLM allocates for them.
Hybrid models (``groups.CacheGroups``): the request's Mamba state slot moves with its blocks, and the prefill stops
one token short of the prompt (``on_new_request``), whose last token the decode computes on the state before it.
"""

from __future__ import annotations

import base64
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from nixl_kv import wire
from nixl_kv.errors import WireFormatError
from nixl_kv.params import ParamsMaker
from nixl_kv.params_seal import params_problem, prompt_digest
from nixl_kv.state import ContextPhaseParams
from nixl_kv.vllm.groups import CacheGroups
from nixl_kv.vllm.metadata import Receive, Respond, StepMetadata

log = logging.getLogger(__name__)

PARAMS_KEY = "nixl_kv_params"  # in kv_transfer_params: the sealed ContextPhaseParams, base64


@dataclass
class _Prefill:
    request: Any  # vllm.v1.request.Request
    request_id: int = 0  # ours, once responded
    block_ids: tuple[int, ...] = ()
    slot: int | None = None


class SchedulerSide:
    def __init__(self, groups: CacheGroups) -> None:
        self._groups = groups
        self._block_size = groups.block_size
        self._ids = itertools.count(1)
        self._maker: ParamsMaker | None = None
        self._prefills: dict[str, _Prefill] = {}  # ctx: requests whose KV a decode instance will pull
        self._step = StepMetadata()
        self._loading: set[str] = set()  # gen: pulls in flight
        self._refusals: dict[str, str | None] = {}  # gen: params checked once per request (why not, or None)

    def set_maker(self, maker: ParamsMaker) -> None:
        self._maker = maker

    # --- gen ---------------------------------------------------------------------------------------------------
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or PARAMS_KEY not in params:
            return 0, False
        count = self._loaded(request) - num_computed_tokens
        if count <= 0 or self._refusal(request, params) is not None:
            return 0, False  # nothing to pull, or computed here instead (update_state_after_alloc says why)
        return count, True

    def _loaded(self, request: Any) -> int:
        """The prompt tokens a pull brings: all, or for a hybrid or a sliding window all but the last (the
        prefill's ``backoff``; a prompt of no more tokens than that is computed here)."""
        return request.num_prompt_tokens - self._groups.backoff

    def after_alloc(self, request: Any, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):  # again after a preemption: a response already made stands
            self._prefills.setdefault(request.request_id, _Prefill(request))
            return
        if not params.get("do_remote_prefill") or PARAMS_KEY not in params:
            return
        params["do_remote_prefill"] = False  # one pull per request
        if self._loaded(request) < 1:
            return
        refusal = self._refusal(request, params)
        self._refusals.pop(request.request_id, None)
        if refusal is not None:
            log.warning("nixl_kv: request %s computes its prompt here: %s", request.request_id, refusal)
            return
        if num_external_tokens == 0:  # the whole prompt was a local prefix hit: the ctx's lease frees its blocks
            return
        loaded = self._loaded(request)
        try:
            slot = self._groups.slot(block_ids)
        except ValueError as exc:  # vLLM computes the prompt here: report the (empty) load as failed
            log.warning("nixl_kv: request %s computes its prompt here: %s", request.request_id, exc)
            return
        kv_blocks = self._groups.kv_blocks(block_ids)[: -(-loaded // self._block_size)]
        # held here already: the prefix cache's, and a sliding window's null blocks (nothing is kept before it)
        reused = max((loaded - num_external_tokens) // self._block_size, self._groups.leading_nulls(kv_blocks))
        self._step.receive.append(
            Receive(
                request_id=next(self._ids),
                vllm_id=request.request_id,
                params=base64.b64decode(params[PARAMS_KEY]),
                block_ids=tuple(kv_blocks),
                reused_blocks=reused,
                slot=slot,
                num_tokens=loaded,
            )
        )
        self._loading.add(request.request_id)

    def _refusal(self, request: Any, params: dict[str, Any]) -> str | None:
        if request.request_id not in self._refusals:
            prompt = request.prompt_token_ids
            loaded = prompt[: self._loaded(request)] if prompt is not None else None
            self._refusals[request.request_id] = _refusal(params[PARAMS_KEY], loaded)
        return self._refusals[request.request_id]

    def received(self, vllm_ids: set[str]) -> None:
        self._loading -= vllm_ids

    # --- ctx ---------------------------------------------------------------------------------------------------
    def plan_responses(self, num_scheduled_tokens: dict[str, int], blocks_of: Any) -> None:
        """Requests whose prompt this step completes are responded to after its forward."""
        for vllm_id, prefill in self._prefills.items():
            if prefill.request_id or vllm_id not in num_scheduled_tokens:
                continue
            request = prefill.request
            if request.num_computed_tokens + num_scheduled_tokens[vllm_id] < request.num_prompt_tokens:
                continue  # a chunk of a longer prompt
            needed = -(-request.num_prompt_tokens // self._block_size)
            block_ids = blocks_of(vllm_id)
            prefill.request_id = next(self._ids)
            prefill.block_ids = tuple(self._groups.kv_blocks(block_ids)[:needed])
            prefill.slot = self._groups.slot(block_ids)
            self._step.respond.append(
                Respond(prefill.request_id, vllm_id, prefill.block_ids, request.num_prompt_tokens, prefill.slot)
            )

    def on_new_request(self, request: Any) -> None:
        """ctx, hybrid and sliding-window models: the prompt stops ``backoff`` tokens short, so the Mamba state
        handed over is the one before the prompt's last token, which the decode computes (as vLLM's NixlConnector
        does for Mamba); ``CacheGroups.backoff`` says why a sliding window needs it too."""
        params, backoff = request.kv_transfer_params, self._groups.backoff
        if not backoff or not params or not params.get("do_remote_decode") or params.get("_nixl_kv_truncated"):
            return
        if request.prompt_token_ids is None or request.num_prompt_tokens <= backoff:
            return
        del request.prompt_token_ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        params["_nixl_kv_truncated"] = True

    def finished(self, request: Any, completed: bool) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: (keep the blocks until the worker reports them sent, the kv_transfer_params)."""
        vllm_id = request.request_id
        self._refusals.pop(vllm_id, None)
        if vllm_id in self._loading:  # gen: a READ may still land in its blocks; the worker ends it first
            self._step.cancel.append(vllm_id)
            return True, None
        prefill = self._prefills.pop(vllm_id, None)
        if prefill is None:
            return False, None
        if not prefill.request_id:
            return False, None  # its prompt never completed: nothing was pinned
        if not completed or self._maker is None:
            self._step.withdrawn.append(vllm_id)
            return False, None
        prompt = request.prompt_token_ids
        params = self._maker.make(
            prefill.request_id,
            (prefill.block_ids,),
            request.num_prompt_tokens,
            tuple(request.output_token_ids[:1]),
            rnn_slot=prefill.slot,
            prompt_digest=prompt_digest(prompt),
        )
        self._step.handed_out.append(vllm_id)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAMS_KEY: base64.b64encode(params).decode("ascii"),
            "remote_num_tokens": request.num_prompt_tokens,
        }

    # --- both ----------------------------------------------------------------------------------------------------
    def take_step(self) -> StepMetadata:
        step, self._step = self._step, StepMetadata()
        return step


def _refusal(encoded: object, prompt: list[int] | None) -> str | None:
    """Why these params cannot be pulled for this prompt (None: they can): checked before anything is allocated."""
    if not isinstance(encoded, str):
        return f"{PARAMS_KEY} must be a base64 string"
    try:
        data = base64.b64decode(encoded, validate=True)
    except ValueError:
        return f"{PARAMS_KEY} is not base64"
    problem = params_problem(data)  # the one rule a gen applies (too long, damaged): the same words
    if problem:
        return f"{PARAMS_KEY} {problem}"
    try:
        params = wire.decode(data, ContextPhaseParams)
    except WireFormatError as exc:
        return f"{PARAMS_KEY}: {exc}"
    if prompt is None or params.num_tokens != len(prompt):
        return f"the params are for {params.num_tokens} prompt tokens, the request has {len(prompt or ())}"
    if params.prompt_digest and params.prompt_digest != prompt_digest(prompt):
        return "the params were made for another prompt"
    return None
