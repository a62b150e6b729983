"""A sliding-window model (the llama checkpoint with a 96-token window in every layer, Mistral-like: ``llama_sw``)
through NixlKvConnector inside real vLLM, its hybrid KV cache manager on: one sliding-window KV cache group, whose
blocks wholly before the window of the prompt's last token are vLLM's null block on the decode instance and do not
move; the decode computes the prompt's last token itself (``CacheGroups.backoff``). Every output must equal
vLLM's own for the same request without a pull.

One module-scoped pair (a prefill and a decode instance, prefix caching off). The reference tokens are the decode
instance's own for the request without ``kv_transfer_params`` (vLLM's aggregated path: the connector matches
nothing), one server fewer to start on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nixl_kv.vllm.client import prompt_of, scrape
from nixl_kv.vllm.launch import SLIDING_WINDOW, Instance
from tests.test_vllm import (
    TRANSFER_TIMEOUT_MS,
    Pair,
    checkpoint,
    counters,
    decode_with,
    prefill_and_decode,
    prefilled_params,
    why_not_pulled,
)
from tests.test_vllm_hybrid import HMA_OFF

pytestmark = pytest.mark.vllm
BYTES = "vllm:nixl_kv_transfer_bytes_total"
# the reference is the decode's own answer, which with its prefix cache on would leave the pull a block to move
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)
BLOCK = 32  # tokens a block (Instance's default)
BLOCK_BYTES = 4 * 2 * BLOCK * 2 * 64 * 4  # layers, kv heads, tokens, K and V, head dim, float32


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    model = checkpoint(tmp_path_factory, "llama_sw")
    decode_config = (("transfer_timeout_ms", TRANSFER_TIMEOUT_MS),)
    prefill = Instance("kv_producer", extra_args=NO_PREFIX_CACHE)
    decode = Instance("kv_consumer", extra_config=decode_config, extra_args=NO_PREFIX_CACHE)
    with prefill_and_decode(model, prefill, decode) as servers:
        yield servers


def test_vllm_keeps_its_hybrid_kv_cache_manager_for_a_sliding_window(pair: Pair) -> None:
    for server in (pair.prefill, pair.decode):
        assert server.log.read_text().count(HMA_OFF) == 0, server.role


# within the window, one token past it, many blocks past it (those are null on the decode and do not move), and
# where the window's start falls at a block's end (window - 1 + 32: the decode's last token attends to a token there)
@pytest.mark.parametrize("length", [33, SLIDING_WINDOW + 1, SLIDING_WINDOW - 1 + BLOCK, 257, 1000])
def test_the_sliding_window_pair_decodes_what_vllm_decodes_alone(pair: Pair, length: int) -> None:
    prompt = prompt_of(length, seed=31)
    expected = pair.expected(prompt)
    received, failed = counters(pair, pair.decode)
    moved = scrape(pair.client, pair.decode.url).get(BYTES, 0.0)
    assert decode_with(pair, prompt, prefilled_params(pair, pair.prefill, prompt)) == (200, expected)
    assert counters(pair, pair.decode) == (received + 1, failed), why_not_pulled(pair.decode)  # pulled
    # all but the last token (the decode computes it), and of those only the blocks from the window of the last
    # token on: vLLM skips the tokens before it
    loaded = length - 1
    skipped_blocks = max(0, loaded - SLIDING_WINDOW + 1) // BLOCK
    moved = scrape(pair.client, pair.decode.url).get(BYTES, 0.0) - moved
    assert moved == (-(-loaded // BLOCK) - skipped_blocks) * BLOCK_BYTES
