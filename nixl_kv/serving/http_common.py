"""What every server role answers the same way: ``/health``, ``/metrics``, and errors as HTTP statuses."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, HTTPException
from fastapi.responses import PlainTextResponse

# The transceiver's error types (the first word of a failed transfer's message) and the HTTP status each becomes.
ERROR_STATUS = {
    "IncompatibleStateError": 409,  # the ctx and gen instances cannot exchange KV: the message names the difference
    "WireFormatError": 400,  # undecodable params
    "BufferExhaustedError": 503,  # no room now: retry later
    "NotSupportedError": 409,
}
DEADLINE_WORDS = ("deadline", "timed out", "timeout")
BAD_PARAMS_WORDS = ("ContextPhaseParams",)  # params that fail their checksum or are missing: the caller's bytes


def error_status(message: str) -> int:
    """The HTTP status for a request that failed with this transceiver message (502 when a peer failed)."""
    status = ERROR_STATUS.get(message.split(":", 1)[0].strip())
    if status is not None:
        return status
    if any(word in message for word in BAD_PARAMS_WORDS):
        return 400
    return 504 if any(word in message.lower() for word in DEADLINE_WORDS) else 502


def add_common_routes(app: FastAPI, role: str, healthy: Callable[[], bool], describe: Callable[[], dict]) -> None:
    @app.get("/health")
    def health() -> dict:
        if not healthy():
            raise HTTPException(503, f"the {role} server is not serving")
        return {"status": "ok", "role": role, **describe()}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        from prometheus_client import REGISTRY, generate_latest

        return generate_latest(REGISTRY).decode()
