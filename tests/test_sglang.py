"""nixl_kv inside a real SGLang: a prefill and a decode ``sglang.launch_server`` with nixl_kv's transfer backend,
against one aggregated SGLang server on the same checkpoint. Every output must be identical.

The servers run from the venv ``scripts/sglang_env.sh`` makes (``NIXL_KV_SGLANG_PYTHON``, else ``.venv-sglang``),
with the CPU stand-ins of ``tests/sglang_stubs``. SGLang starts slowly on 2 cores (about a minute each), so one
module-scoped set of four servers serves every test: two prefills and a decode, and the aggregated reference. The
prefills' pages are 32 tokens, the decode's 16: a pairing SGLang's own backends refuse (its decode raises "Page size
mismatch"). The dead-prefill tests kill the second prefill; the first serves the checks that follow. The decode's
READs can be held in flight (``NIXL_KV_SGLANG_TEST_HOLD``, tests/sglang_stubs/nixl_kv_hold.py): over UCX's shared
memory a READ completes too fast for a kill or an abort to be timed into it otherwise.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from nixl_kv.errors import NotSupportedError
from nixl_kv.layout import LayoutKind
from nixl_kv.serving.launcher import Server
from nixl_kv.sglang.client import Generation, Pair, body_of, generate, generate_pair, new_room
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
# a prefill whose bootstrap server does not answer: SGLang 0.5.23's decode tries 15 times, 1 s apart (fixed), then fails
HANDSHAKE_S = 15
HOLD_S = 1.0  # how long a test keeps an aborted request's READ in flight

pytestmark = pytest.mark.sglang


@dataclass
class Servers:
    pair: Pair  # the shared prefill (32-token pages) and the decode (16-token pages)
    doomed: Pair  # a second prefill into the same decode, killed by the dead-prefill tests
    aggregated: Server
    doomed_prefill: Server
    client: httpx.Client
    hold: Path  # while this file exists, the decode's READs stay in flight (tests/sglang_stubs/nixl_kv_hold.py)

    @property
    def held(self) -> Path:
        return self.hold.with_name(self.hold.name + ".held")

    def hold_reads(self) -> None:
        self.held.unlink(missing_ok=True)
        self.hold.touch()

    def expected(self, prompt: list[int]) -> tuple[int, ...]:
        answer = generate(self.client, self.aggregated.url, body_of(prompt, MAX_TOKENS))
        assert answer.status == 200 and len(answer.tokens) == MAX_TOKENS, answer
        return answer.tokens

    def releases(self) -> dict[str, float]:
        """The decode's deferred page releases so far, by outcome (drained, timeout, error), and the seconds held."""
        text = self.client.get(self.pair.decode + "/metrics").text
        counts = {"drained": 0.0, "timeout": 0.0, "error": 0.0, "seconds": 0.0}
        for line in text.splitlines():
            if line.startswith("sglang:decode_deferred_kv_release_total{"):
                outcome = re.search(r'outcome="(\w+)"', line)
                assert outcome, line
                counts[outcome.group(1)] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("sglang:decode_deferred_kv_release_seconds_sum"):
                counts["seconds"] += float(line.rsplit(" ", 1)[1])
        return counts

    def wait_for(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
            time.sleep(0.1)

    def in_background(self, pair: Pair, prompt: list[int], rid: str | None = None) -> Future[Generation]:
        return self.pool.submit(generate_pair, self.client, pair, prompt, MAX_TOKENS, rid)

    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    if not Path(PYTHON).exists():
        pytest.fail(f"no SGLang venv at {PYTHON}: scripts/test.sh makes it (scripts/sglang_env.sh)")
    directory = tmp_path_factory.mktemp("sglang")
    model = make_model(directory / "model", python=PYTHON, stubs=STUBS)
    hold = directory / "hold"
    decode_env = (("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", str(HEARTBEAT_S)),
                  ("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", str(HEARTBEAT_FAILURES)),
                  ("NIXL_KV_SGLANG_TEST_HOLD", str(hold)))  # fmt: skip
    with SglangServers(model, python=PYTHON, stubs=STUBS, max_total_tokens=16384, context_length=2048) as launched:
        prefill, bootstrap = launched.start(Instance("prefill", page_size=32), "prefill")
        doomed, doomed_bootstrap = launched.start(Instance("prefill", page_size=32), "doomed-prefill")
        decode, _ = launched.start(
            Instance("decode", page_size=16, extra_args=("--enable-metrics",), extra_env=decode_env), "decode"
        )
        aggregated, _ = launched.start(Instance(page_size=16), "aggregated")
        launched.wait()
        with httpx.Client(timeout=120) as client:
            state = Servers(Pair(prefill.url, decode.url, bootstrap), Pair(doomed.url, decode.url, doomed_bootstrap),
                            aggregated, doomed, client, hold)  # fmt: skip
            yield state
            hold.unlink(missing_ok=True)
            state.pool.shutdown(wait=True)


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


def test_a_client_abort_mid_read_answers_at_once_and_holds_the_pages_until_the_read_ended(servers: Servers) -> None:
    """The decode request is aborted (SGLang's /abort_request) while its READ is in flight: the client gets the abort
    at once, SGLang keeps the request's pages until nixl_kv says no READ can land in them (its deferred release,
    ``is_abort_release_safe``), then takes them back; the next request decodes right."""
    before = servers.releases()
    servers.hold_reads()
    rid = f"abort-{new_room()}"
    answer = servers.in_background(servers.pair, prompt_of(300, seed=7), rid)
    servers.wait_for(servers.held.exists, 120, "the READ in flight")
    assert servers.client.post(servers.pair.decode + "/abort_request", json={"rid": rid}).status_code == 200
    aborted = answer.result(60)
    assert aborted.status == 500 and aborted.finish_reason == "abort", aborted
    held_from = time.monotonic()
    time.sleep(HOLD_S)  # the READ is still in flight: the pages stay SGLang's deferred release's
    assert servers.releases() == before
    servers.hold.unlink()
    servers.wait_for(lambda: servers.releases()["drained"] == before["drained"] + 1, 60, "the pages released")
    after = servers.releases()
    assert after["timeout"] == before["timeout"] and after["error"] == before["error"]
    assert after["seconds"] - before["seconds"] >= min(HOLD_S, time.monotonic() - held_from) - 0.05
    print(f"abort answered while the READ was held; pages held {after['seconds'] - before['seconds']:.2f} s")
    prompt = prompt_of(300, seed=8)
    follow = generate_pair(servers.client, servers.pair, prompt, MAX_TOKENS)
    assert follow.status == 200 and follow.tokens == servers.expected(prompt), follow


def test_a_prefill_killed_mid_read_costs_its_deadline_and_an_error_and_the_decode_keeps_serving(
    servers: Servers,
) -> None:
    """The prefill handed out the params and the decode's READ is in flight when the prefill dies: the client gets an
    error within the dead-peer deadline (SGLang's heartbeat), no tokens; the pages come back once the READ ended;
    the decode serves the next request through the live prefill."""
    before = servers.releases()
    servers.hold_reads()
    answer = servers.in_background(servers.doomed, prompt_of(400, seed=5))
    servers.wait_for(servers.held.exists, 120, "the READ in flight")
    servers.doomed_prefill.kill()
    killed = time.monotonic()
    failed = answer.result(DEADLINE_S * 5)
    elapsed = time.monotonic() - killed
    assert failed.status == 500 and not failed.tokens, failed
    assert elapsed < DEADLINE_S * 5, elapsed
    print(f"prefill killed mid-READ: the client's error {elapsed:.1f} s after the kill: {failed.error[:200]}")
    servers.hold.unlink()
    servers.wait_for(lambda: servers.releases()["drained"] == before["drained"] + 1, 60, "the pages released")
    prompt = prompt_of(200, seed=6)
    follow = generate_pair(servers.client, servers.pair, prompt, MAX_TOKENS)
    assert follow.status == 200 and follow.tokens == servers.expected(prompt), follow


def test_a_prefill_dead_before_the_request_costs_its_deadline_and_an_error(servers: Servers) -> None:
    """The router hands the decode a dead prefill's bootstrap info: an error once SGLang's handshake gives up (its
    bootstrap server answers nothing), never a token."""
    servers.doomed_prefill.kill()  # already dead when the test above ran
    started = time.monotonic()
    answer: Generation = generate_pair(servers.client, servers.doomed, prompt_of(400, seed=5), MAX_TOKENS)
    elapsed = time.monotonic() - started
    assert answer.status == 500 and not answer.tokens, answer
    assert elapsed < HANDSHAKE_S * 5, elapsed
    print(f"prefill dead before the request: the client's error after {elapsed:.1f} s: {answer.error[:200]}")
    prompt = prompt_of(100, seed=9)
    follow = generate_pair(servers.client, servers.pair, prompt, MAX_TOKENS)
    assert follow.status == 200 and follow.tokens == servers.expected(prompt), follow
