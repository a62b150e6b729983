"""Admit a request: the params' kind, size and seal, their decoding, the request's secret, and the ctx state (decoded
and checked once per state: its pools against its cache state); then, once it is planned, ``enter`` it: the pin
of our destination blocks and its place in the request table.

A request this rank cannot read fails as a whole before any byte moves, and its ctx ranks are told at once
(``refuse``).
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from typing import NoReturn

from nixl_kv import wire
from nixl_kv.errors import IncompatibleStateError, NixlKvError, TransferError
from nixl_kv.gen.side import GenSide, Incoming
from nixl_kv.params_seal import params_problem
from nixl_kv.pool_checks import kv_pool_problems
from nixl_kv.protocol import ReadDone
from nixl_kv.requests import TransferRequest
from nixl_kv.state import ContextPhaseParams, DataTransceiverState
from nixl_kv.topology import holds_request

MAX_RELEASE_NOTICES = 64  # ctx ranks told at once that a request was refused; the others release at their lease


class Admit:
    def __init__(self, side: GenSide, max_states: int) -> None:
        self._side = side
        self._max_states = max_states
        self._states: OrderedDict[bytes, tuple[DataTransceiverState, str]] = OrderedDict()  # state, its problem

    def admit(self, request: TransferRequest, future: Future) -> Incoming:
        """The request with its decoded params and ctx state, not yet planned nor pinned; raises NixlKvError when it
        cannot be read."""
        requests = self._side.requests
        if request.context_phase_params is None:
            raise TransferError(f"request {request.request_id} carries no ContextPhaseParams")
        problem = params_problem(request.context_phase_params)  # not bytes, too long, or damaged on the way
        if problem:
            raise TransferError(f"the ContextPhaseParams of request {request.request_id} {problem}")
        params = wire.decode(request.context_phase_params, ContextPhaseParams)
        if not params.secret:  # (nothing can tell its ctx side: a message without the secret is dropped there)
            raise TransferError(f"the params of request {request.request_id} carry no request secret")
        ctx_state, problem = self.decode_state(params.ctx_state)
        key = (ctx_state.instance_id, params.request_id)
        with requests.lock:
            if requests.known(key, request.request_id):  # a retry must not end the original
                raise TransferError(f"request {request.request_id} (ctx request {key}) is already being received")
        request.first_gen_tokens, request.draft_tokens = params.first_gen_tokens, params.draft_tokens
        request.num_tokens = params.num_tokens
        num_blocks = -(-params.num_tokens // ctx_state.cache.model.tokens_per_block)
        # the ctx side releases the blocks at the end of its lease: reading later cannot succeed
        request.transfer_deadline = deadline = request.transfer_start + params.lease_ms / 1000
        incoming = Incoming(key, request, ctx_state, num_blocks, deadline, future, secret=params.secret, params=params)
        if problem:
            self.refuse(incoming, IncompatibleStateError(problem))
        return incoming

    def enter(self, incoming: Incoming) -> None:
        """The planned request pinned and in the table, unless a retry of it got there first."""
        side, requests, request, key = self._side, self._side.requests, incoming.request, incoming.key
        peers = [pull.rank.agent_name for pull in incoming.pulls]
        side.peers.wanting(peers)  # (before it is in the table: ``finish.end`` may run at once, on another thread)
        try:
            with requests.lock:
                if requests.known(key, request.request_id):
                    raise TransferError(f"request {request.request_id} (ctx request {key}) is already being received")
                side.cache.pin(request.request_id)  # the destination blocks stay ours until the READs are over
                requests.add(incoming)
        except BaseException:
            side.peers.ended(peers)
            raise

    def refuse(self, incoming: Incoming, error: NixlKvError) -> NoReturn:
        """A request this rank cannot read fails as a whole: tell the ctx ranks holding it, so they release its
        blocks now rather than at the end of their lease (in the background: first contact takes a while)."""
        side, params, ctx_state = self._side, incoming.params, incoming.ctx_state
        ctx = ctx_state.cache.parallel
        holders = [
            ctx_state.comm.ranks[rank] for rank in range(ctx.world_size) if holds_request(ctx, rank, params.ctx_dp_rank)
        ]
        message = side.control.encode(
            ReadDone(
                ctx_instance_id=ctx_state.instance_id,
                request_id=params.request_id,
                transfer_id=0,
                reader_metadata=side.metadata,
                expected_readers=1,
                final=True,
                failed=True,
                reason=f"a gen rank cannot read the request: {error}"[:512],
            ),
            params.secret,
        )
        for rank in holders[:MAX_RELEASE_NOTICES]:  # (best effort: the ctx lease still ends the request)
            side.peers.when_loaded(rank, lambda name=rank.agent_name: side.agent.notify(name, message))
        raise error

    def decode_state(self, data: bytes) -> tuple[DataTransceiverState, str]:
        """A ctx state, decoded and checked once, and what is wrong with it ("" when nothing): a state whose ranks'
        KV pools contradict its cache state is refused before anything is planned from it."""
        lock = self._side.requests.lock
        with lock:
            known = self._states.get(data)
        if known is None:
            state = wire.decode(data, DataTransceiverState)
            problems = [
                f"ctx rank {rank}: {'; '.join(wrong)}"
                for rank, info in enumerate(state.comm.ranks)
                if (wrong := kv_pool_problems(info.layout, state.cache, rank))
            ]
            heading = "ctx KV pools do not match their share of the ctx cache state: "
            known = (state, heading + " | ".join(problems) if problems else "")
            with lock:
                self._states[data] = known
                while len(self._states) > self._max_states:
                    self._states.popitem(last=False)
        return known
