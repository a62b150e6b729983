"""Limits at the edge of every server: body size, prompt length and vocabulary, and requests held at once.

Each is checked before the request costs anything (a parse, a prefill, a pinned block), and a request over one is
refused at once with the status that says why, never queued: a queue would hide the overload from the router and
the client, and a body or prompt over the limit would be paid for before it is refused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import HTTPException
from fastapi.responses import JSONResponse
from pydantic import ConfigDict

STRICT = ConfigDict(strict=True)  # no coercion: "7" is not 7, true is not 1, "yes" is not true
STRICT_CLOSED = ConfigDict(strict=True, extra="forbid")  # the servers' own bodies: an unknown field is a mistake
MAX_BODY_BYTES = 1 << 20
MAX_IN_FLIGHT = 64
MAX_UNPULLED = 256
ASK_AGAIN_S = 5.0  # a server whose /health did not answer is asked again after this long


@dataclass(frozen=True)
class ServerLimits:
    """One server's limits (``nixl-kv serve`` flags of the same names)."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_in_flight: int = MAX_IN_FLIGHT  # requests being served at once
    max_unpulled: int = MAX_UNPULLED  # ctx: params handed out and not yet pulled (each pins blocks until its lease)


def check_prompt(prompt: list[int], vocab_size: int, max_tokens: int, who: str = "this server") -> None:
    """422 for a prompt the model cannot take (the same check on every server)."""
    if len(prompt) > max_tokens:
        raise HTTPException(422, f"the prompt has {len(prompt)} tokens; {who} takes at most {max_tokens}")
    check_tokens("token ids", prompt, vocab_size)


def check_tokens(name: str, tokens: list[int], vocab_size: int) -> None:
    bad = [token for token in tokens if not 0 <= token < vocab_size]
    if bad:
        raise HTTPException(422, f"{name} {bad[:5]} are outside the vocabulary [0, {vocab_size})")


@dataclass
class Ticket:
    """One admitted request; ``release`` (idempotent) gives its place back."""

    admission: Admission
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.count -= 1


@dataclass
class Admission:
    """At most ``limit`` requests at once (with ``held()`` more that count against it, such as params handed out
    and not yet pulled); one more gets a 503 at once, with ``refusal(taken)`` as its message. Used on the event
    loop's thread only."""

    limit: int
    refusal: Callable[[int], str]
    held: Callable[[], int] = lambda: 0
    count: int = 0

    def check(self) -> None:
        """503 if one more would pass the limit (counting nothing)."""
        taken = self.count + self.held()
        if taken >= self.limit:
            raise HTTPException(503, self.refusal(taken))

    def admit(self) -> Ticket:
        self.check()
        self.count += 1
        return Ticket(self)


def in_flight_refusal(server: str, limit: int) -> Callable[[int], str]:
    def refusal(taken: int) -> str:
        noun = "request" if taken == 1 else "requests"
        return f"the {server} has {taken} {noun} in flight; at most {limit} (--max-in-flight): retry later"

    return refusal


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets a 413 before the app reads it (a declared length at
    once, a chunked body as soon as it passes the limit); the rest is handed to the app as it came."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send, f"has {int(declared)} bytes")
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, f"passed {self.max_bytes} bytes")
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable, what: str) -> None:
        detail = f"the request body {what}; this server takes at most {self.max_bytes} (--max-body-bytes)"
        await JSONResponse({"detail": detail}, status_code=413, headers={"connection": "close"})(scope, receive, send)


@dataclass
class PromptLimit:
    """The router's view of the longest prompt its servers take: the least ``max_prompt_tokens`` from their
    ``/health``, asked once per server (one that does not answer is asked again ``ASK_AGAIN_S`` later). A server
    that changes its limit later still refuses over it itself: this check only keeps a long prompt from being sent
    to a ctx server at all."""

    urls: list[str]
    known: dict[str, int] = field(default_factory=dict)
    asked_at: dict[str, float] = field(default_factory=dict)

    async def get(self, client: httpx.AsyncClient) -> int | None:
        now = time.monotonic()
        ask = [u for u in self.urls if u not in self.known and now - self.asked_at.get(u, -ASK_AGAIN_S) >= ASK_AGAIN_S]
        if ask:
            await asyncio.gather(*(self._ask(client, url, now) for url in ask))
        return min(self.known.values(), default=None)

    async def _ask(self, client: httpx.AsyncClient, url: str, now: float) -> None:
        self.asked_at[url] = now
        try:
            response = await client.get(url + "/health", timeout=2.0)
            answer = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return
        limit = answer.get("max_prompt_tokens") if isinstance(answer, dict) else None
        if type(limit) is int:
            self.known[url] = limit
