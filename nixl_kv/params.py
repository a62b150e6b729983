"""Making a request's ContextPhaseParams: what the ctx side hands the router.

The sender makes them when it responds. An engine whose scheduler hands the params out while its workers pin the
blocks (vLLM: the scheduler's ``request_finished`` returns them, a worker responds) builds the very same params from
the same inputs with a ``ParamsMaker`` it took from a worker (``CacheTransceiver.params_maker``). It is plain data,
picklable, and needs no agent. It carries the instance's private key for request secrets: it must stay inside the
instance (the engine's own processes), as the key does.
"""

from __future__ import annotations

from dataclasses import dataclass

from nixl_kv.auth import request_secret
from nixl_kv.params_seal import encode_params
from nixl_kv.state import ContextPhaseParams


@dataclass(frozen=True)
class ParamsMaker:
    serialized_state: bytes
    lease_ms: int
    dp_rank: int
    rank: int
    auth_key: bytes

    def secret(self, request_id: int) -> bytes:
        return request_secret(self.auth_key, request_id)

    def make(
        self,
        request_id: int,
        block_ids_per_cp: tuple[tuple[int, ...], ...],
        num_tokens: int,
        first_gen_tokens: tuple[int, ...] = (),
        draft_tokens: tuple[int, ...] | None = None,
        *,
        layerwise: bool = False,
        rnn_slot: int | None = None,
        masked_promise: int = 0,
        prompt_digest: bytes = b"",
    ) -> bytes:
        """The sealed params; ``masked_promise`` 0 means no hold promise (readers ask the ctx for a verdict)."""
        params = ContextPhaseParams(
            request_id=request_id,
            ctx_state=self.serialized_state,
            block_ids=block_ids_per_cp,
            num_tokens=num_tokens,
            lease_ms=self.lease_ms,
            ctx_dp_rank=self.dp_rank,
            first_gen_tokens=first_gen_tokens,
            draft_tokens=draft_tokens,
            layerwise=layerwise,
            rnn_slot=rnn_slot,
            ctx_rank=self.rank,
            masked_promise=masked_promise,
            secret=self.secret(request_id),
            prompt_digest=prompt_digest,
        )
        return encode_params(params)
