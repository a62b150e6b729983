"""The client side of the SGLang scripts and tests: SGLang's ``/generate`` with token ids, aggregated or through a
prefill/decode pair, timed at the client.

A disaggregated request goes to both servers at once with the same ``bootstrap_host``/``bootstrap_port``/
``bootstrap_room`` (what SGLang's router does); the decode's answer is the request's. Runs without SGLang.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

_rooms = random.Random()
_rooms_lock = threading.Lock()


@dataclass(frozen=True)
class Pair:
    prefill: str  # URLs
    decode: str
    bootstrap_port: int


@dataclass(frozen=True)
class Generation:
    status: int
    tokens: tuple[int, ...]
    finish_reason: str | None
    first_token_s: float  # from sending to the first streamed token
    total_s: float
    error: str = ""


def new_room() -> int:
    with _rooms_lock:
        return _rooms.randrange(1 << 62)


def body_of(prompt: list[int], max_tokens: int) -> dict:
    """Greedy, exactly ``max_tokens`` new tokens (no stop token), streamed."""
    return {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True},
        "stream": True,
    }


def generate(client: httpx.Client, url: str, body: dict) -> Generation:
    """One streamed ``/generate``: the tokens and the time to the first one; a non-200 answer or a finish reason
    of ``abort`` is an error (SGLang reports a failed transfer so)."""
    start = time.perf_counter()
    first, tokens, finish = 0.0, (), None
    try:
        with client.stream("POST", url + "/generate", json=body) as response:
            if response.status_code != 200:
                return Generation(response.status_code, (), None, 0.0, time.perf_counter() - start,
                                  response.read().decode(errors="replace")[:500])  # fmt: skip
            for line in response.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return Generation(500, (), None, first, time.perf_counter() - start, json.dumps(chunk)[:500])
                if chunk.get("output_ids") and not first:
                    first = time.perf_counter() - start
                tokens = tuple(chunk.get("output_ids") or tokens)
                finish = (chunk.get("meta_info") or {}).get("finish_reason") or finish
    except httpx.HTTPError as exc:
        return Generation(0, (), None, first, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    if reason == "abort":
        return Generation(500, tokens, reason, first, time.perf_counter() - start, json.dumps(finish)[:500])
    return Generation(200, tokens, reason, first, time.perf_counter() - start)


def generate_pair(client: httpx.Client, pair: Pair, prompt: list[int], max_tokens: int,
                  rid: str | None = None) -> Generation:  # fmt: skip
    """The request through the pair: both servers get it with one bootstrap room; the decode's answer counts.
    ``rid`` names it on both (what ``/abort_request`` takes)."""
    body = body_of(prompt, max_tokens)
    body.update(bootstrap_host=urlsplit(pair.prefill).hostname, bootstrap_port=pair.bootstrap_port,
                bootstrap_room=new_room())  # fmt: skip
    if rid is not None:
        body["rid"] = rid
    with ThreadPoolExecutor(1) as pool:
        prefill = pool.submit(generate, client, pair.prefill, {**body, "stream": False})
        decoded = generate(client, pair.decode, body)
        prefill.result()
    return decoded
