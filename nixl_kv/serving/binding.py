"""Params bound to what they were made for: the gen server checks a body against its params before any READ.

The ctx server seals into the params the digest of the prompt's token ids and the first token it decoded
(``ContextPhaseParams.prompt_digest``, ``first_gen_tokens``). A body with another prompt would be decoded over KV
of that other prompt, or over blocks nothing wrote, and prefix reuse would then hand those blocks to later
requests: such a body is refused with a 422 naming the field, and the params stay good for the right body. Params
that this server already took are refused with a 409 (``UsedParams``): a ctx request is read once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from nixl_kv import wire
from nixl_kv.errors import WireFormatError
from nixl_kv.params_seal import params_problem, prompt_digest
from nixl_kv.state import ContextPhaseParams

MAX_USED = 65_536  # params remembered as used; beyond it the oldest are forgotten (their ctx side refuses them)


class Refused(Exception):
    """A body the gen server will not take: ``status`` and a message that names the field."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class BoundParams:
    """Params that match their body; ``key`` (the request's secret) is unique to one ctx request."""

    key: bytes
    ctx_request_id: int
    lease_s: float


def check_binding(params: bytes, prompt: list[int], first_token: int) -> BoundParams:
    """The params, if they were made for this prompt and first token; else ``Refused`` (400 for params that are not
    intact, 422 for a body they were not made for)."""
    if problem := params_problem(params):  # (the gen side's one check: not bytes, too long, damaged)
        raise Refused(400, f"params: the ContextPhaseParams {problem}")
    try:
        decoded = wire.decode(params, ContextPhaseParams)
    except WireFormatError as exc:
        raise Refused(400, f"params: {exc}") from None
    if not decoded.prompt_digest or not decoded.first_gen_tokens:
        raise Refused(422, "params: they carry no prompt digest or first token, so no body can be checked against them")
    if decoded.num_tokens != len(prompt):
        raise Refused(
            422, f"prompt: {len(prompt)} tokens, but the params were made for a prompt of {decoded.num_tokens} tokens"
        )
    if decoded.prompt_digest != prompt_digest(prompt):
        raise Refused(422, f"prompt: not the prompt the params were made for (same length, {len(prompt)} tokens)")
    if decoded.first_gen_tokens[0] != first_token:
        raise Refused(422, f"first_token: {first_token}, but the params carry {decoded.first_gen_tokens[0]}")
    return BoundParams(decoded.secret, decoded.request_id, decoded.lease_ms / 1000)


@dataclass
class UsedParams:
    """The params this server took, each until its lease ends (its ctx side has released the blocks by then and
    refuses a reader itself); a second use is a 409. Params whose transfer never started can be given back."""

    capacity: int = MAX_USED
    _until: OrderedDict[bytes, float] = field(default_factory=OrderedDict)

    def claim(self, bound: BoundParams) -> None:
        now = time.monotonic()
        while self._until and (next(iter(self._until.values())) <= now or len(self._until) >= self.capacity):
            self._until.popitem(last=False)
        if bound.key in self._until:
            raise Refused(409, f"params: already used (ctx request {bound.ctx_request_id}); params are read once")
        self._until[bound.key] = now + bound.lease_s

    def give_back(self, bound: BoundParams) -> None:
        self._until.pop(bound.key, None)
