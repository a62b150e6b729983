"""A request as the transceiver sees it, and the states it moves through (the reference's LlmRequestState)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestState(str, Enum):
    CONTEXT_INIT = "context_init"
    CONTEXT_TRANS_IN_PROGRESS = "context_trans_in_progress"
    CONTEXT_INIT_AND_TRANS = "context_init_and_trans"
    CONTEXT_COMPLETE = "context_complete"
    GENERATION_INIT = "generation_init"
    GENERATION_TRANS_IN_PROGRESS = "generation_trans_in_progress"
    GENERATION_TRANS_COMPLETE = "generation_trans_complete"
    TRANS_ERROR = "trans_error"

    @property
    def terminal(self) -> bool:
        return self in (
            RequestState.CONTEXT_COMPLETE,
            RequestState.GENERATION_TRANS_COMPLETE,
            RequestState.TRANS_ERROR,
        )


@dataclass
class TransferRequest:
    """One request on one side.

    ctx side: ``request_id`` and ``num_tokens`` in, ``context_phase_params`` out.
    gen side: ``request_id`` (the gen server's own) and ``context_phase_params`` (bytes from the router) in;
    ``reused_blocks``: how many leading blocks the gen side already holds (prefix reuse), which do not move.
    """

    request_id: int
    num_tokens: int = 0
    context_phase_params: bytes | None = None
    first_gen_tokens: tuple[int, ...] = ()
    draft_tokens: tuple[int, ...] | None = None
    prompt_digest: bytes = b""  # ctx side: the prompt's digest, carried in the params (params_seal.prompt_digest)
    reused_blocks: int = 0
    state: RequestState = RequestState.CONTEXT_INIT
    error: str | None = None
    transfer_start: float = 0.0
    transfer_deadline: float = 0.0  # monotonic; the transfer ends (in error if need be) by then
    transfer_end: float = 0.0
    transfer_bytes: int = 0

    def fail(self, error: str) -> None:
        self.state, self.error = RequestState.TRANS_ERROR, error


@dataclass
class RequestStatuses:
    """What a status check decided: ids that completed and ids that ended in error."""

    completed_request_ids: set[int] = field(default_factory=set)
    error_request_ids: set[int] = field(default_factory=set)
