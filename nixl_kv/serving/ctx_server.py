"""The prefill server's HTTP side: ``POST /prefill`` runs a prompt and returns its ContextPhaseParams.

Every request it answers pins blocks until a gen server pulls them or their lease ends, so it holds at most
``max_unpulled`` such requests (prefills in flight included) and refuses the next at once with a 503: a client
that prefills without ever decoding cannot fill the pools for the lease.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from nixl_kv.errors import BufferExhaustedError
from nixl_kv.serving.ctx_engine import CtxEngine, PrefillJob
from nixl_kv.serving.engine import EngineStopped
from nixl_kv.serving.http_common import add_common_routes
from nixl_kv.serving.limits import STRICT_CLOSED, Admission, ServerLimits, check_prompt, in_flight_refusal


class PrefillBody(BaseModel):
    model_config = STRICT_CLOSED
    prompt: list[int] = Field(min_length=1, description="token ids")


def create_ctx_app(engine: CtxEngine, limits: ServerLimits | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    app = FastAPI(title="nixl_kv ctx server")
    vocab_size, options = engine.model.config.vocab_size, engine.options
    state = base64.b64encode(engine.transceiver.get_serialized_data_transceiver_state()).decode()
    prefills = Admission(limits.max_in_flight, in_flight_refusal("ctx server", limits.max_in_flight))
    unpulled = Admission(limits.max_unpulled, _unpulled_refusal(limits.max_unpulled, options.lease_ms))
    unpulled.held = lambda: engine.unpulled + prefills.count

    def describe() -> dict:
        return {
            "ranks": engine.lockstep.size,
            "model": options.model_dir,
            "max_prompt_tokens": options.max_prompt_tokens,
            "vocab_size": vocab_size,
            "in_flight": prefills.count,
            "unpulled": engine.unpulled,
            "transceiver_state": state,
        }

    add_common_routes(app, "ctx", lambda: engine.healthy, describe, limits.max_body_bytes)

    @app.post("/prefill")
    async def prefill(body: PrefillBody) -> dict:
        check_prompt(body.prompt, vocab_size, options.max_prompt_tokens)
        unpulled.check()  # counted by the prefill's ticket, then by the engine until it is pulled
        ticket = prefills.admit()
        job = PrefillJob(body.prompt)
        try:
            engine.submit(job)
            done = await asyncio.wait_for(asyncio.wrap_future(job.future), options.step_timeout_s)
        except (EngineStopped, BufferExhaustedError) as exc:
            raise HTTPException(503, f"{type(exc).__name__}: {exc}") from None
        except TimeoutError:
            raise HTTPException(504, f"no prefill within {options.step_timeout_s:.0f} s") from None
        finally:
            ticket.release()
        return {
            "request_id": done.request_id,
            "first_token": done.first_token,
            "params": base64.b64encode(done.params).decode(),
            "prompt_tokens": len(body.prompt),
        }

    return app


def _unpulled_refusal(limit: int, lease_ms: int) -> Callable[[int], str]:
    def refusal(taken: int) -> str:
        return (
            f"the ctx server holds {taken} requests whose params were handed out and not yet pulled; at most {limit} "
            f"(--max-unpulled): each is freed when a gen server pulls it or at its {lease_ms} ms lease"
        )

    return refusal
