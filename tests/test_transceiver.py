"""CacheTransceiver end to end in one process: two real NIXL agents on loopback, every element checked."""

from __future__ import annotations

import dataclasses
import time

import msgpack
import numpy as np
import pytest

from nixl_kv import wire
from nixl_kv.dtypes import DataType
from nixl_kv.errors import AgentError, WireFormatError
from nixl_kv.layout import LayoutKind
from nixl_kv.params_seal import seal
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.state import CommState, ContextPhaseParams
from tests.conftest import Pair, Shape, make_side


def _receive(pair: Pair, gen_id: int, ctx_request: TransferRequest) -> TransferRequest:
    request = pair.gen_request(gen_id, ctx_request)
    pair.gen.transceiver.request_and_receive_sync(request)
    return request


@pytest.mark.parametrize("dtype", [DataType.FLOAT32, DataType.BFLOAT16, DataType.INT8])
def test_every_element_arrives_for_lengths_around_the_block_size(pair_factory, dtype: DataType) -> None:
    pair = pair_factory(Shape(dtype=dtype))
    lengths = [1, 15, 16, 17, 100]
    ctx_requests = [pair.prefill(rid, n) for rid, n in enumerate(lengths)]
    for rid, ctx_request in enumerate(ctx_requests):
        received = _receive(pair, 100 + rid, ctx_request)
        assert received.state is RequestState.GENERATION_TRANS_COMPLETE, received.error
        assert pair.mismatches(100 + rid, rid, lengths[rid]) == 0
        blocks = -(-lengths[rid] // pair.shape.tokens_per_block)
        assert received.transfer_bytes == blocks * pair.ctx.cache.layout.block_bytes
    statuses = pair.ctx.transceiver.check_context_transfer_status(None, mark_complete=True)
    assert statuses.completed_request_ids == set(range(len(lengths)))
    assert all(r.state is RequestState.CONTEXT_COMPLETE for r in ctx_requests)
    for rid in range(len(lengths)):  # every pin is released (by each hold's promise, 20 ms): every block returns
        pair.ctx.cache.free(rid)
    give_up = time.monotonic() + 2
    while pair.ctx.cache.free_blocks != pair.shape.num_blocks and time.monotonic() < give_up:
        time.sleep(0.005)
    assert pair.ctx.cache.free_blocks == pair.shape.num_blocks


@pytest.mark.parametrize("kind", [LayoutKind.PER_LAYER_NHD, LayoutKind.PER_LAYER_HND, LayoutKind.PER_LAYER_HKND])
def test_per_layer_pools_move_directly(pair_factory, kind: LayoutKind) -> None:
    pair = pair_factory(ctx_kind=kind, gen_kind=kind)
    ctx_request = pair.prefill(3, 40)
    received = _receive(pair, 9, ctx_request)
    assert received.state is RequestState.GENERATION_TRANS_COMPLETE, received.error
    assert pair.mismatches(9, 3, 40) == 0


def test_concurrent_requests_and_status_polls(pair_factory) -> None:
    pair = pair_factory()
    ctx_requests = [pair.prefill(rid, 20 + 7 * rid) for rid in range(6)]
    gen_requests = [pair.gen_request(50 + rid, r) for rid, r in enumerate(ctx_requests)]
    for request in gen_requests:
        pair.gen.transceiver.request_and_receive_async(request)
    assert not pair.gen.transceiver.check_gen_transfer_complete()
    done: set[int] = set()
    deadline = time.monotonic() + 10
    while len(done) < 6 and time.monotonic() < deadline:
        done |= pair.gen.transceiver.check_gen_transfer_status(at_least=0).completed_request_ids
    assert done == {50 + rid for rid in range(6)}
    assert pair.gen.transceiver.check_gen_transfer_complete()
    for rid, request in enumerate(gen_requests):
        assert request.state is RequestState.GENERATION_TRANS_COMPLETE
        assert pair.mismatches(50 + rid, rid, 20 + 7 * rid) == 0
    released: set[int] = set()  # the ctx learns of each end from its ReadDone, a moment after the gen completes
    deadline = time.monotonic() + 10
    while len(released) < 6 and time.monotonic() < deadline:
        released |= pair.ctx.transceiver.check_context_transfer_status(
            at_least=6, mark_complete=True
        ).completed_request_ids
    assert released == set(range(6))


def test_thousands_of_requests_in_flight_complete_without_spurious_failures(pair_factory) -> None:
    """Issue 11, item 5: with thousands of requests in flight, the caller's thread and the progress loop both walk
    the receiver's tables; a check once read one of them unlocked and failed requests with "dictionary changed size
    during iteration". Every request must complete with its own bytes."""
    count = 3000
    pair = pair_factory(Shape(layers=1, heads=1, head_dim=8, tokens_per_block=16, num_blocks=count + 8))
    ctx_requests = [pair.prefill(rid, 1 + rid % 16) for rid in range(count)]
    gen_requests = [pair.gen_request(10_000 + rid, r) for rid, r in enumerate(ctx_requests)]
    for request in gen_requests:
        pair.gen.transceiver.request_and_receive_async(request)
    done, failed = set(), set()
    deadline = time.monotonic() + 120
    while len(done | failed) < count and time.monotonic() < deadline:
        statuses = pair.gen.transceiver.check_gen_transfer_status(at_least=1)
        done |= statuses.completed_request_ids
        failed |= statuses.error_request_ids
    assert failed == set() and len(done) == count, [r.error for r in gen_requests if r.error][:3]
    assert all(pair.mismatches(10_000 + rid, rid, 1 + rid % 16) == 0 for rid in range(count))
    assert pair.ctx.transceiver.check_context_transfer_status(None).completed_request_ids == set(range(count))


def test_one_gen_serves_two_ctx_instances_with_the_same_request_id(pair_factory) -> None:
    pair = pair_factory()
    other_ctx = make_side(pair.shape)
    try:
        first = pair.prefill(7, 33, seed=1)
        other_ctx.cache.allocate(7, 33)
        other_ctx.cache.write_tokens(7, _values(pair, seed=2, num_tokens=33))
        second = TransferRequest(7, num_tokens=33)
        other_ctx.transceiver.respond_and_send_async(second)
        gen_a, gen_b = pair.gen_request(1, first), pair.gen_request(2, second)
        pair.gen.transceiver.request_and_receive_async(gen_a)
        pair.gen.transceiver.request_and_receive_async(gen_b)
        pair.gen.transceiver.check_gen_transfer_status(None)
        assert gen_a.state is gen_b.state is RequestState.GENERATION_TRANS_COMPLETE
        assert pair.mismatches(1, 1, 33) == 0
        assert pair.mismatches(2, 2, 33) == 0
    finally:
        other_ctx.transceiver.close()


def _values(pair: Pair, seed: int, num_tokens: int) -> np.ndarray:
    from nixl_kv.harness.fill import expected

    return expected(seed, pair.shape.where(num_tokens), pair.shape.dtype.itemsize)


def _corruptions(valid: bytes) -> list[tuple[bytes, str]]:
    body = msgpack.unpackb(valid)
    wrong_type = dict(body, body=dict(body["body"], num_tokens="many"))
    return [
        (b"\x81garbage", "not valid msgpack"),
        (valid[: len(valid) // 2], "not valid msgpack"),
        (msgpack.packb(wrong_type), "ContextPhaseParams.num_tokens"),
        (msgpack.packb(dict(body, nixl_kv=99)), "unsupported wire version"),
    ]


@pytest.mark.parametrize("sealed", [False, True], ids=["damaged-on-the-way", "made-so"])
def test_malformed_params_fail_that_request_and_the_next_one_still_arrives(pair_factory, sealed: bool) -> None:
    """Damaged params fail their checksum before they are decoded; params made malformed (sealed as they are, as
    a ctx side would) fail decoding with the field's name. Either way the next request arrives."""
    pair = pair_factory()
    good = pair.prefill(1, 50)
    for gen_id, (data, message) in enumerate(_corruptions(good.context_phase_params), start=10):
        if sealed and data[-9:-8] != b"\xcf":
            continue  # it cannot end in a checksum
        pair.gen.cache.allocate(gen_id, 50)
        bad = TransferRequest(gen_id, context_phase_params=seal(data) if sealed else data)
        pair.gen.transceiver.request_and_receive_sync(bad)
        assert bad.state is RequestState.TRANS_ERROR
        if sealed:
            assert "WireFormatError" in bad.error and message in bad.error
        else:
            assert f"the ContextPhaseParams of request {gen_id} fail their checksum" in bad.error
    received = _receive(pair, 99, good)
    assert received.state is RequestState.GENERATION_TRANS_COMPLETE, received.error
    assert pair.mismatches(99, 1, 50) == 0


def test_incompatible_model_is_refused_before_any_byte_moves(pair_factory) -> None:
    pair = pair_factory()
    other_gen = make_side(Shape(head_dim=16))
    try:
        ctx_request = pair.prefill(1, 20)
        other_gen.cache.allocate(5, 20)
        request = TransferRequest(5, context_phase_params=ctx_request.context_phase_params)
        other_gen.transceiver.request_and_receive_sync(request)
        assert request.state is RequestState.TRANS_ERROR
        assert "IncompatibleStateError" in request.error and "head_dim: ours 16, peer 8" in request.error
        assert not other_gen.cache.read_tokens(5, 20).any()  # nothing was written
    finally:
        other_gen.transceiver.close()


@pytest.mark.parametrize(
    ("ctx_kind", "gen_kind"),
    [
        (LayoutKind.BLOCK_MAJOR, LayoutKind.PER_LAYER_NHD),
        (LayoutKind.PER_LAYER_NHD, LayoutKind.BLOCK_MAJOR),
        (LayoutKind.PER_LAYER_HND, LayoutKind.PER_LAYER_NHD),
        (LayoutKind.BLOCK_MAJOR, LayoutKind.PER_LAYER_HND),
        (LayoutKind.PER_LAYER_HKND, LayoutKind.PER_LAYER_HND),
        (LayoutKind.PER_LAYER_HND, LayoutKind.PER_LAYER_HKND),
        (LayoutKind.PER_LAYER_HKND, LayoutKind.BLOCK_MAJOR),
        (LayoutKind.PER_LAYER_NHD, LayoutKind.PER_LAYER_HKND),
    ],
)
def test_different_pool_layouts_meet(pair_factory, ctx_kind: LayoutKind, gen_kind: LayoutKind) -> None:
    # small staging slots force several staged pieces per request where the layouts need a permutation
    config = {"max_tokens_in_buffer": 32}
    pair = pair_factory(ctx_kind=ctx_kind, gen_kind=gen_kind, ctx_config=config, gen_config=config)
    requests = [pair.prefill(rid, n) for rid, n in enumerate([1, 20, 100])]
    for rid, ctx_request in enumerate(requests):
        received = _receive(pair, 10 + rid, ctx_request)
        assert received.state is RequestState.GENERATION_TRANS_COMPLETE, received.error
        assert pair.mismatches(10 + rid, rid, ctx_request.num_tokens) == 0
    statuses = pair.ctx.transceiver.check_context_transfer_status(None, mark_complete=True)
    assert statuses.completed_request_ids == {0, 1, 2}
    assert not pair.ctx.transceiver.has_poisoned_transfer_buffer()
    assert pair.ctx.transceiver._staging.free_slots == pair.ctx.transceiver.config.num_staging_slots


def test_lease_expiry_releases_blocks_and_a_late_read_fails_instead_of_reading_stale_bytes(pair_factory) -> None:
    # the late request's deadline is this lease too: its READ, the ReadDone and the ctx's verdict must fit in it
    # (at 200 ms a machine at load 19 once ended it "waiting for the ctx verdict")
    pair = pair_factory(ctx_config={"lease_ms": 1000})
    # met first: a first contact under load can outlast the lease (it then failed waiting for the peer to be
    # loaded, before any READ)
    pair.meet()
    ctx_request = pair.prefill(1, 40)
    statuses = pair.ctx.transceiver.check_context_transfer_status(None, mark_complete=True)
    assert statuses.error_request_ids == {1}
    assert "lease of 1000 ms expired with 0 of ? readers done" in ctx_request.error
    pair.ctx.cache.free(1)
    # the blocks are reused for another request with other content before the late reader comes
    blocks = pair.ctx.cache.allocate(2, 40)
    assert set(blocks) == set(_blocks_of(ctx_request))
    pair.ctx.cache.write_tokens(2, _values(pair, seed=2, num_tokens=40))
    late = _receive(pair, 5, ctx_request)
    assert late.state is RequestState.TRANS_ERROR
    assert "not pinned here" in late.error


def _blocks_of(request: TransferRequest) -> tuple[int, ...]:
    return wire.decode(request.context_phase_params, ContextPhaseParams).block_ids[0]


@pytest.mark.parametrize("promise_ms", [0, 5000])
def test_ctx_cancel_before_the_read(pair_factory, promise_ms: int) -> None:
    """Without a hold promise the reader is refused. With one (the params promise the blocks to a reader on the
    same clock until it runs out, whatever happens), a READ that ends within it gets the request's own bytes:
    a cancel cannot reach it, and the blocks are not reused before the promise (test_holds)."""
    pair = pair_factory(ctx_config={"hold_promise_ms": promise_ms})
    ctx_request = pair.prefill(1, 30)
    assert pair.ctx.transceiver.cancel_request(ctx_request)
    received = _receive(pair, 5, ctx_request)
    if promise_ms:
        assert received.state is RequestState.GENERATION_TRANS_COMPLETE and pair.mismatches(5, 1, 30) == 0
    else:
        assert received.state is RequestState.TRANS_ERROR and "not pinned here" in received.error
    statuses = pair.ctx.transceiver.check_context_transfer_status(None)
    assert statuses.error_request_ids == {1} and "cancelled on the ctx side" in ctx_request.error


def test_gen_cancel_and_cancel_after_completion(pair_factory) -> None:
    pair = pair_factory()
    done = _receive(pair, 5, pair.prefill(1, 30))
    assert done.state is RequestState.GENERATION_TRANS_COMPLETE
    assert not pair.gen.transceiver.cancel_request(done)
    unknown = TransferRequest(12345)
    assert not pair.gen.transceiver.cancel_request(unknown)


def test_a_dead_ctx_instance_ends_the_gen_request_within_its_lease(pair_factory) -> None:
    pair = pair_factory(ctx_config={"lease_ms": 300})
    ctx_request = pair.prefill(1, 30)
    pair.ctx.transceiver.close()  # the ctx agent is gone: nobody will answer
    start = time.monotonic()
    received = _receive(pair, 5, ctx_request)
    elapsed = time.monotonic() - start
    assert received.state is RequestState.TRANS_ERROR
    assert elapsed < 2.0, elapsed
    fresh = make_side(pair.shape)  # the gen instance goes on serving a new ctx instance
    try:
        fresh.cache.allocate(1, 30)
        fresh.cache.write_tokens(1, _values(pair, seed=1, num_tokens=30))
        request = TransferRequest(1, num_tokens=30)
        fresh.transceiver.respond_and_send_async(request)
        again = _receive(pair, 6, request)
        assert again.state is RequestState.GENERATION_TRANS_COMPLETE, again.error
        assert pair.mismatches(6, 1, 30) == 0
    finally:
        fresh.transceiver.close()


def test_the_same_ctx_request_cannot_be_received_twice_at_once(pair_factory) -> None:
    pair = pair_factory()
    ctx_request = pair.prefill(1, 30)
    first, second = pair.gen_request(5, ctx_request), pair.gen_request(6, ctx_request)
    pair.gen.transceiver.request_and_receive_async(first)
    pair.gen.transceiver.request_and_receive_async(second)
    pair.gen.transceiver.check_gen_transfer_status(None)
    assert first.state is RequestState.GENERATION_TRANS_COMPLETE, first.error
    assert second.state is RequestState.TRANS_ERROR
    assert "already being received" in second.error
    assert pair.mismatches(5, 1, 30) == 0


def test_draft_and_first_tokens_travel_in_the_params(pair_factory) -> None:
    pair = pair_factory()
    pair.ctx.cache.allocate(1, 10)
    ctx_request = TransferRequest(1, num_tokens=10, first_gen_tokens=(42,), draft_tokens=(7, 8, 9))
    pair.ctx.transceiver.respond_and_send_async(ctx_request)
    received = _receive(pair, 5, ctx_request)
    assert received.state is RequestState.GENERATION_TRANS_COMPLETE
    assert received.first_gen_tokens == (42,) and received.draft_tokens == (7, 8, 9)
    assert received.num_tokens == 10


def test_serialized_state_decodes_to_the_instance_state(pair_factory) -> None:
    pair = pair_factory()
    from nixl_kv.state import DataTransceiverState

    data = pair.ctx.transceiver.get_serialized_data_transceiver_state()
    assert wire.decode(data, DataTransceiverState) == pair.ctx.transceiver.state
    assert not pair.ctx.transceiver.has_poisoned_transfer_buffer()


def test_connect_to_meets_a_ctx_instance_before_its_first_request(pair_factory) -> None:
    pair = pair_factory()
    agent = pair.gen.transceiver._agent
    before = agent.live_handles
    pair.gen.transceiver.connect_to(pair.ctx.transceiver.get_serialized_data_transceiver_state())
    after = agent.live_handles
    assert after["remotes"] == before["remotes"] + 1
    assert after["prepared"] == before["prepared"] + 3  # the peer's fine and coarse pool lists and its board
    received = _receive(pair, 5, pair.prefill(1, 40))
    assert received.state is RequestState.GENERATION_TRANS_COMPLETE and pair.mismatches(5, 1, 40) == 0
    assert agent.live_handles == after  # the request found everything ready
    with pytest.raises(WireFormatError):
        pair.gen.transceiver.connect_to(b"\x93not a state")


def test_a_second_state_naming_a_known_agent_with_other_memory_is_refused(pair_factory) -> None:
    """Descriptor lists are kept by agent name: a state that reuses a name we hold lists for but describes its
    pools otherwise gets a clear error, never the first state's lists (that would read other memory)."""
    pair = pair_factory()
    ctx = pair.ctx.transceiver
    pair.gen.transceiver.connect_to(ctx.get_serialized_data_transceiver_state())
    rank = ctx.state.comm.ranks[0]
    moved = dataclasses.replace(rank.layout, pools=(dataclasses.replace(rank.layout.pools[0], address=4096),))
    liar = dataclasses.replace(ctx.state, comm=CommState((dataclasses.replace(rank, layout=moved),)))
    with pytest.raises(AgentError, match="with other memory"):
        pair.gen.transceiver.connect_to(wire.encode(liar))
