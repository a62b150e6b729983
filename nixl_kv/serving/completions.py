"""The router's OpenAI-style completion: its request body, and the response made of the gen server's lines.

A completion succeeds only if the gen server's stream ended with its summary line. Non-streamed, that is the one
way to a 200: an error line, a stream cut off or a line that is not JSON is an HTTP error with the cause and the
count of tokens decoded. Streamed, the 200 has gone out with the first token, so a failure ends the stream with an
error event in the OpenAI style (an ``error`` object, and a choice whose finish_reason is "error") and no
``data: [DONE]``: the openai client raises ``APIError`` on it, and a plain SSE reader sees no success marker.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import HTTPException
from pydantic import BaseModel, Field

from nixl_kv.serving.gen_server import MAX_NEW_TOKENS
from nixl_kv.serving.http_common import passed_on
from nixl_kv.serving.limits import STRICT

FIGURES = ("transfer_bytes", "transfer_ms", "reused_blocks")  # the transfer's, from the gen server's summary


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_tokens(tokens: list[int]) -> str:
    return bytes(token for token in tokens if token < 256).decode("utf-8", errors="replace")


class CompletionBody(BaseModel):
    model_config = STRICT  # fields other clients send (temperature, ...) are ignored, but none is coerced
    prompt: list[int] | str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=MAX_NEW_TOKENS)
    stream: bool = False
    model: str | None = None


class GenFailed(HTTPException):
    """The gen server's stream did not end in its summary: ``status_code`` and ``detail`` say why."""


@dataclass
class Completion:
    """One completion being answered: the tokens so far, and the response or events they make."""

    prompt_tokens: int
    max_tokens: int
    model: str
    ctx: str
    gen: str
    started: float = field(default_factory=time.perf_counter)
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    tokens: list[int] = field(default_factory=list)

    def take(self, line: dict) -> dict | None:
        """One gen line: a token is kept (None back), the summary returned; an error line raises GenFailed."""
        if isinstance(line.get("token"), int) and len(line) == 1:
            self.tokens.append(line["token"])
            return None
        if line.get("done") is True:
            return line
        status = line.get("status")
        raise self.failure(status if isinstance(status, int) else 502, str(line.get("error", f"unexpected {line}")))

    def failure(self, status: int, cause: str) -> GenFailed:
        done = f"{len(self.tokens)} of {self.max_tokens} tokens"
        return GenFailed(passed_on(status), f"gen server {self.gen} failed after {done}: {cause}")

    # --- non-streamed ---------------------------------------------------------------------------------------------
    def response(self, summary: dict) -> dict:
        choice = {
            "index": 0,
            "text": decode_tokens(self.tokens),
            "token_ids": self.tokens,
            "finish_reason": summary["finish_reason"],
        }
        return {
            **self._head(),
            "choices": [choice],
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens)},
            "nixl_kv": self._figures(summary),
        }

    # --- streamed -------------------------------------------------------------------------------------------------
    def token_event(self, token: int) -> bytes:
        choice = {"index": 0, "text": decode_tokens([token]), "token_ids": [token], "finish_reason": None}
        return _event({**self._head(), "choices": [choice]})

    def summary_event(self, summary: dict) -> bytes:
        choice = {"index": 0, "text": "", "token_ids": [], "finish_reason": summary["finish_reason"]}
        return _event({**self._head(), "choices": [choice], "nixl_kv": self._figures(summary)}) + b"data: [DONE]\n\n"

    def error_event(self, failure: HTTPException) -> bytes:
        choice = {"index": 0, "text": "", "token_ids": [], "finish_reason": "error"}
        kind = "server_error" if failure.status_code >= 500 else "invalid_request_error"
        error = {"message": failure.detail, "type": kind, "param": None, "code": failure.status_code}
        return _event({**self._head(), "choices": [choice], "error": error})

    def _head(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model}

    def _figures(self, summary: dict) -> dict:
        seconds = round(time.perf_counter() - self.started, 6)
        return {
            "ctx": self.ctx,
            "gen": self.gen,
            "seconds": seconds,
            **{k: summary[k] for k in FIGURES if k in summary},
        }


def _event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()
