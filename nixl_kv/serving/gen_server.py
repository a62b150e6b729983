"""The decode server's HTTP side: ``POST /generate`` pulls a request's cache and streams its tokens.

A body is checked against its params before any READ (``binding``): the prompt and first token they were made for,
and not already used here. The response starts only once the transfer ended: a failed transfer is an HTTP error
(``error_status``), never a stream cut short. The body is one JSON object per line: ``{"token": id}`` for each
token (the ctx's first token included), then ``{"done": true, ...}`` with the transfer's figures, or, if decoding
stops early, ``{"error": message, "status": code, "tokens": count}`` in its place.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from nixl_kv.serving.binding import Refused, UsedParams, check_binding
from nixl_kv.serving.engine import EngineStopped
from nixl_kv.serving.gen_engine import GenEngine, Received, ReceiveJob, TransferFailed
from nixl_kv.serving.http_common import add_common_routes, error_status
from nixl_kv.serving.limits import (
    STRICT_CLOSED,
    Admission,
    ServerLimits,
    Ticket,
    check_prompt,
    check_tokens,
    in_flight_refusal,
)

MAX_NEW_TOKENS = 4096


class GenerateBody(BaseModel):
    model_config = STRICT_CLOSED
    params: str = Field(description="the ctx server's ContextPhaseParams, base64")
    prompt: list[int] = Field(min_length=1)
    first_token: int
    max_tokens: int = Field(ge=1, le=MAX_NEW_TOKENS)


def error_line(status: int, message: str, tokens: int) -> bytes:
    """The line that ends a stream whose decoding stopped early."""
    return json.dumps({"error": message, "status": status, "tokens": tokens}).encode() + b"\n"


def create_gen_app(engine: GenEngine, limits: ServerLimits | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    app = FastAPI(title="nixl_kv gen server")
    options, config = engine.options, engine.model.config
    eos = getattr(engine.model.generation_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    admission = Admission(limits.max_in_flight, in_flight_refusal("gen server", limits.max_in_flight))
    used = UsedParams()

    def describe() -> dict:
        return {
            "ranks": engine.lockstep.size,
            "model": options.model_dir,
            "max_prompt_tokens": options.max_prompt_tokens,
            "vocab_size": config.vocab_size,
            "in_flight": admission.count,
            "decoding": engine.decoding,
        }

    add_common_routes(app, "gen", lambda: engine.healthy, describe, limits.max_body_bytes)

    @app.post("/generate")
    async def generate(body: GenerateBody) -> StreamingResponse:
        check_prompt(body.prompt, config.vocab_size, options.max_prompt_tokens)
        check_tokens("first_token", [body.first_token], config.vocab_size)
        try:
            params = base64.b64decode(body.params, validate=True)
        except (binascii.Error, ValueError):
            raise HTTPException(400, "params: not base64") from None
        try:
            bound = check_binding(params, body.prompt, body.first_token)
            admission.check()  # before the claim: params refused for want of room stay good
            used.claim(bound)
        except Refused as exc:
            raise HTTPException(exc.status, str(exc)) from None
        ticket = admission.admit()  # (no await since the check: it cannot fail)
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[int | BaseException | None] = asyncio.Queue()
        job = ReceiveJob(
            params,
            body.prompt,
            body.first_token,
            body.max_tokens,
            lambda token: loop.call_soon_threadsafe(tokens.put_nowait, token),
            eos_token_id=eos,
            verified=True,
        )
        handed_on = False
        try:
            engine.submit(job)
            # the transfer ends by its own deadline; this one only guards against an engine that stopped answering
            waited_s = options.transfer_timeout_ms / 1000 + options.step_timeout_s
            received = await asyncio.wait_for(asyncio.wrap_future(job.future), waited_s)
            handed_on = True  # the stream's end releases the ticket
            lines = _lines(job, tokens, received, ticket, options.step_timeout_s)
            return StreamingResponse(lines, media_type="application/x-ndjson")
        except EngineStopped as exc:
            used.give_back(bound)  # never handed to the transceiver: the params are still good
            raise HTTPException(503, str(exc)) from None
        except TimeoutError:
            job.cancelled = True
            raise HTTPException(504, f"the transfer had no outcome within {waited_s:.0f} s") from None
        except TransferFailed as exc:
            if not exc.started:
                used.give_back(bound)
            raise HTTPException(error_status(str(exc)), str(exc)) from None
        finally:
            if not handed_on:
                ticket.release()

    return app


async def _lines(
    job: ReceiveJob, tokens: asyncio.Queue, received: Received, ticket: Ticket, step_timeout_s: float
) -> AsyncIterator[bytes]:
    """The response's lines; a decoding that stops early ends with an error line (500 for this server's own
    failure, 503 when it is stopping, 504 when no token came in time), never with the summary."""
    count = 0
    try:
        while True:
            try:
                token = await asyncio.wait_for(tokens.get(), step_timeout_s)
            except TimeoutError:
                yield error_line(504, f"decoding stopped: no token within {step_timeout_s:.0f} s", count)
                return
            if token is None:
                break
            if isinstance(token, BaseException):
                status = 503 if isinstance(token, EngineStopped) else 500
                yield error_line(status, f"decoding stopped: {type(token).__name__}: {token}", count)
                return
            count += 1
            yield json.dumps({"token": token}).encode() + b"\n"
        summary = {
            "done": True,
            "finish_reason": "length" if count >= job.max_tokens else "stop",
            "transfer_bytes": received.transfer_bytes,
            "transfer_ms": round(received.transfer_ms, 3),
            "reused_blocks": received.reused_blocks,
        }
        yield json.dumps(summary).encode() + b"\n"
    finally:
        job.cancelled = True  # a client that went away stops the decoding
        ticket.release()
