"""An MLA model (DeepSeek-V2-style latent cache, ``deepseek_mla``) through NixlKvConnector inside real vLLM's CPU
build, whose CPU_MLA backend computes a token differently by batch and by path: four identical greedy requests sent
at once to one aggregated server gave four different continuations, and a decode instance computes a loaded
prompt's last token by the decode path, where aggregated vLLM uses the prefill path. So a pair's tokens are not
compared with aggregated vLLM's here (on a GPU they would be); what the connector owns is: the latent cache the
decode received is the prefill's, byte for byte (``kv_digest_file``), and without ``allow_cpu_mla`` the model is
refused by name at start.

One module-scoped pair (a prefill and a decode instance, both ``allow_cpu_mla``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from nixl_kv.vllm.client import prompt_of
from nixl_kv.vllm.launch import Instance
from tests.test_vllm import (
    PYTHON,
    TRANSFER_TIMEOUT_MS,
    Pair,
    checkpoint,
    counters,
    decode_with,
    last_digest,
    prefill_and_decode,
    prefilled_params,
    why_not_pulled,
)

pytestmark = pytest.mark.vllm
REFUSED = "MLA on vLLM's CPU build is refused"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    model = checkpoint(tmp_path_factory, "deepseek_mla")
    files = tmp_path_factory.mktemp("vllm-mla-files")

    def config(name: str) -> tuple[tuple[str, object], ...]:
        return (("allow_cpu_mla", True), ("kv_digest_file", str(files / f"{name}.jsonl")))

    decode_config = (("transfer_timeout_ms", TRANSFER_TIMEOUT_MS), *config("decode"))
    prefill = Instance("kv_producer", extra_config=config("prefill"))
    with prefill_and_decode(model, prefill, Instance("kv_consumer", extra_config=decode_config), files) as servers:
        yield servers


def test_vllm_cpu_mla_is_refused_by_name_without_allow_cpu_mla() -> None:
    """The connector's check as vLLM's CPU build runs it (no server: the check is the same at every start)."""
    code = (
        "from nixl_kv.vllm.connector import _check_cpu_mla; from nixl_kv.vllm.groups import CacheGroups\n"
        "_check_cpu_mla(CacheGroups(block_size=16, mla=True), allowed=True)\n"
        "_check_cpu_mla(CacheGroups(block_size=16), allowed=False)\n"
        "_check_cpu_mla(CacheGroups(block_size=16, mla=True), allowed=False)"
    )
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "NotSupportedError: nixl_kv.vllm: " + REFUSED in result.stderr, result.stderr


@pytest.mark.parametrize("length", [2, 33, 257, 1000])
def test_the_decode_receives_the_prefills_latent_cache_byte_for_byte(pair: Pair, length: int) -> None:
    prompt = prompt_of(length, seed=21)
    received, failed = counters(pair, pair.decode)
    params = prefilled_params(pair, pair.prefill, prompt)
    ctx = last_digest(pair, "prefill")
    status, tokens = decode_with(pair, prompt, params)
    assert status == 200 and len(tokens) > 0
    assert counters(pair, pair.decode) == (received + 1, failed), why_not_pulled(pair.decode)  # pulled, not computed
    gen = last_digest(pair, "decode")
    assert (gen["ctx_request"], gen["tokens"]) == (ctx["ctx_request"], ctx["tokens"]) == (ctx["ctx_request"], length)
    assert gen["digest"] == ctx["digest"]
    # and the pair is deterministic: the same prompt through it again decodes the same tokens
    assert decode_with(pair, prompt, prefilled_params(pair, pair.prefill, prompt)) == (status, tokens)
