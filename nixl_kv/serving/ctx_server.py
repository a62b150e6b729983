"""The prefill server's HTTP side: ``POST /prefill`` runs a prompt and returns its ContextPhaseParams."""

from __future__ import annotations

import asyncio
import base64

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from nixl_kv.errors import BufferExhaustedError
from nixl_kv.serving.ctx_engine import CtxEngine, PrefillJob
from nixl_kv.serving.engine import EngineStopped
from nixl_kv.serving.http_common import add_common_routes


class PrefillBody(BaseModel):
    prompt: list[int] = Field(min_length=1, description="token ids")


def check_prompt(prompt: list[int], vocab_size: int, max_tokens: int) -> None:
    """422 for a prompt the model cannot take (the same check on both servers)."""
    if len(prompt) > max_tokens:
        raise HTTPException(422, f"the prompt has {len(prompt)} tokens; this server takes at most {max_tokens}")
    bad = [token for token in prompt if not 0 <= token < vocab_size]
    if bad:
        raise HTTPException(422, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def create_ctx_app(engine: CtxEngine) -> FastAPI:
    app = FastAPI(title="nixl_kv ctx server")
    vocab_size = engine.model.config.vocab_size
    state = base64.b64encode(engine.transceiver.get_serialized_data_transceiver_state()).decode()
    describe = {"ranks": engine.lockstep.size, "model": engine.options.model_dir, "transceiver_state": state}
    add_common_routes(app, "ctx", lambda: engine.healthy, lambda: describe)

    @app.post("/prefill")
    async def prefill(body: PrefillBody) -> dict:
        check_prompt(body.prompt, vocab_size, engine.options.max_prompt_tokens)
        job = PrefillJob(body.prompt)
        try:
            engine.submit(job)
            done = await asyncio.wait_for(asyncio.wrap_future(job.future), engine.options.step_timeout_s)
        except (EngineStopped, BufferExhaustedError) as exc:
            raise HTTPException(503, f"{type(exc).__name__}: {exc}") from None
        except TimeoutError:
            raise HTTPException(504, f"no prefill within {engine.options.step_timeout_s:.0f} s") from None
        return {
            "request_id": done.request_id,
            "first_token": done.first_token,
            "params": base64.b64encode(done.params).decode(),
            "prompt_tokens": len(body.prompt),
        }

    return app
