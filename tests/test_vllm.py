"""nixl_kv inside a real vLLM: a prefill and a decode ``vllm`` OpenAI server with NixlKvConnector, against one
aggregated vLLM server on the same checkpoint (the same engine, no connector). Every output must be identical.

The engines run from the venv ``scripts/vllm_env.sh`` makes (``NIXL_KV_VLLM_PYTHON``, else ``.venv-vllm``). vLLM
starts slowly on 2 cores (30-100 s), so one module-scoped set of servers serves every test; a second prefill
instance is the one a test kills. Every connector writes its requests' KV digests (``nixl_kv.vllm.digest``) to a
file of its own, and the decode instance's connector can hold its READs in flight (``tests/vllm_held_reads.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from nixl_kv.serving.launcher import Server
from nixl_kv.vllm.client import complete, prompt_of, scrape
from nixl_kv.vllm.launch import Instance, VllmServers, make_model

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("NIXL_KV_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
TRANSFER_TIMEOUT_MS = 4000
MAX_TOKENS = 12
RECEIVED = "vllm:nixl_kv_transfer_seconds_count"
FAILED = "vllm:nixl_kv_failed_transfers_total"
PARAMS_KEY = "nixl_kv_params"  # nixl_kv.vllm.scheduler's (which imports vLLM, absent here)
HELD = "tests.vllm_held_reads:HeldReadsConnector"

pytestmark = pytest.mark.vllm


@dataclass
class Pair:
    prefill: Server
    decode: Server
    aggregated: Server
    router: Server
    victim: Server  # a second prefill instance, of 64-token blocks (the decode's are 32), for the test that kills one
    wide: Server  # a decode instance of tensor-parallel size 2 (kv_both)
    client: httpx.Client
    files: Path | None = None  # each server's KV digests (NAME.jsonl) and the decode's READ hold (hold)

    def expected(self, prompt: list[int]) -> tuple[int, ...]:
        answer = complete(self.client, self.aggregated.url, prompt, MAX_TOKENS)
        assert answer.status == 200 and len(answer.tokens) == MAX_TOKENS, answer
        return answer.tokens


def checkpoint(tmp_path_factory: pytest.TempPathFactory, kind: str = "llama") -> Path:
    """The ``kind`` checkpoint in a folder of its own, written by the vLLM venv's transformers (there must be one)."""
    if not Path(PYTHON).exists():
        pytest.fail(f"no vLLM venv at {PYTHON}: scripts/test.sh makes it (scripts/vllm_env.sh)")
    return make_model(tmp_path_factory.mktemp("vllm") / kind, python=PYTHON, kind=kind)


@contextmanager
def prefill_and_decode(model: Path, prefill: Instance, decode: Instance, files: Path | None = None) -> Iterator[Pair]:
    """One prefill and one decode instance, the decode standing in for every other server of a ``Pair``: for modules
    whose reference is the decode's own answer (one server fewer to start on 2 cores)."""
    with VllmServers(model, python=PYTHON, max_model_len=2048) as servers:
        ctx = servers.start(prefill, "prefill")
        gen = servers.start(decode, "decode")
        servers.wait()
        with httpx.Client(timeout=120) as client:
            yield Pair(ctx, gen, gen, gen, ctx, gen, client, files)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    model = checkpoint(tmp_path_factory)
    files = tmp_path_factory.mktemp("vllm-files")

    def digests(name: str) -> tuple[tuple[str, object], ...]:
        return (("kv_digest_file", str(files / f"{name}.jsonl")),)

    decode_config = (("transfer_timeout_ms", TRANSFER_TIMEOUT_MS), ("hold_reads_file", str(files / "hold")))
    held = dict(connector=HELD, env=(("PYTHONPATH", str(ROOT)),))
    with VllmServers(model, python=PYTHON, max_model_len=2048) as servers:
        # CPU 0 (each server's ranks take CPUs in turn)
        prefill = servers.start(Instance("kv_producer", extra_config=digests("prefill")), "prefill")
        decode_instance = Instance("kv_consumer", extra_config=decode_config + digests("decode"), **held)
        decode = servers.start(decode_instance, "decode")  # CPU 1
        victim = servers.start(Instance("kv_producer", block_size=64, extra_config=digests("victim")), "victim")
        wide = servers.start(Instance("kv_both", tp=2), "decode-tp2")
        aggregated = servers.start(Instance(), "aggregated")
        router = servers.start_router([prefill], [decode])
        servers.wait()
        with httpx.Client(timeout=120) as client:
            yield Pair(prefill, decode, aggregated, router, victim, wide, client, files)


