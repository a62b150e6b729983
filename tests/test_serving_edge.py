"""The reference servers under bad clients and dying peers (issue 23), as real processes: a failure is never a 200,
params are bound to their prompt and read once, every limit is checked at the edge, and after each fault a normal
request still gets what transformers ``generate`` gives."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")  # the serving extras: scripts/test.sh installs them

from nixl_kv.serving.check import Outcome  # noqa: E402
from nixl_kv.serving.checkpoints import make_checkpoint  # noqa: E402
from nixl_kv.serving.completions import Completion, GenFailed  # noqa: E402
from nixl_kv.serving.launcher import Cluster, InstanceArgs, Server  # noqa: E402
from tests.test_serving import MAX_TOKENS, assert_identical, post  # noqa: E402

LONG = 4096  # tokens: decoding them takes seconds, time enough to kill the gen server in the middle
PROMPT = list(range(10, 74))  # 64 tokens: 4 blocks of 16
TRANSFER_TIMEOUT_S = 3.0
LEASE_S = 3.0


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("checkpoints") / "llama")


def completion(router: str, prompt: list[int] | str, max_tokens: int = MAX_TOKENS, **extra: object) -> httpx.Response:
    return post(router + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **extra})


def assert_correct(router: str, model: Path, prompts: list[list[int]]) -> None:
    """A normal request for each prompt decodes what ``generate`` decodes."""
    outcomes = []
    for prompt in prompts:
        response = completion(router, prompt)
        assert response.status_code == 200, response.text
        outcomes.append(Outcome(prompt, response.json()["choices"][0]["token_ids"], 0, 0))
    assert_identical(outcomes, model, "float32")


def prefill(ctx: str, prompt: list[int]) -> tuple[dict, int]:
    """A ``/generate`` body for ``prompt`` from the ctx server, and the ctx's request id."""
    response = post(ctx + "/prefill", {"prompt": prompt})
    assert response.status_code == 200, response.text
    answer = response.json()
    body = {"params": answer["params"], "prompt": prompt, "first_token": answer["first_token"]}
    return {**body, "max_tokens": MAX_TOKENS}, answer["request_id"]


def generated(response: httpx.Response) -> list[int]:
    """The tokens of a gen server's 200 (its lines end in the summary)."""
    assert response.status_code == 200, response.text
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert lines[-1]["done"] is True, lines[-1]
    return [line["token"] for line in lines[:-1]]


def health(server: Server) -> dict:
    return httpx.get(server.url + "/health", timeout=10).json()


