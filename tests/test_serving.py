"""The reference servers as real processes (router, ctx and gen on free localhost ports): decode output after the
transfer is token for token what transformers ``generate(do_sample=False)`` gives, and failures are HTTP errors."""

from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")  # the serving extras: scripts/test.sh installs them

from nixl_kv.serving.check import Outcome, add_reference, make_prompts, serve_all  # noqa: E402
from nixl_kv.serving.checkpoints import make_checkpoint  # noqa: E402
from nixl_kv.serving.launcher import Cluster, InstanceArgs  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    made = {
        (kind, dtype): make_checkpoint(kind, root / f"{kind}-{dtype}", dtype)
        for kind in ("llama", "bamba")
        for dtype in ("float32", "bfloat16")
    }
    made[("llama-2-kv-heads", "float32")] = make_checkpoint("llama", root / "llama-2kv", num_key_value_heads=2)
    return made


def assert_identical(outcomes: list[Outcome], model: Path, dtype: str) -> None:
    add_reference(outcomes, model, dtype, MAX_TOKENS)
    for outcome in outcomes:
        assert outcome.tokens == outcome.reference, (len(outcome.prompt), outcome.tokens, outcome.reference)
        assert len(outcome.tokens) == MAX_TOKENS


def post(url: str, body: object, timeout: float = 60) -> httpx.Response:
    return httpx.post(url, json=body, timeout=timeout)


@pytest.mark.parametrize(
    ("kind", "dtype", "ctx", "gen"),
    [
        ("llama", "float32", InstanceArgs(1, "block_major"), InstanceArgs(1, "nhd")),
        ("llama", "bfloat16", InstanceArgs(2, "hnd"), InstanceArgs(1, "block_major")),
        ("llama", "float32", InstanceArgs(1, "nhd"), InstanceArgs(2, "hnd")),
        ("llama", "bfloat16", InstanceArgs(2, "block_major"), InstanceArgs(4, "nhd")),
        ("bamba", "float32", InstanceArgs(1, "block_major"), InstanceArgs(2, "nhd")),
        ("bamba", "bfloat16", InstanceArgs(2, "nhd"), InstanceArgs(1, "block_major")),
    ],
    ids=["llama-f32-tp1-tp1", "llama-bf16-tp2-tp1", "llama-f32-tp1-tp2", "llama-bf16-tp2-tp4", "bamba-f32-tp1-tp2",
         "bamba-bf16-tp2-tp1"],
)  # fmt: skip
def test_a_pairing_decodes_what_generate_decodes(
    checkpoints: dict, kind: str, dtype: str, ctx: InstanceArgs, gen: InstanceArgs
) -> None:
    model = checkpoints[(kind, dtype)]
    with Cluster(model, dtype, ctx=[ctx], gen=[gen]) as cluster:
        outcomes = asyncio.run(serve_all(cluster.router.url, make_prompts(6, seed=1), MAX_TOKENS, concurrency=3))
        metrics = httpx.get(cluster.of("gen")[0].url + "/metrics", timeout=10).text
    assert_identical(outcomes, model, dtype)
    assert 'nixl_kv_requests_total{instance="' in metrics and 'side="gen"} 6.0' in metrics


@pytest.fixture(scope="module")
def llama_cluster(checkpoints: dict) -> Cluster:
    with Cluster(checkpoints[("llama", "float32")], "float32", gen=[InstanceArgs(1, "nhd")]) as cluster:
        yield cluster


def test_concurrent_clients_get_what_generate_gives(llama_cluster: Cluster, checkpoints: dict) -> None:
    outcomes = asyncio.run(serve_all(llama_cluster.router.url, make_prompts(8, seed=2), MAX_TOKENS, concurrency=8))
    assert_identical(outcomes, checkpoints[("llama", "float32")], "float32")


def test_a_shared_prefix_moves_only_the_missing_blocks(llama_cluster: Cluster, checkpoints: dict) -> None:
    first = list(range(10, 74))  # 64 tokens: 4 blocks of 16
    second = first[:50] + [200, 201, 202, 203, 204]  # shares 3 whole blocks with the first
    url = llama_cluster.router.url + "/v1/completions"
    answers = [post(url, {"prompt": prompt, "max_tokens": MAX_TOKENS}).json() for prompt in (first, second)]
    assert answers[0]["nixl_kv"]["reused_blocks"] == 0 and answers[1]["nixl_kv"]["reused_blocks"] == 3
    per_block = answers[0]["nixl_kv"]["transfer_bytes"] // 4
    assert answers[1]["nixl_kv"]["transfer_bytes"] == per_block  # the 4th block (tokens 48 to 54) only
    outcomes = [Outcome(p, a["choices"][0]["token_ids"], 0, 0) for p, a in zip((first, second), answers, strict=True)]
    assert_identical(outcomes, checkpoints[("llama", "float32")], "float32")


