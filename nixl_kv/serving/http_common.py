"""What every server role answers the same way: ``/health``, ``/metrics``, a body limit, and errors as HTTP
statuses."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, HTTPException
from fastapi.responses import PlainTextResponse

from nixl_kv.serving.limits import BodyLimit

# The transceiver's error types (the first word of a failed transfer's message) and the HTTP status each becomes.
ERROR_STATUS = {
    "IncompatibleStateError": 409,  # the ctx and gen instances cannot exchange KV: the message names the difference
    "WireFormatError": 400,  # undecodable params
    "BufferExhaustedError": 503,  # no room now: retry later
    "NotSupportedError": 409,
}
DEADLINE_WORDS = ("deadline", "timed out", "timeout")
# the ctx side no longer holds the request: its params were already read (by another gen server), or its lease ended
CONFLICT_WORDS = ("is not pinned here",)
BAD_PARAMS_WORDS = ("ContextPhaseParams",)  # params that fail their checksum or are missing: the caller's bytes


def error_status(message: str) -> int:
    """The HTTP status for a request that failed with this transceiver message (502 when a peer failed)."""
    status = ERROR_STATUS.get(message.split(":", 1)[0].strip())
    if status is not None:
        return status
    if any(word in message for word in BAD_PARAMS_WORDS):
        return 400
    if any(word in message for word in CONFLICT_WORDS):
        return 409
    return 504 if any(word in message.lower() for word in DEADLINE_WORDS) else 502


def passed_on(status: int) -> int:
    """A server's 4xx is the client's fault and passes on as it is; a 5xx is the router's upstream failing (502),
    but for 503 (full: retry later) and 504 (a deadline)."""
    return status if status < 500 or status in (503, 504) else 502


def add_common_routes(
    app: FastAPI, role: str, healthy: Callable[[], bool], describe: Callable[[], dict], max_body_bytes: int
) -> None:
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.get("/health")
    def health() -> dict:
        if not healthy():
            raise HTTPException(503, f"the {role} server is not serving")
        return {"status": "ok", "role": role, **describe()}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        from prometheus_client import REGISTRY, generate_latest

        return generate_latest(REGISTRY).decode()
