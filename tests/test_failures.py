"""What happens when a transfer is slow or goes wrong: deadlines, cancellation, poisoning, dead peers,
layer-wise arrival, prefix reuse, the sliding window and the transfer summaries. Real agents throughout."""

from __future__ import annotations

import base64
import csv
import dataclasses
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.errors import IncompatibleStateError, NotSupportedError
from nixl_kv.harness.fill import expected
from nixl_kv.interfaces import TransferStatus
from nixl_kv.layout import LayoutKind
from nixl_kv.progress import ContextProgress
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.state import CacheState, ModelConfig, ParallelConfig
from nixl_kv.transceiver import CacheTransceiver, create_cache_transceiver
from tests.conftest import Pair, Shape, Side

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def stalled(side: Side) -> Iterator[threading.Event]:
    """Block a transceiver's progress loop: the peer never answers until the block ends."""
    release = threading.Event()
    side.transceiver._loop.submit(lambda: release.wait(10))
    try:
        yield release
    finally:
        release.set()


def _poll_gen(pair: Pair, request_id: int, timeout_s: float = 10.0) -> str:
    """Poll gen status checks (at_least=0) until the request is reported; returns completed or error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        statuses = pair.gen.transceiver.check_gen_transfer_status(at_least=0)
        if request_id in statuses.completed_request_ids:
            return "completed"
        if request_id in statuses.error_request_ids:
            return "error"
        time.sleep(0.005)
    return "pending"


# --- configuration and factory --------------------------------------------------------------------------------
def test_environment_overrides_and_validation() -> None:
    env = {"NIXL_KV_LEASE_MS": "750", "NIXL_KV_KV_TRANSFER_TIMEOUT_MS": "none", "NIXL_KV_ENABLE_INFLIGHT_CANCEL": "0"}
    config = CacheTransceiverConfig.from_env(CacheTransceiverConfig(kv_transfer_timeout_ms=5), env)
    assert (config.lease_ms, config.kv_transfer_timeout_ms, config.enable_inflight_cancel) == (750, None, False)
    with pytest.raises(ValueError, match="NIXL_KV_LEASE_MS: expected an integer, got 'soon'"):
        CacheTransceiverConfig.from_env(environ={"NIXL_KV_LEASE_MS": "soon"})
    with pytest.raises(ValueError, match="enable_inflight_cancel needs kv_transfer_timeout_ms"):
        CacheTransceiverConfig(enable_inflight_cancel=True)
    with pytest.raises(ValueError, match="lease_ms must be at least 1"):
        CacheTransceiverConfig(lease_ms=0)


def test_factory_backend_selection() -> None:
    shape = Shape()
    assert create_cache_transceiver(shape.cache(), shape.state(), None) is None  # no config: disabled
    chosen = create_cache_transceiver(
        shape.cache(), shape.state(), CacheTransceiverConfig(backend="DEFAULT"), environ={"NIXL_KV_USE_NIXL": "1"}
    )
    try:
        assert chosen.config.backend == "NIXL"
    finally:
        chosen.close()
    with pytest.raises(NotSupportedError, match="no transfer agent named 'CARRIER_PIGEON'"):
        create_cache_transceiver(
            shape.cache(), shape.state(), CacheTransceiverConfig(), environ={"NIXL_KV_BACKEND": "CARRIER_PIGEON"}
        )
    by_environment = create_cache_transceiver(
        shape.cache(), shape.state(), CacheTransceiverConfig(), environ={"NIXL_KV_BACKEND": "MOONCAKE"}
    )
    try:
        assert by_environment.config.backend == "MOONCAKE" and type(by_environment._agent).__name__ == "MooncakeAgent"
    finally:
        by_environment.close()


# --- deadlines and cancellation -----------------------------------------------------------------------------------
def test_deadline_is_observe_only_by_default(pair_factory) -> None:
    pair = pair_factory(gen_config={"kv_transfer_timeout_ms": 100})
    ctx_request = pair.prefill(1, 40)
    request = pair.gen_request(5, ctx_request)
    with stalled(pair.ctx):
        pair.gen.transceiver.request_and_receive_async(request)
        time.sleep(0.3)
        assert _poll_gen(pair, 5, timeout_s=0.05) == "pending"  # past its deadline, not cancelled
        assert pair.gen.transceiver.metrics.snapshot()["gen"]["timeouts"] == 1
    assert _poll_gen(pair, 5) == "completed"
    assert pair.mismatches(5, 1, 40) == 0


def test_inflight_cancel_ends_a_timed_out_read_in_error(pair_factory) -> None:
    pair = pair_factory(gen_config={"kv_transfer_timeout_ms": 150, "enable_inflight_cancel": True})
    request = pair.gen_request(5, pair.prefill(1, 40))
    with stalled(pair.ctx):
        start = time.monotonic()
        pair.gen.transceiver.request_and_receive_async(request)
        assert _poll_gen(pair, 5) == "error"
        elapsed = time.monotonic() - start
    assert 0.15 <= elapsed < 1.0, elapsed
    assert request.state is RequestState.TRANS_ERROR and "cancelled on the gen side" in request.error
    counters = pair.gen.transceiver.metrics.snapshot()["gen"]
    assert (counters["timeouts"], counters["cancellations"], counters["failures"]) == (1, 1, 1)
    with pytest.raises(ValueError, match="finite status checks"):
        pair.gen.transceiver.check_gen_transfer_status(None)
    # the ctx side heard of the failure and released the blocks without waiting for its lease
    statuses = pair.ctx.transceiver.check_context_transfer_status(None)
    assert statuses.error_request_ids == {1}


def test_a_ctx_peer_that_never_answers_fails_the_request_at_its_lease(pair_factory) -> None:
    pair = pair_factory(ctx_config={"lease_ms": 400})
    request = pair.gen_request(5, pair.prefill(1, 40))
    with stalled(pair.ctx):
        start = time.monotonic()
        pair.gen.transceiver.request_and_receive_sync(request)
        elapsed = time.monotonic() - start
    assert request.state is RequestState.TRANS_ERROR and "deadline passed waiting for" in request.error
    assert 0.3 <= elapsed < 1.5, elapsed


@pytest.mark.parametrize("when", ["before", "during"])
def test_gen_cancel_before_and_during_the_read(pair_factory, when: str) -> None:
    pair = pair_factory()
    request = pair.gen_request(5, pair.prefill(1, 40))
    pair.meet()  # the READ is posted at once: the cancel comes after it
    agent = pair.gen.transceiver._agent
    real_status, landed = agent.status, threading.Event()
    # fault injection: the READ stays in flight until ``landed``. A stalled ctx cannot hold it: a one-sided READ
    # through UCX's shared-memory transports completes without the target's progress (it once did within 0.1 s)
    agent.status = lambda handle: real_status(handle) if landed.is_set() else TransferStatus.IN_PROGRESS
    pair.gen.transceiver.request_and_receive_async(request)
    if when == "during":
        time.sleep(0.1)
    assert pair.gen.transceiver.cancel_request(request)
    assert _poll_gen(pair, 5) == "error"
    # the READ never left in progress: it may still land, so its destination stays pinned
    assert pair.gen.transceiver.has_poisoned_transfer_buffer()
    pair.gen.cache.free(5)
    assert pair.gen.cache.free_blocks == pair.shape.num_blocks - 3
    assert "cancelled on the gen side" in request.error
    assert not pair.gen.transceiver.cancel_request(request)  # after the end: nothing to cancel
    assert pair.ctx.transceiver.check_context_transfer_status(None).error_request_ids == {1}
    landed.set()
    deadline = time.monotonic() + 5
    while pair.gen.transceiver.has_poisoned_transfer_buffer() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pair.gen.cache.free_blocks == pair.shape.num_blocks  # unpinned once the READ left in progress


def test_an_abandoned_read_poisons_its_destination_until_it_leaves_in_progress(pair_factory) -> None:
    pair = pair_factory()
    pair.meet()  # the READ is posted at once: the cancel comes after it
    request = pair.gen_request(5, pair.prefill(1, 40))
    agent = pair.gen.transceiver._agent
    real_status, landed = agent.status, threading.Event()
    # fault injection: the READ stays in flight until ``landed``; releasing its handle succeeds at once, as
    # NIXL's UCX release does, but that is no cancel: the GET may still write into the destination
    agent.status = lambda handle: real_status(handle) if landed.is_set() else TransferStatus.IN_PROGRESS
    pair.gen.transceiver.request_and_receive_async(request)
    time.sleep(0.1)
    assert pair.gen.transceiver.cancel_request(request)
    assert _poll_gen(pair, 5) == "error"
    time.sleep(0.3)  # several retries of the stuck READ
    assert pair.gen.transceiver.has_poisoned_transfer_buffer()
    pair.gen.cache.free(5)
    assert pair.gen.cache.free_blocks == pair.shape.num_blocks - 3  # still pinned: a READ may land there
    landed.set()
    deadline = time.monotonic() + 5
    while pair.gen.transceiver.has_poisoned_transfer_buffer() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pair.gen.transceiver.has_poisoned_transfer_buffer()
    assert pair.gen.cache.free_blocks == pair.shape.num_blocks  # freed once the READ left in progress


def test_close_returns_the_destination_of_a_read_still_in_flight(pair_factory) -> None:
    """A READ abandoned at its deadline and still in progress when the gen transceiver closes: once the agent is
    closed (memory deregistered, endpoints gone) nothing can land, so close unpins its blocks (they once stayed
    pinned for good, which the soak's new leftover count found)."""
    pair = pair_factory()
    pair.meet()  # the READ is posted at once: the cancel comes after it
    request = pair.gen_request(5, pair.prefill(1, 40))
    agent = pair.gen.transceiver._agent
    agent.status = lambda handle: TransferStatus.IN_PROGRESS  # the READ never leaves in progress
    pair.gen.transceiver.request_and_receive_async(request)
    time.sleep(0.1)
    assert pair.gen.transceiver.cancel_request(request) and _poll_gen(pair, 5) == "error"
    pair.gen.cache.free(5)
    assert pair.gen.cache.pinned_requests == 1 and pair.gen.transceiver.has_poisoned_transfer_buffer()
    pair.gen.transceiver.close()
    assert pair.gen.cache.pinned_requests == 0 and pair.gen.cache.free_blocks == pair.shape.num_blocks
    assert not pair.gen.transceiver._receiver.poisoned


# --- a dead ctx process -----------------------------------------------------------------------------------------------
def test_a_ctx_process_killed_mid_transfer_ends_gen_requests_in_error_and_gen_goes_on(pair_factory) -> None:
    pair = pair_factory()
    ctx = subprocess.Popen(
        [sys.executable, "-m", "tests.ctx_process", "1500", "40"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        line = next(line for line in ctx.stdout if line.startswith("PARAMS "))  # NIXL logs to stdout too
        params = base64.b64decode(line.split()[1])
        pair.gen.cache.allocate(5, 40)
        request = TransferRequest(5, context_phase_params=params)
        start = time.monotonic()
        pair.gen.transceiver.request_and_receive_async(request)
        first_layer = expected(1, pair.shape.where(40), 2)[0]
        deadline = time.monotonic() + 5  # the first layer is read, the rest waits for a prefill that never finishes
        while not np.array_equal(pair.gen.cache.read_tokens(5, 40)[0], first_layer) and time.monotonic() < deadline:
            time.sleep(0.01)
        ctx.kill()
        ctx.wait(10)
        assert _poll_gen(pair, 5) == "error"
        elapsed = time.monotonic() - start
    finally:
        ctx.kill()
    assert request.state is RequestState.TRANS_ERROR and elapsed < 3.0, (elapsed, request.error)
    got = pair.gen.cache.read_tokens(5, 40)
    assert pair.mismatches(5, 1, 40) > 0 and np.array_equal(got[0], first_layer)
    # the gen instance goes on serving a new ctx instance
    again = pair.gen_request(6, pair.prefill(2, 40))
    pair.gen.transceiver.request_and_receive_sync(again)
    assert again.state is RequestState.GENERATION_TRANS_COMPLETE and pair.mismatches(6, 2, 40) == 0


# --- layer-wise, prefix reuse, sliding window -----------------------------------------------------------------------
@pytest.mark.parametrize("gen_kind", [LayoutKind.BLOCK_MAJOR, LayoutKind.PER_LAYER_NHD], ids=["direct", "staged"])
def test_layer_wise_reads_each_layer_when_it_is_ready(pair_factory, gen_kind: LayoutKind) -> None:
    pair = pair_factory(gen_kind=gen_kind)
    shape = pair.shape
    pair.ctx.cache.allocate(1, 40)
    values = expected(1, shape.where(40), shape.dtype.itemsize)
    pair.ctx.cache.write_tokens(1, values)
    progress = ContextProgress(shape.layers)
    ctx_request = TransferRequest(1, num_tokens=40)
    pair.ctx.transceiver.respond_and_send_layer_wise([ctx_request], progress)
    assert ctx_request.state is RequestState.CONTEXT_INIT_AND_TRANS
    request = pair.gen_request(5, ctx_request)
    pair.gen.transceiver.request_and_receive_async(request)
    seen = []
    for layer in [1, 0, 3, 2]:  # marked out of order: readiness is the contiguous prefix
        progress.mark_layer_done(layer)
        ready = progress.layers_ready
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            got = pair.gen.cache.read_tokens(5, 40)
            arrived = [bool(np.array_equal(got[i], values[i])) for i in range(shape.layers)]
            if sum(arrived) >= ready:
                break
            time.sleep(0.005)
        seen.append(arrived)
    assert seen == [[False] * 4, [True, True, False, False], [True, True, False, False], [True] * 4]
    assert _poll_gen(pair, 5) == "completed" and pair.mismatches(5, 1, 40) == 0


def test_prefix_reuse_moves_only_the_missing_blocks(pair_factory) -> None:
    pair = pair_factory()
    ctx_request = pair.prefill(1, 100)  # 7 blocks of 16
    pair.gen.cache.allocate(5, 100)
    held = expected(99, pair.shape.where(100), 2)  # what the gen side already holds: other content, on purpose
    pair.gen.cache.write_tokens(5, held)
    request = TransferRequest(5, context_phase_params=ctx_request.context_phase_params, reused_blocks=3)
    pair.gen.transceiver.request_and_receive_sync(request)
    assert request.state is RequestState.GENERATION_TRANS_COMPLETE, request.error
    assert request.transfer_bytes == 4 * pair.gen.cache.layout.block_bytes
    got, want = pair.gen.cache.read_tokens(5, 100), expected(1, pair.shape.where(100), 2)
    assert np.array_equal(got[..., :48, :], held[..., :48, :])  # the reused prefix was not touched
    assert np.array_equal(got[..., 48:, :], want[..., 48:, :])  # the suffix arrived


def test_sliding_window_moves_only_the_last_window_blocks(pair_factory) -> None:
    shape = Shape()
    state = CacheState(
        ModelConfig((shape.heads,) * shape.layers, shape.head_dim, shape.tokens_per_block, attention_window=32),
        ParallelConfig(attention_layers_per_pp_rank=(shape.layers,)),
        shape.dtype,
    )
    sides = [shape.cache(), shape.cache()]
    ctx, gen = (CacheTransceiver(cache, state) for cache in sides)
    try:
        pair = Pair(shape, Side(sides[0], ctx), Side(sides[1], gen))
        request = pair.gen_request(5, pair.prefill(1, 160))  # 10 blocks; window 32 tokens = 2 blocks, + 1
        gen.request_and_receive_sync(request)
        assert request.state is RequestState.GENERATION_TRANS_COMPLETE, request.error
        assert request.transfer_bytes == 3 * sides[1].layout.block_bytes
        got, want = sides[1].read_tokens(5, 160), expected(1, shape.where(160), 2)
        assert not got[..., : 7 * 16, :].any()  # outside the window: never moved
        assert np.array_equal(got[..., 7 * 16 :, :], want[..., 7 * 16 :, :])
    finally:
        ctx.close()
        gen.close()


# --- transfer summaries ---------------------------------------------------------------------------------------
def test_csv_summaries_on_both_sides(pair_factory, tmp_path: Path) -> None:
    out = {"time_output_path": str(tmp_path)}
    pair = pair_factory(ctx_config=out, gen_config=out)
    for rid, tokens in [(1, 40), (2, 17)]:
        request = pair.gen_request(10 + rid, pair.prefill(rid, tokens))
        pair.gen.transceiver.request_and_receive_async(request)
    pair.gen.transceiver.check_gen_transfer_status(None)
    pair.ctx.transceiver.check_context_transfer_status(None, mark_complete=True)
    block = pair.gen.cache.layout.block_bytes
    for side, ids in (("gen", ["11", "12"]), ("ctx", ["1", "2"])):
        (path,) = tmp_path.glob(f"*_0_{side}_transfer_summary.csv")
        rows = list(csv.DictReader(path.open()))
        assert [row["request_id"] for row in rows] == ids
        assert [int(row["bytes"]) for row in rows] == [3 * block, 2 * block]
        assert all(row["outcome"] == "completed" and float(row["transfer_ms"]) > 0 for row in rows)
    assert pair.gen.transceiver.metrics.snapshot()["gen"]["requests"] == 2
    assert pair.gen.transceiver.metrics.snapshot()["gen"]["bytes"] == 5 * block


# --- hostile or broken peers and bugs (regressions found in review) ------------------------------------------------
def test_a_short_grant_fails_the_request_instead_of_delivering_stale_bytes(pair_factory) -> None:
    pair = pair_factory(ctx_kind=LayoutKind.PER_LAYER_NHD)  # staged, packed by the ctx side (not gathered)
    serve = pair.ctx.transceiver._sender._serve
    real_grant = serve.grant

    def short_grant(reader, claim):  # a broken ctx: grants half of the packed box
        grant = real_grant(reader, claim)
        return dataclasses.replace(grant, nbytes=grant.nbytes // 2)

    serve.grant = short_grant
    request = pair.gen_request(5, pair.prefill(1, 40))
    pair.gen.transceiver.request_and_receive_sync(request)
    assert request.state is RequestState.TRANS_ERROR and "granted" in request.error and "-byte box" in request.error


def test_an_unexpected_error_while_unpacking_ends_the_request_in_error(pair_factory) -> None:
    pair = pair_factory(ctx_kind=LayoutKind.PER_LAYER_NHD)  # staged, packed by the ctx side (not gathered)
    formatter = pair.gen.transceiver._receiver._formatter

    def out_of_memory(*args: object) -> None:
        raise MemoryError("device out of memory")

    formatter.unpack = out_of_memory
    request = pair.gen_request(5, pair.prefill(1, 40))
    pair.gen.transceiver.request_and_receive_sync(request)
    assert request.state is RequestState.TRANS_ERROR and "MemoryError: device out of memory" in request.error
    assert pair.gen.transceiver._staging.free_slots == pair.gen.transceiver.config.num_staging_slots


def test_no_readers_from_an_agent_that_cannot_be_reached_is_ignored(pair_factory) -> None:
    from nixl_kv import wire
    from nixl_kv.protocol import NoReaders

    pair = pair_factory()
    ctx_request = pair.prefill(1, 40)
    spoof = NoReaders(pair.ctx.transceiver.instance_id, 1, b"not metadata")
    pair.ctx.transceiver._loop.call(lambda: pair.ctx.transceiver._sender._count.on_no_readers("intruder", spoof))
    assert _poll_ctx_pending(pair) == 1  # still pinned for its real reader
    request = pair.gen_request(5, ctx_request)
    pair.gen.transceiver.request_and_receive_sync(request)
    assert request.state is RequestState.GENERATION_TRANS_COMPLETE and pair.mismatches(5, 1, 40) == 0
    assert wire.decode(wire.encode(spoof), NoReaders) == spoof


def _poll_ctx_pending(pair: Pair) -> int:
    return pair.ctx.transceiver._sender.pending


def test_counters_reach_prometheus(pair_factory) -> None:
    prometheus = pytest.importorskip("prometheus_client")
    pair = pair_factory()
    request = pair.gen_request(5, pair.prefill(1, 40))
    pair.gen.transceiver.request_and_receive_async(request)
    pair.gen.transceiver.check_gen_transfer_status(None)
    labels = {"side": "gen", "instance": pair.gen.transceiver.instance_id}
    assert prometheus.REGISTRY.get_sample_value("nixl_kv_requests_total", labels) == 1.0
    assert prometheus.REGISTRY.get_sample_value("nixl_kv_bytes_total", labels) == request.transfer_bytes
    assert prometheus.REGISTRY.get_sample_value("nixl_kv_failures_total", labels) == 0.0
    assert prometheus.REGISTRY.get_sample_value("nixl_kv_poisoned_slots", labels) == 0.0
    pair.ctx.transceiver.check_context_transfer_status(None)
    ctx_labels = {"side": "ctx", "instance": pair.ctx.transceiver.instance_id}
    assert prometheus.REGISTRY.get_sample_value("nixl_kv_requests_total", ctx_labels) == 1.0


@pytest.mark.parametrize("registers", [True, False], ids=["registers-late", "never-registers"])
def test_claims_that_arrive_before_the_ctx_rank_registers(pair_factory, registers: bool) -> None:
    # ranks of a ctx instance respond at slightly different times: a staged claim that reaches a rank first
    # waits (up to EARLY_GRACE_S) instead of failing the request, and is refused if the request never shows up
    pair = pair_factory(ctx_kind=LayoutKind.PER_LAYER_NHD)  # staged, packed by the ctx side (not gathered)
    table = pair.ctx.transceiver._sender._table
    ctx_request = pair.prefill(1, 40)
    with table.lock:
        entry = table.outgoing.pop(1)  # as if this rank had not called respond_and_send_async yet
    request = pair.gen_request(5, ctx_request)
    pair.gen.transceiver.request_and_receive_async(request)
    time.sleep(0.2)
    if registers:
        with table.lock:
            table.outgoing[1] = entry
        assert _poll_gen(pair, 5) == "completed" and pair.mismatches(5, 1, 40) == 0
    else:
        start = time.monotonic()
        assert _poll_gen(pair, 5) == "error"
        assert "not pinned here" in request.error and time.monotonic() - start < 2.0
        with table.lock:
            table.outgoing[1] = entry  # give it back so that closing releases it


def test_a_request_the_gen_side_refuses_is_released_on_the_ctx_side_at_once() -> None:
    """An incompatible pairing fails on the gen side before any byte moves; the ctx side hears of it and
    unpins the request's blocks then (once its hold promise, 20 ms, has run out), not at the end of its (here one
    minute) lease."""
    ctx_shape, gen_shape = Shape(), dataclasses.replace(Shape(), head_dim=16)
    ctx_cache, gen_cache = ctx_shape.cache(), gen_shape.cache()
    ctx = CacheTransceiver(ctx_cache, ctx_shape.state(), CacheTransceiverConfig(lease_ms=60_000))
    gen = CacheTransceiver(gen_cache, gen_shape.state())
    try:
        ctx_cache.allocate(1, 40)
        request = TransferRequest(1, num_tokens=40)
        ctx.respond_and_send_async(request)
        gen_cache.allocate(2, 40)
        received = TransferRequest(2, context_phase_params=request.context_phase_params)
        gen.request_and_receive_sync(received)
        assert received.state is RequestState.TRANS_ERROR and "head_dim: ours 16, peer 8" in received.error
        start = time.monotonic()
        ctx.check_context_transfer_status(None, mark_complete=True)
        assert time.monotonic() - start < 5
        assert request.state is RequestState.TRANS_ERROR
        assert "a gen rank cannot read the request: ctx and gen caches differ: head_dim" in request.error
        ctx_cache.free(1)
        give_up = time.monotonic() + 1
        while ctx_cache.free_blocks != ctx_shape.num_blocks and time.monotonic() < give_up:
            time.sleep(0.01)
        assert ctx_cache.free_blocks == ctx_shape.num_blocks  # unpinned: the blocks came back
    finally:
        ctx.close()
        gen.close()


def test_a_refused_retry_does_not_end_the_transfer_in_flight(pair_factory) -> None:
    """A second gen request for a ctx request already being received fails alone; the first one completes."""
    pair = pair_factory()
    ctx_request = pair.prefill(1, 40)
    first = pair.gen_request(5, ctx_request)
    with stalled(pair.ctx):
        pair.gen.transceiver.request_and_receive_async(first)
        pair.gen.cache.allocate(6, 1)  # too few blocks: planning would fail, and used to release the ctx side
        retry = TransferRequest(6, context_phase_params=ctx_request.context_phase_params)
        pair.gen.transceiver.request_and_receive_sync(retry)
    assert retry.state is RequestState.TRANS_ERROR and "is already being received" in retry.error
    assert _poll_gen(pair, 5) == "completed"
    assert pair.mismatches(5, 1, 40) == 0


def test_an_invalid_local_cache_state_fails_at_start() -> None:
    shape = Shape()
    state = dataclasses.replace(shape.state(), parallel=ParallelConfig(attention_layers_per_pp_rank=(1, 1)))
    with pytest.raises(IncompatibleStateError, match="this rank's cache state is not valid: CacheState.parallel"):
        CacheTransceiver(shape.cache(), state)