def test_a_text_prompt_goes_through_the_byte_tokenizer_and_streams(llama_cluster: Cluster, checkpoints: dict) -> None:
    text = "The KV cache moves from prefill to decode."
    url = llama_cluster.router.url + "/v1/completions"
    whole = post(url, {"prompt": text, "max_tokens": MAX_TOKENS}).json()
    choice = whole["choices"][0]
    assert whole["object"] == "text_completion" and whole["usage"] == {
        "prompt_tokens": len(text),
        "completion_tokens": 6,
    }
    assert choice["finish_reason"] == "length" and choice["text"] == bytes(choice["token_ids"]).decode(errors="replace")
    outcome = Outcome(list(text.encode()), choice["token_ids"], 0, 0)
    assert_identical([outcome], checkpoints[("llama", "float32")], "float32")
    with httpx.stream("POST", url, json={"prompt": text, "max_tokens": MAX_TOKENS, "stream": True}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert response.headers["content-type"].startswith("text/event-stream") and events[-1] == "data: [DONE]"
    assert len(events) == MAX_TOKENS + 2  # a token per event, the finish reason, [DONE]


def test_malformed_requests_get_a_4xx(llama_cluster: Cluster) -> None:
    router, gen = llama_cluster.router.url, llama_cluster.of("gen")[0].url
    for body in ({"prompt": []}, {"prompt": [1, 300]}, {"prompt": [1], "max_tokens": 0}, {"prompt": 5}, {}):
        response = post(router + "/v1/completions", body)
        assert response.status_code == 422, (body, response.text)
    assert "outside the vocabulary" in post(router + "/v1/completions", {"prompt": [1, 300]}).text
    too_long = post(router + "/v1/completions", {"prompt": [1] * 1025})
    assert too_long.status_code == 422 and "at most 1024" in too_long.text
    assert httpx.post(router + "/v1/completions", content=b"{not json", timeout=10).status_code == 422
    garbage = base64.b64encode(b"\x93\x01garbage").decode()
    response = post(gen + "/generate", {"params": garbage, "prompt": [1, 2], "first_token": 3, "max_tokens": 2})
    assert response.status_code == 400 and "checksum" in response.text, response.text
    response = post(gen + "/generate", {"params": "@@", "prompt": [1, 2], "first_token": 3, "max_tokens": 2})
    assert response.status_code == 400 and "base64" in response.text
    assert httpx.get(router + "/health", timeout=10).json()["status"] == "ok"


def test_a_killed_ctx_server_is_a_5xx_by_the_deadline_and_the_rest_keeps_serving(checkpoints: dict) -> None:
    model = checkpoints[("llama", "float32")]
    gen = InstanceArgs(1, "nhd", ("--transfer-timeout-ms", "3000"))
    with Cluster(model, "float32", ctx=[InstanceArgs(), InstanceArgs()], gen=[gen]) as cluster:
        doomed, gen_url = cluster.of("ctx")[0], cluster.of("gen")[0].url
        prompt = list(range(1, 60))
        prefilled = post(doomed.url + "/prefill", {"prompt": prompt}).json()
        doomed.kill()  # after it handed out the params, before the gen side reads
        started = time.monotonic()
        body = {"params": prefilled["params"], "prompt": prompt, "first_token": prefilled["first_token"]}
        response = post(gen_url + "/generate", {**body, "max_tokens": MAX_TOKENS})
        assert response.status_code in (502, 504), response.text
        assert time.monotonic() - started < 3.0 + 2.0  # by the transfer deadline (and a margin)
        outcomes = asyncio.run(serve_all(cluster.router.url, make_prompts(4, seed=3), MAX_TOKENS, concurrency=2))
        health = httpx.get(gen_url + "/health", timeout=10).status_code
    assert health == 200
    assert_identical(outcomes, model, "float32")  # served through the ctx server still alive


def test_an_incompatible_pair_is_refused_naming_the_difference(checkpoints: dict) -> None:
    """A gen server of another model (2 kv heads, not 4) refuses the ctx's params with a 409 before any READ; the ctx
    frees them at once, and the next request, on the compatible gen server, is correct."""
    ctx_model, gen_model = checkpoints[("llama", "float32")], checkpoints[("llama-2-kv-heads", "float32")]
    gens = [InstanceArgs(model=gen_model), InstanceArgs()]  # the router's first pick is the first
    with Cluster(ctx_model, "float32", gen=gens) as cluster:
        refused = post(cluster.router.url + "/v1/completions", {"prompt": list(range(40)), "max_tokens": 4})
        ctx_health, deadline = cluster.of("ctx")[0].url + "/health", time.monotonic() + 2  # the lease is 60 s
        while (unpulled := httpx.get(ctx_health, timeout=10).json()["unpulled"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        served = post(cluster.router.url + "/v1/completions", {"prompt": list(range(40)), "max_tokens": MAX_TOKENS})
    assert refused.status_code == 409, refused.text
    detail = refused.json()["detail"]
    assert detail.startswith(f"gen server {cluster.of('gen')[0].url}: IncompatibleStateError: ") and "head" in detail
    assert unpulled == 0
    assert served.status_code == 200 and served.json()["nixl_kv"]["gen"] == cluster.of("gen")[1].url
    tokens = served.json()["choices"][0]["token_ids"]
    assert_identical([Outcome(list(range(40)), tokens, 0, 0)], ctx_model, "float32")