def counters(pair: Pair, server: Server) -> tuple[float, float]:
    """The server's pulls received and failed. Both are final once a decode's answer is back: a worker reports a
    pull's figures in the engine step that reports it received (or failed), before the request can run, and the API
    server records a step's figures before it handles a later step's tokens, so no wait is needed (with TP the request
    runs only once every rank reported it)."""
    samples = scrape(pair.client, server.url)
    return samples.get(RECEIVED, 0.0), samples.get(FAILED, 0.0)


def why_not_pulled(server: Server) -> str:
    """The connector's warnings in the server's log (a failed pull says why): the message of a counter assertion."""
    lines = server.log.read_text(errors="replace").splitlines() if server.log.exists() else []
    return "\n".join(line for line in lines if "nixl_kv:" in line)[-4000:] or "(no nixl_kv warning in the log)"


def prefilled_params(pair: Pair, server: Server, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    response = pair.client.post(server.url + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert params and PARAMS_KEY in params, params  # else the decode would compute the prompt itself
    return params


def decode_with(
    pair: Pair, prompt: list[int], params: dict, decode: Server | None = None
) -> tuple[int, tuple[int, ...]]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": params,
    }
    response = pair.client.post((decode or pair.decode).url + "/v1/completions", json=body)
    return response.status_code, tuple(response.json()["choices"][0]["token_ids"]) if response.is_success else ()


def test_nixl_kv_reads_a_kv_cache_as_vllm_cpu_kernels_write_it() -> None:
    """vLLM's own kernel writes K and V; nixl_kv's view of the tensor reads back every element (K is dim-major)."""
    probe = subprocess.run([PYTHON, str(ROOT / "tests" / "vllm_layout_probe.py")], capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-2000:]
    lines = [line for line in probe.stdout.splitlines() if line.startswith("block")]
    assert lines == ["block 32 isa vec: 0 mismatched of 24576", "block 64 isa vec: 0 mismatched of 49152"]


@pytest.mark.parametrize("length", [1, 33, 257, 1000])
def test_the_pair_decodes_what_aggregated_vllm_decodes(pair: Pair, length: int) -> None:
    prompt = prompt_of(length, seed=1)
    received, failed = counters(pair, pair.decode)
    answer = complete(pair.client, pair.router.url, prompt, MAX_TOKENS)
    assert answer.status == 200, answer.error
    assert answer.tokens == pair.expected(prompt)
    assert answer.finish_reason == "length"
    # the decode instance pulled the KV: it did not recompute
    assert counters(pair, pair.decode) == (received + 1, failed), why_not_pulled(pair.decode)


def test_concurrent_requests_each_decode_what_aggregated_vllm_decodes(pair: Pair) -> None:
    assert_concurrent_answers(pair, [prompt_of(50 + 37 * i, seed=2) for i in range(8)])


def assert_concurrent_answers(pair: Pair, prompts: list[list[int]]) -> None:
    """Every prompt through the router at once: each answer is the aggregated one."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(pair.client, pair.router.url, p, MAX_TOKENS, stream=False), prompts))
    assert [a.status for a in answers] == [200] * len(prompts)
    assert [a.tokens for a in answers] == [pair.expected(p) for p in prompts]


def test_a_prefix_the_decode_holds_moves_only_the_rest(pair: Pair) -> None:
    prompt = prompt_of(300, seed=3)
    first = complete(pair.client, pair.router.url, prompt, MAX_TOKENS)
    again = complete(pair.client, pair.router.url, prompt[:290] + [7, 8, 9], MAX_TOKENS)
    assert first.tokens == pair.expected(prompt)
    assert again.tokens == pair.expected(prompt[:290] + [7, 8, 9])


def test_params_for_another_prompt_or_damaged_are_computed_there_instead(pair: Pair) -> None:
    prompt, other = prompt_of(120, seed=4), prompt_of(120, seed=5)
    params = prefilled_params(pair, pair.prefill, prompt)
    before = counters(pair, pair.decode)
    assert decode_with(pair, other, params) == (200, pair.expected(other))
    damaged = dict(params, nixl_kv_params=params["nixl_kv_params"][:-8] + "AAAAAAAA")
    assert decode_with(pair, prompt, damaged) == (200, pair.expected(prompt))
    assert counters(pair, pair.decode) == before  # neither was pulled


def test_a_tensor_parallel_decode_instance_pulls_each_rank_its_heads(pair: Pair) -> None:
    prompt = prompt_of(333, seed=7)
    received, failed = counters(pair, pair.wide)
    params = prefilled_params(pair, pair.prefill, prompt)
    assert decode_with(pair, prompt, params, pair.wide) == (200, pair.expected(prompt))
    assert counters(pair, pair.wide) == (received + 2, failed), why_not_pulled(pair.wide)  # one pull per rank


def test_a_prefill_of_larger_blocks_than_the_decode_which_nixlconnector_refuses(pair: Pair) -> None:
    for length in (33, 300):
        prompt = prompt_of(length, seed=8)
        received, failed = counters(pair, pair.decode)
        assert decode_with(pair, prompt, prefilled_params(pair, pair.victim, prompt)) == (200, pair.expected(prompt))
        assert counters(pair, pair.decode) == (received + 1, failed), why_not_pulled(pair.decode)


def last_digest(pair: Pair, name: str) -> dict:
    """The last KV digest the ``name`` server's connector wrote (``nixl_kv.vllm.digest``)."""
    return json.loads((pair.files / f"{name}.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize("source", ["prefill", "victim"])
def test_the_decode_receives_the_prefills_kv_byte_for_byte(pair: Pair, source: str) -> None:
    """The digest of the prompt's KV, token by token, the prefill's after its forward and the decode's once pulled,
    before vLLM computes on it: the same bytes also from a prefill of 64-token blocks into the decode's 32."""
    prompt = prompt_of(257, seed=9)
    params = prefilled_params(pair, getattr(pair, source), prompt)
    ctx = last_digest(pair, source)
    assert decode_with(pair, prompt, params) == (200, pair.expected(prompt))
    gen = last_digest(pair, "decode")
    assert (gen["tokens"], gen["ctx_request"]) == (ctx["tokens"], ctx["ctx_request"]) == (257, ctx["ctx_request"])
    assert gen["digest"] == ctx["digest"]


def test_a_killed_prefill_costs_its_deadline_and_a_recompute_never_a_wrong_token(pair: Pair) -> None:
    prompt = prompt_of(400, seed=6)
    params = prefilled_params(pair, pair.victim, prompt)
    pair.victim.kill()
    received, failed = counters(pair, pair.decode)
    started = time.monotonic()
    status, tokens = decode_with(pair, prompt, params)
    elapsed = time.monotonic() - started
    assert (status, tokens) == (200, pair.expected(prompt))
    assert elapsed < TRANSFER_TIMEOUT_MS / 1000 + 20, elapsed  # the deadline, then a recompute on 2 busy cores
    assert counters(pair, pair.decode) == (received, failed + 1)
    # the decode instance goes on serving through the live prefill
    assert complete(pair.client, pair.router.url, prompt, MAX_TOKENS).tokens == pair.expected(prompt)


def test_a_prefill_killed_mid_transfer_costs_a_recompute_never_a_wrong_token_or_a_hang(pair: Pair) -> None:
    """The decode's READ is held in flight (``tests/vllm_held_reads.py``) while the prefill is killed and past the
    pull's deadline: the pull fails, vLLM recomputes the prompt, and the answer is aggregated vLLM's. Last: the
    router's prefill is gone after it."""
    prompt = prompt_of(500, seed=10)
    expected = pair.expected(prompt)
    params = prefilled_params(pair, pair.prefill, prompt)
    hold, held = pair.files / "hold", pair.files / "hold.held"
    received, failed = counters(pair, pair.decode)
    hold.touch()
    try:
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            answer = pool.submit(decode_with, pair, prompt, params)
            while not held.exists():  # the pull's READ is posted and not seen finished
                assert time.monotonic() < started + 60 and not answer.done(), "no READ was held"
                time.sleep(0.05)
            pair.prefill.kill()
            time.sleep(TRANSFER_TIMEOUT_MS / 1000 + 1)  # the pull's deadline passes with its READ in flight
            hold.unlink()
            assert answer.result(timeout=120) == (200, expected)
    finally:
        hold.unlink(missing_ok=True)
    assert time.monotonic() - started < TRANSFER_TIMEOUT_MS / 1000 + 30  # the deadline, then a recompute
    assert counters(pair, pair.decode) == (received, failed + 1), why_not_pulled(pair.decode)
    # the decode instance goes on serving
    assert complete(pair.client, pair.decode.url, prompt, MAX_TOKENS).tokens == expected
