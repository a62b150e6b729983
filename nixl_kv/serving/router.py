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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from nixl_kv.serving.gen_server import MAX_NEW_TOKENS
from nixl_kv.serving.http_common import add_common_routes

T = TypeVar("T")
DOWN_S = 5.0  # a server that could not be connected to is passed over this long


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

    down_until: dict[str, float] = field(default_factory=dict)

    def pick(self, exclude: set[str] = frozenset()) -> str | None:
        """None when every server not excluded is down (then the least recently failed is tried)."""
        start = next(self.turn)
        order = [self.urls[(start + i) % len(self.urls)] for i in range(len(self.urls))]
        order = [u for u in order if u not in exclude]
        now = time.monotonic()
        up = [u for u in order if self.down_until.get(u, 0) <= now]
        if not order:
            return None
        url = min(up, key=lambda u: self.in_flight.get(u, 0)) if up else min(order, key=self.down_until.get)
        self.in_flight[url] = self.in_flight.get(url, 0) + 1
        return url

    def mark_down(self, url: str) -> None:
        self.down_until[url] = time.monotonic() + DOWN_S

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
        prefilled, ctx_url = await _first_reachable(
            ctx, "ctx", lambda url: _call(client, url, "/prefill", {"prompt": prompt}, "ctx")
        )
        ctx.done(ctx_url)
        request = {
            "params": prefilled["params"],
            "prompt": prompt,
            "first_token": prefilled["first_token"],
            "max_tokens": body.max_tokens,
        }
        lines, gen_url = await _first_reachable(gen, "gen", lambda url: _open_stream(client, url, request))
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


class Unreachable(HTTPException):
    """The server could not be connected to: the request never reached it, so another may take it."""


async def _first_reachable(backends: Backends, role: str, call: Callable[[str], Awaitable[T]]) -> tuple[T, str]:
    """``call`` on the server with the fewest requests in flight; one that cannot be connected to is passed over
    for DOWN_S and the next is tried (the request never reached it). A server that fails once it has the request
    fails the request. The caller ends the server's in-flight count (``Backends.done``)."""
    tried: set[str] = set()
    while True:
        url = backends.pick(tried)
        if url is None:
            raise HTTPException(502, f"no {role} server could be reached (tried {', '.join(sorted(tried))})")
        try:
            return await call(url), url
        except Unreachable:
            backends.done(url)
            backends.mark_down(url)
            tried.add(url)
        except BaseException:
            backends.done(url)
            raise


async def _call(client: httpx.AsyncClient, base: str, path: str, payload: dict, role: str) -> dict:
    try:
        response = await client.post(base + path, json=payload)
    except httpx.ConnectError as exc:
        raise Unreachable(502, f"{role} server {base} cannot be reached: {exc}") from None
    except httpx.HTTPError as exc:
        raise HTTPException(502, f"{role} server {base} failed: {type(exc).__name__}: {exc}") from None
    if response.status_code >= 400:
        raise HTTPException(_passed_on(response.status_code), f"{role} server {base}: {_detail(response)}")
    return response.json()


async def _open_stream(client: httpx.AsyncClient, base: str, payload: dict) -> AsyncIterator[dict]:
    """Start the gen server's response; its status is known before any token is passed on."""
    try:
        response = await client.send(client.build_request("POST", base + "/generate", json=payload), stream=True)
    except httpx.ConnectError as exc:
        raise Unreachable(502, f"gen server {base} cannot be reached: {exc}") from None
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
