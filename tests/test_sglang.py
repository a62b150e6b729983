"""nixl_kv inside a real SGLang: a prefill and a decode ``sglang.launch_server`` with nixl_kv's transfer backend,
against one aggregated SGLang server on the same checkpoint. Every output must be identical.

The servers run from the venv ``scripts/sglang_env.sh`` makes (``NIXL_KV_SGLANG_PYTHON``, else ``.venv-sglang``),
with the CPU stand-ins of ``tests/sglang_stubs``. SGLang starts slowly on 2 cores (about a minute each), so one
module-scoped set of three servers serves every test. The prefill's pages are 32 tokens, the decode's 16: a pairing
SGLang's own backends refuse (its decode raises "Page size mismatch"). The last test kills the prefill.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from nixl_kv.errors import NotSupportedError
from nixl_kv.layout import LayoutKind
from nixl_kv.serving.launcher import Server
from nixl_kv.sglang.client import Generation, Pair, body_of, generate, generate_pair
from nixl_kv.sglang.kv_args import describe, resolve_dtype
from nixl_kv.sglang.launch import Instance, SglangServers, make_model
from nixl_kv.vllm.client import prompt_of

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("NIXL_KV_SGLANG_PYTHON", str(ROOT / ".venv-sglang" / "bin" / "python"))
STUBS = str(ROOT / "tests" / "sglang_stubs")
MAX_TOKENS = 12
HEARTBEAT_S = 2  # the decode asks each prefill's bootstrap server this often whether it lives
HEARTBEAT_FAILURES = 2
DEADLINE_S = HEARTBEAT_S * (HEARTBEAT_FAILURES + 1)  # a dead prefill is noticed within this

pytestmark = pytest.mark.sglang


@dataclass
class Servers:
    pair: Pair
    aggregated: Server
    prefill: Server
    client: httpx.Client

    def expected(self, prompt: list[int]) -> tuple[int, ...]:
        answer = generate(self.client, self.aggregated.url, body_of(prompt, MAX_TOKENS))
        assert answer.status == 200 and len(answer.tokens) == MAX_TOKENS, answer
        return answer.tokens


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    if not Path(PYTHON).exists():
        pytest.fail(f"no SGLang venv at {PYTHON}: scripts/test.sh makes it (scripts/sglang_env.sh)")
    model = make_model(tmp_path_factory.mktemp("sglang") / "model", python=PYTHON, stubs=STUBS)
    heartbeat = (("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", str(HEARTBEAT_S)),
                 ("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", str(HEARTBEAT_FAILURES)))  # fmt: skip
    with SglangServers(model, python=PYTHON, stubs=STUBS, max_total_tokens=16384, context_length=2048) as launched:
        prefill, bootstrap = launched.start(Instance("prefill", page_size=32), "prefill")
        decode, _ = launched.start(Instance("decode", page_size=16, extra_env=heartbeat), "decode")
        aggregated, _ = launched.start(Instance(page_size=16), "aggregated")
        launched.wait()
        with httpx.Client(timeout=120) as client:
            yield Servers(Pair(prefill.url, decode.url, bootstrap), aggregated, prefill, client)


# --- without SGLang: its KV buffers as a layout ---------------------------------------------------------------------
def kv_args(layers: int = 2, pages: int = 8, page: int = 16, heads: int = 2, dim: int = 64) -> SimpleNamespace:
    item = page * heads * dim * 4
    ptrs = [0x10000 * (i + 1) for i in range(2 * layers)]  # K of each layer, then V of each layer
    return SimpleNamespace(kv_data_ptrs=ptrs, kv_data_lens=[item * pages] * len(ptrs), kv_item_lens=[item] * len(ptrs),
                           page_size=page, gpu_id=0, num_draft_entries=0)  # fmt: skip


def test_sglang_kv_buffers_describe_as_per_layer_pools_in_layer_then_kv_order() -> None:
    kv = describe(kv_args(), mla=False, dtype=resolve_dtype("auto", "float32"), total_kv_heads=2)
    layout = kv.layout
    assert (layout.kind, layout.num_layers, layout.kv_factor, layout.num_heads) == (LayoutKind.PER_LAYER_NHD, 2, 2, 2)
    assert (layout.num_blocks, layout.tokens_per_block, layout.head_dim, layout.itemsize) == (8, 16, 64, 4)
    assert [pool.address for pool in layout.pools] == [0x10000, 0x30000, 0x20000, 0x40000]  # L0K L0V L1K L1V
    mla = describe(kv_args(heads=1, dim=576), mla=True, dtype=resolve_dtype("float32"), total_kv_heads=1).layout
    assert (mla.kv_factor, mla.num_layers, mla.num_heads, mla.head_dim) == (1, 4, 1, 576)


def test_kv_buffers_that_do_not_describe_are_refused_by_name() -> None:
    with pytest.raises(NotSupportedError, match="'auto' everywhere"):
        resolve_dtype("auto", "auto", None)
    with pytest.raises(NotSupportedError, match="int4"):
        resolve_dtype("int4")
    with pytest.raises(NotSupportedError, match="is not 16 tokens x 3 heads"):
        describe(kv_args(), mla=False, dtype=resolve_dtype("float32"), total_kv_heads=3)
    with pytest.raises(NotSupportedError, match="draft"):
        describe(SimpleNamespace(**{**vars(kv_args()), "num_draft_entries": 2}), False, resolve_dtype("float32"), 2)


# --- real servers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 100, 1000])
def test_the_pair_decodes_what_aggregated_sglang_decodes(servers: Servers, length: int) -> None:
    """32-token pages read into 16-token pages: identical tokens."""
    prompt = prompt_of(length, seed=1)
    answer = generate_pair(servers.client, servers.pair, prompt, MAX_TOKENS)
    assert answer.status == 200, answer.error
    assert answer.tokens == servers.expected(prompt)
    assert answer.finish_reason == "length"


def test_concurrent_requests_each_decode_what_aggregated_sglang_decodes(servers: Servers) -> None:
    prompts = [prompt_of(50 + 37 * i, seed=2) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: generate_pair(servers.client, servers.pair, p, MAX_TOKENS), prompts))
    assert [a.status for a in answers] == [200] * 8, [a.error for a in answers]
    assert [a.tokens for a in answers] == [servers.expected(p) for p in prompts]


def test_a_killed_prefill_costs_its_deadline_and_an_error_never_a_wrong_token(servers: Servers) -> None:
    """The router handed the decode the prefill's bootstrap info; the prefill dies before it sends anything. (Last
    in this module: it kills the shared prefill.)"""
    servers.prefill.kill()
    prompt = prompt_of(400, seed=5)
    started = time.monotonic()
    answer: Generation = generate_pair(servers.client, servers.pair, prompt, MAX_TOKENS)
    elapsed = time.monotonic() - started
    assert answer.status == 500 and not answer.tokens, answer
    assert elapsed < DEADLINE_S * 5, elapsed
    # the decode goes on serving: an aggregated-style request is refused by a decode server, so ask its health
    assert servers.client.get(servers.pair.decode + "/health").status_code == 200
