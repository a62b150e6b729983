"""The router: an OpenAI-style ``/v1/completions`` over ctx and gen instances.

A prompt (token ids, or text through the byte-level tokenizer: one id per UTF-8 byte) is checked against the
longest prompt its servers take (their ``/health``), then goes to the ctx instance with the fewest requests in
flight; its params go to the gen instance chosen the same way, whose tokens come back, whole or as server-sent
events (``completions``). Both hops happen before the response starts, so any failure up to the first token is an
HTTP status: 4xx as the server said it, 409 for an incompatible pair or used params, 502/504 when a server or its
transfer failed, 503 when one is full. A failure after it is never a success: a 502 (non-streamed) or an error
event without ``data: [DONE]`` (streamed).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse

from nixl_kv.serving.completions import Completion, CompletionBody, decode_tokens, encode_text
from nixl_kv.serving.http_common import add_common_routes, passed_on
from nixl_kv.serving.limits import Admission, PromptLimit, ServerLimits, in_flight_refusal

__all__ = ["Backends", "Unreachable", "create_router_app", "decode_tokens", "encode_text"]

T = TypeVar("T")
DOWN_S = 5.0  # a server that could not be connected to is passed over this long
NO_SUMMARY = "the stream ended without its summary line"


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


def create_router_app(
    ctx_urls: list[str], gen_urls: list[str], timeout_s: float = 60.0, limits: ServerLimits | None = None
) -> FastAPI:
    limits = limits or ServerLimits()
    app = FastAPI(title="nixl_kv router")
    ctx, gen = Backends(list(ctx_urls)), Backends(list(gen_urls))
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
    prompt_limit = PromptLimit([*ctx.urls, *gen.urls])
    admission = Admission(limits.max_in_flight, in_flight_refusal("router", limits.max_in_flight))
    describe = lambda: {"ctx": ctx.urls, "gen": gen.urls, "in_flight": admission.count}  # noqa: E731
    add_common_routes(app, "router", lambda: True, describe, limits.max_body_bytes)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> object:
        prompt = encode_text(body.prompt) if isinstance(body.prompt, str) else body.prompt
        longest = await prompt_limit.get(client)
        if longest is not None and len(prompt) > longest:
            raise HTTPException(
                422,
                f"the prompt has {len(prompt)} tokens; the model takes at most {longest} "
                "(the least max_prompt_tokens of the ctx and gen servers)",
            )
        ticket = admission.admit()
        streaming = False
        try:
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
            completion = Completion(len(prompt), body.max_tokens, body.model or "nixl_kv", ctx_url, gen_url)
            if body.stream:
                streaming = True
                events = _events(lines, completion, lambda: (gen.done(gen_url), ticket.release()))
                return StreamingResponse(events, media_type="text/event-stream")
            try:
                return completion.response(await _collect(lines, completion))
            finally:
                gen.done(gen_url)
        finally:
            if not streaming:
                ticket.release()

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
            yield {"error": f"the stream broke: {type(exc).__name__}: {exc or 'connection lost'}", "status": 502}
        except ValueError:
            yield {"error": "the stream carried a line that is not JSON", "status": 502}
        finally:
            await response.aclose()

    return lines()


async def _collect(lines: AsyncIterator[dict], completion: Completion) -> dict:
    """Every token of a non-streamed completion, and the summary; GenFailed unless the stream ended in it."""
    async with contextlib.aclosing(lines):
        async for line in lines:
            summary = completion.take(line)
            if summary is not None:
                return summary
    raise completion.failure(502, NO_SUMMARY)


async def _events(
    lines: AsyncIterator[dict], completion: Completion, on_end: Callable[[], object]
) -> AsyncIterator[bytes]:
    """The server-sent events: a token each, then the finish reason and ``data: [DONE]``, or an error event."""
    try:
        async with contextlib.aclosing(lines):
            async for line in lines:
                try:
                    summary = completion.take(line)
                except HTTPException as failure:
                    yield completion.error_event(failure)
                    return
                if summary is not None:
                    yield completion.summary_event(summary)
                    return
                yield completion.token_event(completion.tokens[-1])
        yield completion.error_event(completion.failure(502, NO_SUMMARY))
    finally:
        on_end()


_passed_on = passed_on  # (its old name)


def _detail(response: httpx.Response) -> str:
    try:
        answer = response.json()
    except ValueError:
        return response.text
    return str(answer.get("detail", response.text)) if isinstance(answer, dict) else response.text
