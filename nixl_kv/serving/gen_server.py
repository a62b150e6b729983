"""The decode server's HTTP side: ``POST /generate`` pulls a request's cache and streams its tokens.

The response starts only once the transfer ended: a failed transfer is an HTTP error (``error_status``), never a
stream cut short. The body is one JSON object per line: ``{"token": id}`` for each token (the ctx's first token
included), then ``{"done": true, ...}`` with the transfer's figures.
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

from nixl_kv.serving.ctx_server import check_prompt
from nixl_kv.serving.engine import EngineStopped
from nixl_kv.serving.gen_engine import GenEngine, ReceiveJob, TransferFailed
from nixl_kv.serving.http_common import add_common_routes, error_status

MAX_NEW_TOKENS = 4096


class GenerateBody(BaseModel):
    params: str = Field(description="the ctx server's ContextPhaseParams, base64")
    prompt: list[int] = Field(min_length=1)
    first_token: int = Field(ge=0)
    max_tokens: int = Field(ge=1, le=MAX_NEW_TOKENS)


def create_gen_app(engine: GenEngine) -> FastAPI:
    app = FastAPI(title="nixl_kv gen server")
    config = engine.model.config
    eos = getattr(engine.model.generation_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    describe = {"ranks": engine.lockstep.size, "model": engine.options.model_dir}
    add_common_routes(app, "gen", lambda: engine.healthy, lambda: describe)

    @app.post("/generate")
    async def generate(body: GenerateBody) -> StreamingResponse:
        check_prompt([*body.prompt, body.first_token], config.vocab_size, engine.options.max_prompt_tokens + 1)
        try:
            params = base64.b64decode(body.params, validate=True)
        except (binascii.Error, ValueError):
            raise HTTPException(400, "params: not base64") from None
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue[int | None] = asyncio.Queue()
        job = ReceiveJob(
            params,
            body.prompt,
            body.first_token,
            body.max_tokens,
            lambda token: loop.call_soon_threadsafe(tokens.put_nowait, token),
            eos_token_id=eos,
        )
        try:
            engine.submit(job)
            # the transfer ends by its own deadline; this one only guards against an engine that stopped answering
            waited_s = engine.options.transfer_timeout_ms / 1000 + engine.options.step_timeout_s
            received = await asyncio.wait_for(asyncio.wrap_future(job.future), waited_s)
        except EngineStopped as exc:
            raise HTTPException(503, str(exc)) from None
        except TimeoutError:
            job.cancelled = True
            raise HTTPException(504, f"the transfer had no outcome within {waited_s:.0f} s") from None
        except TransferFailed as exc:
            raise HTTPException(error_status(str(exc)), str(exc)) from None

        async def lines() -> AsyncIterator[bytes]:
            count = 0
            try:
                while (token := await asyncio.wait_for(tokens.get(), engine.options.step_timeout_s)) is not None:
                    count += 1
                    yield json.dumps({"token": token}).encode() + b"\n"
                finish = "length" if count >= body.max_tokens else "stop"
                summary = {
                    "done": True,
                    "finish_reason": finish,
                    "transfer_bytes": received.transfer_bytes,
                    "transfer_ms": round(received.transfer_ms, 3),
                    "reused_blocks": received.reused_blocks,
                }
                yield json.dumps(summary).encode() + b"\n"
            finally:
                job.cancelled = True  # a client that went away stops the decoding

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app
