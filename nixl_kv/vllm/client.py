"""The client side of the vLLM scripts and tests: seeded prompts, completions timed at the client, metrics."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx

VOCAB = 256


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """A reproducible prompt of token ids (the tiny checkpoints' vocabulary: 256)."""
    rng = random.Random(length * 1_000_003 + seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


@dataclass(frozen=True)
class Completion:
    status: int
    tokens: tuple[int, ...]
    finish_reason: str | None
    first_token_s: float  # from sending to the first token (streamed) or to the whole answer
    total_s: float
    error: str = ""


def complete(client: httpx.Client, url: str, prompt: list[int], max_tokens: int, stream: bool = True) -> Completion:
    """Greedy, ``max_tokens`` exactly (no stop token), token ids back; streamed, the first token is timed."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    start = time.perf_counter()
    if not stream:
        response = client.post(url + "/v1/completions", json=body)
        elapsed = time.perf_counter() - start
        if response.status_code != 200:
            return Completion(response.status_code, (), None, elapsed, elapsed, response.text[:500])
        choice = response.json()["choices"][0]
        return Completion(200, tuple(choice.get("token_ids") or ()), choice.get("finish_reason"), elapsed, elapsed)
    tokens: list[int] = []
    first, finish, error = 0.0, None, ""
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            elapsed = time.perf_counter() - start
            return Completion(response.status_code, (), None, elapsed, elapsed, response.text[:500])
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = str(event["error"])
            for choice in event.get("choices", ()):
                ids = choice.get("token_ids") or ()
                if ids and not tokens:
                    first = time.perf_counter() - start
                tokens.extend(ids)
                finish = choice.get("finish_reason") or finish
    return Completion(200, tuple(tokens), finish, first, time.perf_counter() - start, error)


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    """A server's Prometheus samples, summed over their labels (``name`` -> value)."""
    samples: dict[str, float] = {}
    for line in client.get(url + "/metrics").text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            samples[name] = samples.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return samples