def wait_for(condition: object, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` held (polled every 20 ms)."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"no {what} within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


def decoding_gen(cluster: Cluster) -> Server:
    """The gen server (of those alive) that is decoding a request, waited for."""
    alive = [gen for gen in cluster.of("gen") if gen.process.poll() is None]
    found: list[Server] = []
    wait_for(lambda: found.extend(gen for gen in alive if health(gen)["decoding"]) or found, 60, "decoding")
    return found[0]


def data_events(lines: Iterator[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


# --- the router's completion, without servers -------------------------------------------------------------------
def test_a_completion_succeeds_only_on_the_summary_line() -> None:
    done = Completion(3, 4, "m", "http://ctx", "http://gen")
    assert done.take({"token": 7}) is None and done.take({"done": True, "finish_reason": "length"})
    for line, status, cause in [
        ({"error": "decoding stopped: boom", "status": 500, "tokens": 1}, 502, "decoding stopped: boom"),
        ({"error": "decoding stopped: no token within 60 s", "status": 504}, 504, "decoding stopped: no token"),
        ({"error": "the server is stopping", "status": 503}, 503, "the server is stopping"),
        ({"something": "else"}, 502, "unexpected {'something': 'else'}"),
    ]:
        failed = Completion(3, 4, "m", "http://ctx", "http://gen")
        failed.take({"token": 7})
        with pytest.raises(GenFailed) as caught:
            failed.take(line)
        assert caught.value.status_code == status
        assert caught.value.detail.startswith(f"gen server http://gen failed after 1 of 4 tokens: {cause}")
    event = json.loads(failed.error_event(caught.value).decode().removeprefix("data: "))
    assert event["choices"] == [{"index": 0, "text": "", "token_ids": [], "finish_reason": "error"}]
    assert event["error"] == {"message": caught.value.detail, "type": "server_error", "param": None, "code": 502}


# --- bad clients: one ctx, two gen servers ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def edge(llama: Path) -> Iterator[Cluster]:
    with Cluster(llama, "float32", gen=[InstanceArgs(1, "nhd"), InstanceArgs(1, "nhd")]) as cluster:
        yield cluster


def test_loosely_typed_values_are_refused_not_coerced(edge: Cluster, llama: Path) -> None:
    router, ctx, gen = edge.router.url, edge.of("ctx")[0].url, edge.of("gen")[0].url
    for body, location, message in [
        ({"prompt": [1, True]}, ["body", "prompt", "list[int]", 1], "Input should be a valid integer"),
        ({"prompt": ["7"]}, ["body", "prompt", "list[int]", 0], "Input should be a valid integer"),
        ({"prompt": [1, 2], "max_tokens": "4"}, ["body", "max_tokens"], "Input should be a valid integer"),
        ({"prompt": [1, 2], "max_tokens": 4.0}, ["body", "max_tokens"], "Input should be a valid integer"),
        ({"prompt": [1, 2], "stream": "yes"}, ["body", "stream"], "Input should be a valid boolean"),
        ({"prompt": [1, 2], "stream": 1}, ["body", "stream"], "Input should be a valid boolean"),
    ]:
        response = post(router + "/v1/completions", body)
        assert response.status_code == 422, (body, response.text)
        assert {"loc": location, "msg": message} in [
            {"loc": e["loc"], "msg": e["msg"]} for e in response.json()["detail"]
        ]
    response = post(ctx + "/prefill", {"prompt": [1, "2"]})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "prompt", 1]
    body, _ = prefill(ctx, PROMPT)
    for name, value in [
        ("first_token", str(body["first_token"])),
        ("max_tokens", True),
        ("prompt", PROMPT[:-1] + [1.0]),
    ]:
        response = post(gen + "/generate", {**body, name: value})
        assert response.status_code == 422 and response.json()["detail"][0]["loc"][:2] == ["body", name], response.text
    response = post(gen + "/generate", {**body, "temperature": 0})
    assert response.status_code == 422 and response.json()["detail"][0]["msg"] == "Extra inputs are not permitted"
    tokens = generated(post(gen + "/generate", body))  # none of those used the params
    assert_identical([Outcome(PROMPT, tokens, 0, 0)], llama, "float32")
    assert_correct(router, llama, [PROMPT])


def test_a_body_over_the_limit_is_a_413_before_anything_reads_it(edge: Cluster, llama: Path) -> None:
    router = edge.router.url
    content = json.dumps({"prompt": "a" * 2_000_000}).encode()  # 10 M ids would come from 10 M characters
    response = httpx.post(router + "/v1/completions", content=content, timeout=60)
    declared = len(content)
    assert response.status_code == 413
    assert response.json() == {
        "detail": f"the request body has {declared} bytes; this server takes at most 1048576 (--max-body-bytes)"
    }

    def chunks() -> Iterator[bytes]:  # no content-length: the limit is counted as the body comes
        yield b'{"prompt": ['
        for _ in range(2_000_000):
            yield b"1, "
        yield b"1]}"

    for url in (router + "/v1/completions", edge.of("ctx")[0].url + "/prefill", edge.of("gen")[0].url + "/generate"):
        response = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
        assert response.status_code == 413, (url, response.text)
        assert response.json()["detail"] == (
            "the request body passed 1048576 bytes; this server takes at most 1048576 (--max-body-bytes)"
        )
    assert_correct(router, llama, [PROMPT])


def test_the_router_refuses_a_prompt_over_the_model_limit_before_forwarding_it(edge: Cluster, llama: Path) -> None:
    router, ctx, gen = edge.router.url, edge.of("ctx")[0], edge.of("gen")[0].url
    assert health(ctx)["max_prompt_tokens"] == 1024 == health(edge.of("gen")[0])["max_prompt_tokens"]
    limit = "the least max_prompt_tokens of the ctx and gen servers"
    message = f"the prompt has 1025 tokens; the model takes at most 1024 ({limit})"
    for prompt in ([1] * 1025, "x" * 1025):
        response = completion(router, prompt)
        assert response.status_code == 422 and response.json() == {"detail": message}
    # the ctx server would have said "this server": the router did not forward it
    assert post(ctx.url + "/prefill", {"prompt": [1] * 1025}).json() == {
        "detail": "the prompt has 1025 tokens; this server takes at most 1024"
    }
    body, _ = prefill(ctx.url, PROMPT)
    response = post(gen + "/generate", {**body, "prompt": [1] * 1025})  # the first token is not counted
    assert response.status_code == 422
    assert response.json() == {"detail": "the prompt has 1025 tokens; this server takes at most 1024"}
    response = post(gen + "/generate", {**body, "first_token": 256})
    assert response.json() == {"detail": "first_token [256] are outside the vocabulary [0, 256)"}
    longest = [(7 * i) % 256 for i in range(1024)]
    assert_correct(router, llama, [longest, PROMPT])


def test_params_are_bound_to_their_prompt_and_first_token(edge: Cluster, llama: Path) -> None:
    """Params for a 64-token prompt are refused for a 100-token prompt, for another 64-token prompt and for another
    first token, before any READ: the params then still serve their own prompt, and nothing the refused bodies
    named is held for prefix reuse (the issue's poisoning: later router requests for those prompts came back wrong)."""
    router, ctx, gen = edge.router.url, edge.of("ctx")[0].url, edge.of("gen")[0].url
    longer = PROMPT + list(range(100, 136))  # 100 tokens
    other = PROMPT[:40] + [200 + i for i in range(24)]  # 64 tokens, the same first 2 blocks
    body, _ = prefill(ctx, PROMPT)
    for changed, message in [
        ({"prompt": longer}, "prompt: 100 tokens, but the params were made for a prompt of 64 tokens"),
        ({"prompt": other}, "prompt: not the prompt the params were made for (same length, 64 tokens)"),
        (
            {"first_token": (body["first_token"] + 1) % 256},
            f"first_token: {(body['first_token'] + 1) % 256}, but the params carry {body['first_token']}",
        ),
    ]:
        response = post(gen + "/generate", {**body, **changed})
        assert response.status_code == 422 and response.json() == {"detail": message}
    tokens = generated(post(gen + "/generate", body))
    assert_identical([Outcome(PROMPT, tokens, 0, 0)], llama, "float32")
    assert_correct(router, llama, [other, longer, PROMPT])


def test_used_params_get_a_409(edge: Cluster, llama: Path) -> None:
    router, ctx = edge.router.url, edge.of("ctx")[0].url
    first, second = (gen.url for gen in edge.of("gen"))
    body, request_id = prefill(ctx, PROMPT)
    generated(post(first + "/generate", body))
    replayed = post(first + "/generate", body)
    assert replayed.status_code == 409
    assert replayed.json() == {"detail": f"params: already used (ctx request {request_id}); params are read once"}
    elsewhere = post(second + "/generate", body)  # another gen server: its ctx side refuses them
    assert elsewhere.status_code == 409, elsewhere.text
    assert re.fullmatch(
        rf"TransferError: ctx side refused: nixl_kv-\w+-0: request {request_id} is not pinned here "
        r"\(unknown, finished, cancelled or expired\)",
        elsewhere.json()["detail"],
    )
    assert_correct(router, llama, [PROMPT, PROMPT[:50]])


# --- full servers: a ctx that holds 2 unpulled requests, a gen that serves 1 at a time ---------------------------
@pytest.fixture(scope="module")
def small(llama: Path) -> Iterator[Cluster]:
    ctx = InstanceArgs(extra=("--max-unpulled", "2", "--lease-ms", str(int(LEASE_S * 1000))))
    gen = InstanceArgs(1, "nhd", ("--max-in-flight", "1"))
    with Cluster(llama, "float32", ctx=[ctx], gen=[gen]) as cluster:
        yield cluster


def test_a_full_gen_server_answers_503_at_once(small: Cluster, llama: Path) -> None:
    router, ctx, gen = small.router.url, small.of("ctx")[0], small.of("gen")[0]
    wait_for(lambda: health(ctx)["unpulled"] == 0, LEASE_S + 5, "free ctx")
    body, _ = prefill(ctx.url, PROMPT)
    long_stream = {"prompt": PROMPT[:20], "max_tokens": LONG, "stream": True}
    with httpx.stream("POST", router + "/v1/completions", json=long_stream, timeout=60) as busy:
        lines = busy.iter_lines()  # (kept: a dropped iterator closes the stream)
        next(line for line in lines if line.startswith("data: "))  # decoding: the gen's one place is taken
        started = time.monotonic()
        response = post(gen.url + "/generate", body)
        assert time.monotonic() - started < 1.0
        assert response.status_code == 503
        message = "the gen server has 1 request in flight; at most 1 (--max-in-flight): retry later"
        assert response.json() == {"detail": message}
    wait_for(lambda: health(gen)["in_flight"] == 0, 10, "the stream's end")  # the client left: its place is back
    tokens = generated(post(gen.url + "/generate", body))  # refused for room, the params were not used
    assert_identical([Outcome(PROMPT, tokens, 0, 0)], llama, "float32")
    assert_correct(router, llama, [PROMPT[:30]])


@contextlib.contextmanager
def client_gone_while(server: Server, url: str, path: str, body: dict) -> Iterator[None]:
    """A client that sends its request, then hangs up before the answer starts (while the body of the ``with``
    runs); ``server`` is stopped meanwhile, so the request is still being worked on when the client goes."""
    parsed = httpx.URL(url)
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nhost: {parsed.host}\r\ncontent-type: application/json\r\n"
    server.pause()
    try:
        with socket.create_connection((parsed.host, parsed.port), timeout=10) as client:
            client.sendall(head.encode() + f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
            yield
    finally:
        server.resume()


def test_a_client_gone_before_the_answer_gives_its_place_back_and_stops_the_decoding(
    small: Cluster, llama: Path
) -> None:
    """The gen server (one place) and the router: a client that hangs up while its transfer runs must not keep its
    place, nor the engine decoding to max_tokens for nobody, nor the router's upstream response open."""
    router, ctx, gen = small.router.url, small.of("ctx")[0], small.of("gen")[0]
    wait_for(lambda: health(ctx)["unpulled"] == 0, LEASE_S + 5, "free ctx")
    body, _ = prefill(ctx.url, PROMPT)
    with client_gone_while(gen, gen.url, "/generate", {**body, "max_tokens": LONG}):
        time.sleep(0.5)
    wait_for(lambda: health(gen)["in_flight"] == 0 and not health(gen)["decoding"], 10, "its place back")
    used = post(gen.url + "/generate", body)  # the gen took the request: its params were used
    assert used.status_code == 409, used.text
    routed = {"prompt": PROMPT[:20], "max_tokens": LONG, "stream": True}
    with client_gone_while(gen, router, "/v1/completions", routed):
        wait_for(lambda: health(ctx)["unpulled"] == 1, 10, "the routed request's prefill")
        time.sleep(0.3)  # (the router is waiting for the stopped gen's answer)
    wait_for(lambda: httpx.get(router + "/health", timeout=10).json()["in_flight"] == 0, 10, "the router's place back")
    wait_for(lambda: health(gen)["in_flight"] == 0 and not health(gen)["decoding"], 10, "the gen's place back")
    assert_correct(router, llama, [PROMPT, PROMPT[:20]])


def test_a_ctx_full_of_unpulled_params_answers_503_at_once_and_frees_them_at_their_lease(
    small: Cluster, llama: Path
) -> None:
    import openai

    router, ctx = small.router.url, small.of("ctx")[0]
    wait_for(lambda: health(ctx)["unpulled"] == 0, LEASE_S + 5, "free ctx")
    prefill(ctx.url, PROMPT)
    prefill(ctx.url, PROMPT[:40])  # handed out, never pulled
    handed_out = time.monotonic()
    message = (
        "the ctx server holds 2 requests whose params were handed out and not yet pulled; at most 2 (--max-unpulled): "
        f"each is freed when a gen server pulls it or at its {int(LEASE_S * 1000)} ms lease"
    )
    started = time.monotonic()
    response = post(ctx.url + "/prefill", {"prompt": PROMPT})
    assert time.monotonic() - started < 1.0
    assert response.status_code == 503 and response.json() == {"detail": message}
    response = completion(router, PROMPT)
    assert response.status_code == 503 and response.json() == {"detail": f"ctx server {ctx.url}: {message}"}
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="nixl_kv", prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert caught.value.status_code == 503 and caught.value.body == {"detail": f"ctx server {ctx.url}: {message}"}
    wait_for(lambda: health(ctx)["unpulled"] == 0, LEASE_S + 5, "the lease's end")
    assert time.monotonic() - handed_out >= LEASE_S - 0.1  # held until the lease, not dropped sooner
    assert_correct(router, llama, [PROMPT])


# --- a gen server killed mid-decode: one ctx, four gen servers (each test kills one) -----------------------------
@pytest.fixture(scope="module")
def gens(llama: Path) -> Iterator[Cluster]:
    with Cluster(llama, "float32", gen=[InstanceArgs(1, "nhd")] * 4) as cluster:
        yield cluster


BROKEN = (
    r"the stream broke: RemoteProtocolError: peer closed connection without sending complete message body "
    r"\(incomplete chunked read\)"
)


def test_a_gen_killed_mid_decode_is_a_502_never_a_200(gens: Cluster, llama: Path) -> None:
    answer: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answer.append(completion(gens.router.url, PROMPT, LONG)))
    worker.start()
    victim = decoding_gen(gens)
    victim.kill()
    worker.join(60)
    response = answer[0]
    assert response.status_code == 502, response.text
    detail = response.json()["detail"]
    match = re.fullmatch(rf"gen server {victim.url} failed after (\d+) of {LONG} tokens: {BROKEN}", detail)
    assert match and 0 < int(match[1]) < LONG, detail
    assert_correct(gens.router.url, llama, [PROMPT])


def test_a_gen_killed_mid_stream_ends_in_an_error_event_without_done(gens: Cluster, llama: Path) -> None:
    body = {"prompt": PROMPT, "max_tokens": LONG, "stream": True}
    with httpx.stream("POST", gens.router.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events = [next(line for line in lines if line.startswith("data: ")).removeprefix("data: ")]
        victim = decoding_gen(gens)
        victim.kill()
        events += data_events(lines)  # the rest of the stream
    assert "[DONE]" not in events
    *tokens, last = (json.loads(event) for event in events)
    assert all(event["choices"][0]["finish_reason"] is None and "error" not in event for event in tokens)
    assert last["choices"] == [{"index": 0, "text": "", "token_ids": [], "finish_reason": "error"}]
    error = last["error"]
    assert (error["type"], error["code"], error["param"]) == ("server_error", 502, None)
    match = re.fullmatch(rf"gen server {victim.url} failed after (\d+) of {LONG} tokens: {BROKEN}", error["message"])
    assert match and int(match[1]) == len(tokens) > 0, error["message"]
    assert_correct(gens.router.url, llama, [PROMPT])


def test_the_openai_client_raises_on_a_stream_cut_by_a_killed_gen(gens: Cluster, llama: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=gens.router.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="nixl_kv", prompt=PROMPT, max_tokens=LONG, stream=True)
    chunks = [next(stream)]
    victim = decoding_gen(gens)
    victim.kill()
    with pytest.raises(openai.APIError) as caught:
        chunks.extend(stream)
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks)
    assert re.fullmatch(rf"gen server {victim.url} failed after \d+ of {LONG} tokens: {BROKEN}", caught.value.message)
    assert caught.value.body["code"] == 502
    whole = client.completions.create(model="nixl_kv", prompt=PROMPT, max_tokens=MAX_TOKENS)  # the survivor
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == MAX_TOKENS
    assert_identical([Outcome(PROMPT, choice.to_dict()["token_ids"], 0, 0)], llama, "float32")


# --- a ctx server frozen or killed while the gen server reads: two ctx, one gen ----------------------------------
@pytest.fixture(scope="module")
def ctxs(llama: Path) -> Iterator[Cluster]:
    gen = InstanceArgs(1, "nhd", ("--transfer-timeout-ms", str(int(TRANSFER_TIMEOUT_S * 1000))))
    with Cluster(llama, "float32", ctx=[InstanceArgs(), InstanceArgs()], gen=[gen]) as cluster:
        yield cluster


def test_a_transfer_past_its_deadline_is_a_504(ctxs: Cluster, llama: Path) -> None:
    frozen, gen = ctxs.of("ctx")[0], ctxs.of("gen")[0]
    body, _ = prefill(frozen.url, PROMPT)
    frozen.pause()  # alive to the gen side (its connection stays up), answering nothing
    try:
        started = time.monotonic()
        response = post(gen.url + "/generate", body)
        elapsed = time.monotonic() - started
    finally:
        frozen.resume()
    assert response.status_code == 504, response.text
    assert response.json() == {
        "detail": "deadline of 3000 ms passed (kv_transfer_timeout_ms): TransferError: cancelled on the gen side"
    }
    assert TRANSFER_TIMEOUT_S <= elapsed < TRANSFER_TIMEOUT_S + 2.0
    assert_correct(ctxs.router.url, llama, [PROMPT, PROMPT[:33], PROMPT[:17]])  # through both ctx servers


def test_a_ctx_killed_while_a_read_is_in_flight_is_a_5xx_and_the_gen_keeps_serving(ctxs: Cluster, llama: Path) -> None:
    """The ctx dies once it handed out the params, before or while the gen reads. (Paused first, the ctx did not
    hold the READ back: over a one-sided transport a READ from a frozen process's memory completes, and its bytes
    are right, so the kill comes before the gen's request.)"""
    doomed, gen = ctxs.of("ctx")[0], ctxs.of("gen")[0]
    body, _ = prefill(doomed.url, PROMPT[:50])
    doomed.kill()
    started = time.monotonic()
    response = post(gen.url + "/generate", body)
    elapsed = time.monotonic() - started
    assert response.status_code == 502, response.text
    detail = response.json()["detail"]  # the READ failed, or a dead peer's READ was refused at its post
    refused = r"AgentError: NIXL could not create the READ from nixl_kv-\w+-0 \(status -\d+\)"
    assert re.fullmatch(rf"TransferError: (READ from nixl_kv-\w+-0 failed|{refused})", detail), detail
    assert elapsed < TRANSFER_TIMEOUT_S
    assert health(gen)["status"] == "ok"
    assert_correct(ctxs.router.url, llama, [PROMPT, PROMPT[:50]])  # through the ctx server still alive
