"""A hybrid Mamba2 + attention model (Granite-4.0-H-like, ``granite_hybrid``) through NixlKvConnector inside real vLLM,
with vLLM's hybrid KV cache manager on (``SupportsHMA``): the attention KV and the Mamba conv and SSM state move in
one pull, and every output must equal an aggregated vLLM's on the same checkpoint.

One module-scoped set of servers (prefix caching off, as vLLM runs Mamba state without its "align" mode): a prefill,
a decode, a decode of tensor-parallel size 2 (the state resharded by heads and groups) and a router. The reference
tokens are the decode instance's own for the request without ``kv_transfer_params``: vLLM's aggregated path (the
connector matches nothing), one server fewer to start on 2 cores. The last test kills the prefill.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from nixl_kv.vllm.client import complete, prompt_of
from nixl_kv.vllm.launch import KINDS, Instance, VllmServers
from tests.test_vllm import (
    MAX_TOKENS,
    PYTHON,
    TRANSFER_TIMEOUT_MS,
    Pair,
    assert_concurrent_answers,
    checkpoint,
    counters,
    decode_with,
    prefilled_params,
    why_not_pulled,
)

pytestmark = pytest.mark.vllm
HMA_OFF = "Turning off hybrid kv cache manager"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    model = checkpoint(tmp_path_factory, "granite_hybrid")
    args = KINDS["granite_hybrid"]
    decode_config = (("transfer_timeout_ms", TRANSFER_TIMEOUT_MS),)
    with VllmServers(model, python=PYTHON, max_model_len=2048) as servers:
        prefill = servers.start(Instance("kv_producer", extra_args=args), "prefill")
        decode = servers.start(Instance("kv_consumer", extra_config=decode_config, extra_args=args), "decode")
        wide = servers.start(Instance("kv_both", tp=2, extra_args=args), "decode-tp2")
        router = servers.start_router([prefill], [decode])
        servers.wait()
        with httpx.Client(timeout=120) as client:
            yield Pair(prefill, decode, decode, router, prefill, wide, client)


def test_vllm_keeps_its_hybrid_kv_cache_manager_with_nixl_kv(pair: Pair) -> None:
    for server in (pair.prefill, pair.decode, pair.wide):  # it logs this at start when a connector lacks SupportsHMA
        assert server.log.read_text().count(HMA_OFF) == 0, server.role


@pytest.mark.parametrize("length", [2, 33, 257, 1000])
def test_the_hybrid_pair_decodes_what_aggregated_vllm_decodes(pair: Pair, length: int) -> None:
    prompt = prompt_of(length, seed=11)
    expected = pair.expected(prompt)
    received, failed = counters(pair, pair.decode)
    answer = complete(pair.client, pair.router.url, prompt, MAX_TOKENS)
    assert answer.status == 200, answer.error
    assert answer.tokens == expected
    assert counters(pair, pair.decode) == (received + 1, failed), why_not_pulled(pair.decode)  # pulled, not computed


def test_concurrent_hybrid_requests_each_decode_what_aggregated_vllm_decodes(pair: Pair) -> None:
    assert_concurrent_answers(pair, [prompt_of(40 + 61 * i, seed=12) for i in range(6)])


def test_a_tensor_parallel_decode_reshards_the_mamba_state_by_heads_and_groups(pair: Pair) -> None:
    prompt = prompt_of(300, seed=13)
    expected = pair.expected(prompt)
    received, failed = counters(pair, pair.wide)
    params = prefilled(pair, prompt)
    assert decode_with(pair, prompt, params, pair.wide) == (200, expected)
    assert counters(pair, pair.wide) == (received + 2, failed), why_not_pulled(pair.wide)  # one pull per rank


def test_a_killed_hybrid_prefill_costs_its_deadline_and_a_recompute_never_a_wrong_token(pair: Pair) -> None:
    prompt = prompt_of(400, seed=14)
    expected = pair.expected(prompt)
    params = prefilled(pair, prompt)
    pair.prefill.kill()
    received, failed = counters(pair, pair.decode)
    started = time.monotonic()
    assert decode_with(pair, prompt, params) == (200, expected)
    assert time.monotonic() - started < TRANSFER_TIMEOUT_MS / 1000 + 20  # the deadline, then a recompute
    assert counters(pair, pair.decode) == (received, failed + 1)


def prefilled(pair: Pair, prompt: list[int]) -> dict:
    params = prefilled_params(pair, pair.prefill, prompt)
    assert params["remote_num_tokens"] == len(prompt) - 1  # the decode computes the last token on the state before it
    return params
