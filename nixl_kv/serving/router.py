"""The router: an OpenAI-style ``/v1/completions`` over ctx and gen instances.

A prompt (token ids, or text through the byte-level tokenizer: one id per UTF-8 byte) goes to the ctx instance
with the fewest requests in flight; its params go to the gen instance chosen the same way, whose tokens come
back, whole or as server-sent events. Both hops happen before the response starts, so any failure is an HTTP
status: 4xx as the server said it, 409 for an incompatible pair, 502/504 when a server or its transfer failed.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from nixl_kv.serving.gen_server import MAX_NEW_TOKENS
from nixl_kv.serving.http_common import add_common_routes


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_tokens(tokens: list[int]) -> str:
    return bytes(token for token in tokens if token < 256).decode("utf-8", errors="replace")


class CompletionBody(BaseModel):
    prompt: list[int] | str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=MAX_NEW_TOKENS)
    stream: bool = False
    model: str | None = None


@dataclass
class Backends:
    """Servers of one role; ``pick`` takes the one with the fewest requests in flight (ties in turn)."""

    urls: list[str]
    in_flight: dict[str, int] = field(default_factory=dict)
    turn: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> str:
        start = next(self.turn)
        order = [self.urls[(start + i) % len(self.urls)] for i in range(len(self.urls))]
        url = min(order, key=lambda u: self.in_flight.get(u, 0))
        self.in_flight[url] = self.in_flight.get(url, 0) + 1
        return url

    def done(self, url: str) -> None:
        self.in_flight[url] -= 1


def create_router_app(ctx_urls: list[str], gen_urls: list[str], timeout_s: float = 60.0) -> FastAPI:
    app = FastAPI(title="nixl_kv router")
    ctx, gen = Backends(list(ctx_urls)), Backends(list(gen_urls))
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
    add_common_routes(app, "router", lambda: True, lambda: {"ctx": ctx.urls, "gen": gen.urls})

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> object:
        prompt = encode_text(body.prompt) if isinstance(body.prompt, str) else body.prompt
        started = time.perf_counter()
        ctx_url = ctx.pick()
        try:
            prefilled = await _call(client, ctx_url, "/prefill", {"prompt": prompt}, "ctx")
        finally:
            ctx.done(ctx_url)
        gen_url = gen.pick()
        request = {
            "params": prefilled["params"],
            "prompt": prompt,
            "first_token": prefilled["first_token"],
            "max_tokens": body.max_tokens,
        }
        try:
            lines = await _open_stream(client, gen_url, request)
        except BaseException:
            gen.done(gen_url)
            raise
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(
                _events(lines, completion_id, lambda: gen.done(gen_url)), media_type="text/event-stream"
            )
        try:
            tokens, summary = [], {}
            async for line in lines:
                if "token" in line:
                    tokens.append(line["token"])
                else:
                    summary = line
        finally:
            gen.done(gen_url)
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or "nixl_kv",
            "choices": [
                {
                    "index": 0,
                    "text": decode_tokens(tokens),
                    "token_ids": tokens,
                    "finish_reason": summary.get("finish_reason", "stop"),
                }
            ],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens)},
            "nixl_kv": {
                "ctx": ctx_url,
                "gen": gen_url,
                "seconds": round(time.perf_counter() - started, 6),
                **_figures(summary),
            },
        }

    @app.on_event("shutdown")
    async def close_client() -> None:
        await client.aclose()

    return app


async def _call(client: httpx.AsyncClient, base: str, path: str, payload: dict, role: str) -> dict:
    try:
        response = await client.post(base + path, json=payload)
    except httpx.HTTPError as exc:
        raise HTTPException(502, f"{role} server {base} failed: {type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        raise HTTPException(_passed_on(response.status_code), f"{role} server {base}: {_detail(response)}")
    return response.json()


async def _open_stream(client: httpx.AsyncClient, base: str, payload: dict) -> AsyncIterator[dict]:
    """Start the gen server's response; its status is known before any token is passed on."""
    try:
        response = await client.send(client.build_request("POST", base + "/generate", json=payload), stream=True)
    except httpx.HTTPError as exc:
        raise HTTPException(502, f"gen server {base} failed: {type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        await response.aread()
        await response.aclose()
        raise HTTPException(_passed_on(response.status_code), f"gen server {base}: {_detail(response)}")

    async def lines() -> AsyncIterator[dict]:
        try:
            async for line in response.aiter_lines():
                if line:
                    yield json.loads(line)
        except httpx.HTTPError as exc:
            yield {"error": f"gen server {base} failed mid-stream: {type(exc).__name__}: {exc}"}
        finally:
            await response.aclose()

    return lines()


async def _events(lines: AsyncIterator[dict], completion_id: str, on_end: object) -> AsyncIterator[bytes]:
    try:
        async for line in lines:
            if "token" in line:
                choice = {"index": 0, "text": decode_tokens([line["token"]]), "token_ids": [line["token"]]}
                event = {
                    "id": completion_id,
                    "object": "text_completion",
                    "choices": [{**choice, "finish_reason": None}],
                }
            elif "error" in line:
                event = {"id": completion_id, "error": line["error"]}
            else:
                choice = {"index": 0, "text": "", "token_ids": [], "finish_reason": line.get("finish_reason")}
                event = {
                    "id": completion_id,
                    "object": "text_completion",
                    "choices": [choice],
                    "nixl_kv": _figures(line),
                }
            yield f"data: {json.dumps(event)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        on_end()


def _figures(summary: dict) -> dict:
    """The transfer's figures from the gen server's last line."""
    return {k: summary[k] for k in ("transfer_bytes", "transfer_ms", "reused_blocks") if k in summary}


def _passed_on(status: int) -> int:
    """A server's 4xx is the client's fault and passes on as it is; a 5xx is the router's upstream failing."""
    return status if status < 500 or status in (503, 504) else 502


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json().get("detail", response.text))
    except ValueError:
        return response.text
