"""Hostile or broken peers (issue 11): what a state, params or control message from the fabric can and cannot do."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest

from nixl_kv import wire
from nixl_kv.auth import prove
from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.dtypes import DataType
from nixl_kv.errors import IncompatibleStateError
from nixl_kv.params_seal import encode_params
from nixl_kv.protocol import ReadVerdict
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.state import ContextPhaseParams, DataTransceiverState
from nixl_kv.transceiver import CacheTransceiver

from .conftest import Pair, Shape


def _poll(pair: Pair, request: TransferRequest, timeout_s: float = 10.0) -> RequestState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        statuses = pair.gen.transceiver.check_gen_transfer_status(at_least=1)
        if request.request_id in statuses.completed_request_ids | statuses.error_request_ids:
            break
    return request.state


def _with_ctx_state(params: bytes, change) -> bytes:  # noqa: ANN001
    """The params with their ctx state changed by ``change(state) -> state``."""
    decoded = wire.decode(params, ContextPhaseParams)
    state = change(wire.decode(decoded.ctx_state, DataTransceiverState))
    return encode_params(dataclasses.replace(decoded, ctx_state=wire.encode(state)))


def _first_rank(state: DataTransceiverState, **changes: object) -> DataTransceiverState:
    ranks = (dataclasses.replace(state.comm.ranks[0], **changes), *state.comm.ranks[1:])
    return dataclasses.replace(state, comm=dataclasses.replace(state.comm, ranks=ranks))


def _gen_pins(pair: Pair, request_id: int) -> int:
    return pair.gen.cache._requests[request_id].pins


@pytest.mark.parametrize("path", ["direct", "stepped"])
@pytest.mark.parametrize("metadata", ["name not UTF-8", "a live agent under another name"])
def test_a_ctx_state_with_unusable_metadata_fails_that_request_only(pair_factory, path: str, metadata: str) -> None:
    """The ctx rank's metadata names an agent that is not text (at first contact), or the state claims another
    agent name for the metadata of the ctx agent the gen already reads: the request fails at once with the
    reason, its blocks are unpinned, cancelling it is harmless, and the next good request from that ctx
    completes with the right bytes (once, the second case unloaded the live agent for good, and the first
    wedged the receiver's loop)."""
    pair = pair_factory()
    ctx_agent = pair.ctx.transceiver._agent
    if metadata == "name not UTF-8":
        from nixl_kv.agents.nixl_agent import seal_metadata, unseal_metadata

        body = unseal_metadata(ctx_agent.metadata())  # renamed and sealed again, so that NIXL parses it
        changes = {
            "agent_metadata": seal_metadata(
                body.replace(ctx_agent.name.encode(), ctx_agent.name.encode()[:-1] + b"\xff")
            )
        }
    else:
        warm = pair.gen_request(4, pair.prefill(0, 40))
        pair.gen.transceiver.request_and_receive_async(warm)
        assert _poll(pair, warm) is RequestState.GENERATION_TRANS_COMPLETE
        changes = {"agent_name": "an-impostor"}

    def change(state: DataTransceiverState) -> DataTransceiverState:
        state = _first_rank(state, **changes)
        return dataclasses.replace(state, hold_key=b"") if path == "stepped" else state

    bad = pair.gen_request(5, pair.prefill(1, 40))
    bad.context_phase_params = _with_ctx_state(bad.context_phase_params, change)
    good = pair.gen_request(6, pair.prefill(2, 40))
    started = time.monotonic()
    pair.gen.transceiver.request_and_receive_async(bad)
    assert _poll(pair, bad) is RequestState.TRANS_ERROR
    assert "describes agent" in bad.error and time.monotonic() - started < 5, bad.error
    pair.gen.transceiver.request_and_receive_async(good)  # (after: once the real agent is loaded, it is used)
    assert _poll(pair, good) is RequestState.GENERATION_TRANS_COMPLETE, good.error
    assert pair.mismatches(6, 2, 40) == 0
    assert _gen_pins(pair, 5) == 0
    assert pair.gen.transceiver.cancel_request(bad) is False  # it has ended: nothing to cancel, no exception
    assert pair.gen.transceiver._agent.live_handles["remotes"] == 1  # the real ctx agent alone


def test_notifications_carrying_another_agents_metadata_load_nothing(pair_factory) -> None:
    """A message from agent G carrying the metadata of agent H (its proof right): the ctx refuses the metadata and
    keeps nothing loaded (it once kept every such H: 2,000 messages left 2,001 remote agents)."""
    from nixl_kv.agents.nixl_agent import NixlAgent
    from nixl_kv.protocol import ReadDone

    pair = pair_factory()
    ctx_agent, gen_agent = pair.ctx.transceiver._agent, pair.gen.transceiver._agent
    ctx_request = pair.prefill(1, 40)
    secret = _secret(ctx_request)
    instance = pair.ctx.transceiver.instance_id
    gen_agent.load_remote(ctx_agent.metadata(), ctx_agent.name)
    strangers = [NixlAgent(f"stranger-{i}") for i in range(40)]
    try:
        for i, stranger in enumerate(strangers):
            message = prove(ReadDone(instance, 1, 100 + i, stranger.metadata(), 1, final=False), secret, gen_agent.name)
            gen_agent.notify(ctx_agent.name, wire.encode(message))
        # then a real one: notifications from one sender arrive in order, so once it ends request 1 all were seen
        done = prove(ReadDone(instance, 1, 99, gen_agent.metadata(), 1), secret, gen_agent.name)
        gen_agent.notify(ctx_agent.name, wire.encode(done))
        statuses = pair.ctx.transceiver.check_context_transfer_status(None)
        assert statuses.completed_request_ids == {1}, (statuses, ctx_request.error)
        assert not any(ctx_agent.has_remote(stranger.name) for stranger in strangers)
        assert ctx_agent.live_handles["remotes"] == 1  # the real reader alone
    finally:
        for stranger in strangers:
            stranger.close()


@pytest.mark.parametrize(
    "change,problem",
    [
        ({"tokens_per_block": 8, "head_dim": 16}, "tokens_per_block 8 (expected 16); head_dim 16 (expected 8)"),
        ({"heads": 4}, "num_heads 4 (expected 2)"),
        ({"layers": 2}, "num_layers 2 (expected 4)"),
        ({"dtype": DataType.BFLOAT16}, "the cache holds bfloat16, its cache state says float16"),
    ],
    ids=["tokens-per-block-and-head-dim-swapped", "heads", "layers", "dtype"],
)
def test_a_cache_that_contradicts_its_declared_state_is_refused_at_construction(change: dict, problem: str) -> None:
    shape = Shape()
    cache = dataclasses.replace(shape, **change).cache()
    with pytest.raises(IncompatibleStateError, match=re.escape(problem)):
        CacheTransceiver(cache, shape.state(), CacheTransceiverConfig())


def test_a_ctx_state_whose_pools_contradict_its_cache_state_is_refused_before_any_read(pair_factory) -> None:
    """Its geometry swapped (same bytes per block): once, such a read completed with wrong bytes. Now the
    request fails naming the difference, and the ctx side is told at once (it does not hold the blocks to the
    lease)."""
    pair = pair_factory()
    ctx_request = pair.prefill(1, 40)

    def swap(state: DataTransceiverState) -> DataTransceiverState:
        layout = state.comm.ranks[0].layout
        return _first_rank(state, layout=dataclasses.replace(layout, tokens_per_block=8, head_dim=16))

    request = pair.gen_request(5, ctx_request)
    request.context_phase_params = _with_ctx_state(request.context_phase_params, swap)
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.TRANS_ERROR
    assert "ctx rank 0: tokens_per_block 8 (expected 16); head_dim 16 (expected 8)" in request.error
    statuses = pair.ctx.transceiver.check_context_transfer_status(None)
    assert statuses.error_request_ids == {1} and "a gen rank cannot read the request" in ctx_request.error


def test_a_layer_wise_flag_on_a_request_that_is_not_layer_wise_reads_at_once(pair_factory) -> None:
    """The ctx responded after prefill; the params (altered, or from a confused router) say layer-wise. The ctx
    answers the reader's watch with every layer ready, so the request completes at once with the right bytes
    (it once waited out the whole lease, 60 s by default)."""
    pair = pair_factory()
    request = pair.gen_request(5, pair.prefill(1, 40))
    params = wire.decode(request.context_phase_params, ContextPhaseParams)
    request.context_phase_params = encode_params(dataclasses.replace(params, layerwise=True))
    started = time.monotonic()
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE, request.error
    assert time.monotonic() - started < 5 and pair.mismatches(5, 1, 40) == 0


def _wait_for(condition, timeout_s: float = 5.0, progress=lambda: None) -> bool:  # noqa: ANN001
    """``progress``: what an agent with no progress loop of its own must do meanwhile (its sends go out then)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        progress()
        time.sleep(0.01)
    return condition()


def test_peers_no_request_used_for_a_while_are_forgotten_on_both_sides(pair_factory) -> None:  # noqa: ANN001
    """A dead or departed peer is unloaded once idle (it once stayed until another peer connected), on the gen
    side (its ctx agents and their lists) and the ctx side (its readers); a later request loads them again."""
    pair = pair_factory()
    for side in (
        pair.gen,
        pair.ctx,
    ):  # each transceiver's one peer directory: ctx agents on the gen, readers on the ctx
        side.transceiver._peers._idle_s = 0.2
    gen_agent, ctx_agent = pair.gen.transceiver._agent, pair.ctx.transceiver._agent
    request = pair.gen_request(5, pair.prefill(1, 40))
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE
    assert pair.ctx.transceiver.check_context_transfer_status(None).completed_request_ids == {1}
    assert gen_agent.live_handles["remotes"] == 1 and ctx_agent.live_handles["remotes"] == 1
    assert _wait_for(lambda: gen_agent.live_handles["remotes"] == ctx_agent.live_handles["remotes"] == 0)
    assert gen_agent.live_handles["prepared"] == 3  # our own lists alone (fine and coarse pools, landing windows)
    again = pair.gen_request(6, pair.prefill(2, 40))
    pair.gen.transceiver.request_and_receive_async(again)
    assert _poll(pair, again) is RequestState.GENERATION_TRANS_COMPLETE and pair.mismatches(6, 2, 40) == 0


def _secret(request: TransferRequest) -> bytes:
    return wire.decode(request.context_phase_params, ContextPhaseParams).secret


def test_forged_control_messages_from_a_third_agent_change_nothing_on_the_ctx_side(pair_factory) -> None:
    """An agent that loaded the ctx metadata and knows the instance and request ids, but not the request's
    secret: its ReadDone (final, failed, 4096 readers), NoReaders, LayerWatch and 16 StageClaims are dropped and
    counted, no staging slot is taken, and the real reader then completes with the right bytes."""
    from nixl_kv.agents.nixl_agent import NixlAgent
    from nixl_kv.protocol import LayerWatch, NoReaders, ReadDone, StageClaim

    pair = pair_factory()
    ctx_agent, instance = pair.ctx.transceiver._agent, pair.ctx.transceiver.instance_id
    ctx_request = pair.prefill(1, 40)
    free_slots = pair.ctx.transceiver._staging.free_slots
    intruder = NixlAgent("intruder")
    try:
        intruder.load_remote(ctx_agent.metadata(), ctx_agent.name)
        me, wrong = intruder.metadata(), b"\x00" * 16
        forged = [
            ReadDone(instance, 1, 7, me, 1, final=True),
            ReadDone(instance, 1, 7, me, 1, final=True, failed=True, reason="no", proof=wrong),
            ReadDone(instance, 1, 7, me, 4096, final=False, proof=wrong),
            NoReaders(instance, 1, me),
            LayerWatch(instance, 1, me, wrong),
            *(StageClaim(instance, 1, 100 + i, me, 3, (0, 4), (0, 2), (0, 3), proof=wrong) for i in range(16)),
        ]
        for message in forged:
            intruder.notify(ctx_agent.name, wire.encode(message))
        counted = lambda: pair.ctx.transceiver.metrics.snapshot()["ctx"]["forged_messages"]  # noqa: E731
        assert _wait_for(lambda: counted() == len(forged), progress=intruder.poll_notifications), counted()
        assert pair.ctx.transceiver._staging.free_slots == free_slots
        assert ctx_agent.live_handles["remotes"] == 0  # nothing was loaded for them
        assert intruder.poll_notifications() == []  # nor answered
        request = pair.gen_request(5, ctx_request)
        pair.gen.transceiver.request_and_receive_async(request)
        assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE, request.error
        assert pair.mismatches(5, 1, 40) == 0
        assert pair.ctx.transceiver.check_context_transfer_status(None).completed_request_ids == {1}
        assert ctx_request.error is None
    finally:
        intruder.close()


def test_what_an_observer_of_the_fabric_sees_proves_nothing_else(pair_factory) -> None:
    """Proofs are MACs under the secret of the sender's name and every field, so what crosses the fabric can
    neither be reused nor altered: the secret itself as a proof (what messages once carried), a real reader's
    proven final ReadDone replayed under another agent's name (it would count as a second reader), and that
    message with more readers declared are all dropped and counted. The real message then ends the request."""
    from nixl_kv.agents.nixl_agent import NixlAgent
    from nixl_kv.protocol import ReadDone

    pair = pair_factory()
    ctx_agent, instance = pair.ctx.transceiver._agent, pair.ctx.transceiver.instance_id
    ctx_request = pair.prefill(1, 40)
    secret = _secret(ctx_request)
    observer, reader = NixlAgent("observer"), NixlAgent("reader")
    try:
        for agent in (observer, reader):
            agent.load_remote(ctx_agent.metadata(), ctx_agent.name)
        real = prove(ReadDone(instance, 1, 3, reader.metadata(), 2), secret, reader.name)
        assert secret not in wire.encode(real)
        replayed = dataclasses.replace(real, reader_metadata=observer.metadata())
        for message in (
            ReadDone(instance, 1, 3, observer.metadata(), 1, proof=secret),
            real,  # from the observer: the proof names the reader
            dataclasses.replace(replayed, proof=real.proof),
            dataclasses.replace(real, expected_readers=4096),
        ):
            observer.notify(ctx_agent.name, wire.encode(message))
        counted = lambda: pair.ctx.transceiver.metrics.snapshot()["ctx"]["forged_messages"]  # noqa: E731
        assert _wait_for(lambda: counted() == 4, progress=observer.poll_notifications), counted()
        assert ctx_agent.live_handles["remotes"] == 0 and observer.poll_notifications() == []
        assert ctx_request.state is RequestState.CONTEXT_TRANS_IN_PROGRESS
        reader.notify(ctx_agent.name, wire.encode(real))  # one of the two readers declared
        answers: list = []
        assert _wait_for(lambda: answers.extend(reader.poll_notifications()) or bool(answers))
        verdict = wire.decode(answers[0][1], ReadVerdict)
        assert (
            verdict.ok and verdict.proof == prove(dataclasses.replace(verdict, proof=b""), secret, ctx_agent.name).proof
        )
        assert ctx_request.state is RequestState.CONTEXT_TRANS_IN_PROGRESS  # one of its two readers reported
    finally:
        observer.close()
        reader.close()


@pytest.mark.parametrize("proof", ["none", "the request's secret"])
def test_a_verdict_from_an_agent_that_took_the_ctx_agents_name_needs_the_secret(pair_factory, proof: str) -> None:
    """The ctx rank never answers (its answer is lost); an agent under the ctx agent's own name (NIXL allows it)
    sends ReadVerdict ok for the waiting pull. Without the request's secret it is dropped and the request fails at
    its lease; with the secret (as only the real ctx rank has it) it would be taken."""
    from nixl_kv.agents.nixl_agent import NixlAgent
    from nixl_kv.protocol import ReadDone, ReadVerdict

    pair = pair_factory(ctx_config={"hold_promise_ms": 0, "lease_ms": 1500})
    pair.ctx.transceiver._board.post = lambda token, masked=0: False  # no hold check: the pull waits for a verdict
    pair.ctx.transceiver._loop.on_message(ReadDone, lambda reader, message: None)  # the real answer never comes
    ctx_agent, gen_agent = pair.ctx.transceiver._agent, pair.gen.transceiver._agent
    # made before the lease starts: under load, making an agent took much of the lease, and the real secret's
    # verdict then came after the request's deadline
    impostor = NixlAgent(ctx_agent.name)
    try:
        impostor.load_remote(gen_agent.metadata(), gen_agent.name)
        ctx_request = pair.prefill(1, 40)
        request = pair.gen_request(5, ctx_request)
        pair.gen.transceiver.request_and_receive_async(request)
        receiver = pair.gen.transceiver._receiver
        waiting = lambda: [p for _, p in receiver._direct.by_transfer.values() if p.step.value.startswith("waiting")]  # noqa: E731
        assert _wait_for(lambda: len(waiting()) == 1)
        (transfer_id,) = receiver._direct.by_transfer
        verdict = ReadVerdict(pair.ctx.transceiver.instance_id, 1, transfer_id, True)
        if proof != "none":
            verdict = prove(verdict, _secret(ctx_request), impostor.name)
        impostor.notify(gen_agent.name, wire.encode(verdict))
        forged = lambda: pair.gen.transceiver.metrics.snapshot()["gen"]["forged_messages"]  # noqa: E731
        assert _wait_for(
            lambda: forged() == 1 or request.request_id not in receiver._requests.by_request,
            5,
            impostor.poll_notifications,
        )
        state = _poll(pair, request, timeout_s=5)
        if proof == "none":
            assert state is RequestState.TRANS_ERROR and "deadline" in request.error
            assert pair.gen.transceiver.metrics.snapshot()["gen"]["forged_messages"] == 1
        else:
            assert state is RequestState.GENERATION_TRANS_COMPLETE
    finally:
        impostor.close()


def test_params_damaged_anywhere_are_refused_before_any_read(pair_factory) -> None:
    """A flipped bit anywhere in the params (first tokens and draft tokens included, which nothing else checks)
    fails their checksum: the request ends at once and no READ is posted; the intact params then complete."""
    pair = pair_factory()
    agent = pair.gen.transceiver._agent
    reads: list[int] = []
    original_read = agent.read
    agent.read = lambda *args, **kwargs: reads.append(1) or original_read(*args, **kwargs)
    ctx_request = pair.prefill(1, 40)
    data = ctx_request.context_phase_params
    for n, at in enumerate(range(0, len(data), max(1, len(data) // 40))):
        damaged = bytearray(data)
        damaged[at] ^= 1 << (n % 8)
        pair.gen.cache.allocate(100 + n, 40)
        request = TransferRequest(100 + n, context_phase_params=bytes(damaged))
        pair.gen.transceiver.request_and_receive_async(request)
        assert _poll(pair, request, 2) is RequestState.TRANS_ERROR and "fail their checksum" in request.error
        pair.gen.cache.free(100 + n)
    assert reads == []
    request = pair.gen_request(5, ctx_request)
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE and pair.mismatches(5, 1, 40) == 0


def _oversized(params: bytes, size: int) -> bytes:
    """The params with a ctx state padded to make them ``size`` bytes or more, sealed as a ctx would seal them."""
    decoded = wire.decode(params, ContextPhaseParams)
    return encode_params(dataclasses.replace(decoded, ctx_state=decoded.ctx_state + bytes(size)))


def test_params_that_are_not_bytes_or_too_long_end_the_request_with_the_documented_error(pair_factory) -> None:
    """A str (a JSON layer that forgot to decode), an int, None, a list, a memoryview of ints or a strided one, and
    params of 14 MiB sealed as a ctx seals them: each request ends in error with the README's message, refused before
    any READ, pin or table entry; the oversized one in well under 1 ms (the best of 5), allocating nothing like its
    size. The intact params then complete."""
    import array
    import tracemalloc

    from nixl_kv.params_seal import MAX_PARAMS_BYTES

    pair = pair_factory()
    agent, receiver = pair.gen.transceiver._agent, pair.gen.transceiver._receiver
    reads: list[int] = []
    original_read = agent.read
    agent.read = lambda *args, **kwargs: reads.append(1) or original_read(*args, **kwargs)
    ctx_request = pair.prefill(1, 40)
    data = ctx_request.context_phase_params
    oversized = _oversized(data, 14 << 20)
    handles = dict(agent.live_handles)
    bad = [
        (data.decode("latin-1"), "are not bytes but str"),
        (12345, "are not bytes but int"),
        (None, "carries no ContextPhaseParams"),
        (list(data), "are not bytes but list"),
        (memoryview(array.array("i", range(len(data) // 4))), "are a memoryview whose items are not bytes"),
        (memoryview(data)[::2], "are a memoryview whose items are not bytes"),
        (oversized, f"are {len(oversized)} bytes, over the limit of {MAX_PARAMS_BYTES} bytes"),
    ]
    for n, (value, error) in enumerate(bad):
        rid = 100 + n
        pair.gen.cache.allocate(rid, 40)
        request = TransferRequest(rid, context_phase_params=value)
        pair.gen.transceiver.request_and_receive_async(request)
        assert _poll(pair, request, 2) is RequestState.TRANS_ERROR
        assert request.error is not None and (
            f"request {rid} {error}" in request.error or f"ContextPhaseParams of request {rid} {error}" in request.error
        ), request.error
        pair.gen.cache.free(rid)
    assert reads == [] and receiver.pending == 0 and pair.gen.cache.pinned_requests == 0
    assert agent.live_handles == handles

    times = []
    for n in range(5):
        request = TransferRequest(200 + n, context_phase_params=oversized)
        started = time.perf_counter()
        pair.gen.transceiver.request_and_receive_async(request)
        times.append(time.perf_counter() - started)
        assert _poll(pair, request, 2) is RequestState.TRANS_ERROR
    assert min(times) <= 1e-3, times
    tracemalloc.start()
    try:
        request = TransferRequest(300, context_phase_params=oversized)
        pair.gen.transceiver.request_and_receive_async(request)
        assert _poll(pair, request, 2) is RequestState.TRANS_ERROR
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_PARAMS_BYTES // 16, peak  # (nothing copied or decoded: a few KB of bookkeeping)
    print(f"[{len(oversized)} B params] refused in {min(times) * 1e6:.0f}-{max(times) * 1e6:.0f} us, {peak} B traced")

    request = pair.gen_request(5, ctx_request)
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE and pair.mismatches(5, 1, 40) == 0


def test_metadata_from_a_message_that_proves_nothing_is_never_loaded(pair_factory) -> None:
    """A ReadDone or StageClaim about a request the ctx rank does not hold, from an agent it does not know: not
    answered, and its metadata not loaded (a malformed blob aborts the process inside UCX: scripts/fuzz.sh). The
    same agent proving a live request's secret is loaded and answered."""
    from nixl_kv.agents.nixl_agent import NixlAgent
    from nixl_kv.protocol import ReadDone, StageClaim

    pair = pair_factory()
    ctx_agent, instance = pair.ctx.transceiver._agent, pair.ctx.transceiver.instance_id
    stranger = NixlAgent("stranger")
    try:
        stranger.load_remote(ctx_agent.metadata(), ctx_agent.name)
        me = stranger.metadata()
        stranger.notify(ctx_agent.name, wire.encode(ReadDone(instance, 999, 1, me, 1)))
        stranger.notify(ctx_agent.name, wire.encode(StageClaim(instance, 998, 2, me, 1, (0, 1), (0, 1), (0, 1))))
        answers: list = []
        listen = lambda: answers.extend(stranger.poll_notifications())  # noqa: E731
        _wait_for(lambda: False, 1.5, listen)  # past the 1 s an early claim is parked for
        assert answers == [] and ctx_agent.live_handles["remotes"] == 0
        ctx_request = pair.prefill(1, 40)
        done = prove(ReadDone(instance, 1, 3, me, 1), _secret(ctx_request), stranger.name)
        stranger.notify(ctx_agent.name, wire.encode(done))
        assert _wait_for(lambda: len(answers) == 1, progress=listen) and ctx_agent.live_handles["remotes"] == 1
        assert wire.decode(answers[0][1], ReadVerdict).request_id == 1
    finally:
        stranger.close()


def test_staging_slots_granted_to_a_reader_that_vanished_come_back_one_lease_after_theirs(pair_factory) -> None:
    """A reader holding the request's secret claims every staging slot of the ctx rank, is granted them, and never
    reads nor reports (it died). Each slot is poisoned when its lease ends (a READ from it may still be in flight)
    and free again one lease later; a staged transfer then completes with the right bytes."""
    from nixl_kv.agents.nixl_agent import NixlAgent
    from nixl_kv.protocol import StageClaim, StageGrant

    pair = pair_factory(ctx_config={"lease_ms": 400})
    pair.meet()  # (the gen's first contact, like the reader's agent below, could outlast the lease under load)
    ctx_agent, instance = pair.ctx.transceiver._agent, pair.ctx.transceiver.instance_id
    staging = pair.ctx.transceiver._staging
    # the reader's agent is made and has met the ctx before the 400 ms lease starts (under load, making it took
    # longer than the lease, so its claims came too late to be granted)
    reader = NixlAgent("vanishing-reader")
    try:
        reader.load_remote(ctx_agent.metadata(), ctx_agent.name)
        ctx_request = pair.prefill(1, 40)
        secret = _secret(pair.gen_request(5, ctx_request))
        me, slots = reader.metadata(), len(staging.slots)
        for transfer_id in range(slots):
            claim = prove(
                StageClaim(instance, 1, 100 + transfer_id, me, 3, (0, 4), (0, 2), (0, 3)), secret, reader.name
            )
            reader.notify(ctx_agent.name, wire.encode(claim))
        grants: list = []

        def granted() -> bool:
            for _, data in reader.poll_notifications():
                grants.append(wire.decode(data, StageGrant))
            return len(grants) == slots

        assert _wait_for(granted), grants
        assert all(grant.ok for grant in grants) and staging.free_slots == 0, grants
        assert _wait_for(lambda: staging.poisoned_slots == slots, timeout_s=2.0)  # its lease ran out
        assert _wait_for(lambda: staging.free_slots == slots, timeout_s=2.0)  # one lease later
        assert ctx_request.error is None or "lease" in ctx_request.error
    finally:
        reader.close()
    again = pair.prefill(2, 40)
    request = pair.gen_request(6, again)
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE, request.error
    assert pair.mismatches(6, 2, 40) == 0


def test_early_messages_kept_for_a_request_not_yet_held_are_bounded(pair_factory) -> None:
    """Messages about a request the ctx rank has not registered yet wait for it (another rank made the params);
    even with the request's secret, a peer cannot make that wait grow without bound."""
    from nixl_kv.agents.nixl_agent import NixlAgent
    from nixl_kv.auth import request_secret
    from nixl_kv.ctx.table import MAX_PARKED_PER_REQUEST
    from nixl_kv.protocol import LayerWatch

    pair = pair_factory()
    table = pair.ctx.transceiver._sender._table
    ctx_agent, instance = pair.ctx.transceiver._agent, pair.ctx.transceiver.instance_id
    secret = request_secret(
        pair.ctx.transceiver._sender._context.auth_key, 77
    )  # a request this rank will respond to later
    peer = NixlAgent("eager-peer")
    try:
        peer.load_remote(ctx_agent.metadata(), ctx_agent.name)
        watch = wire.encode(prove(LayerWatch(instance, 77, peer.metadata()), secret, peer.name))
        sent = MAX_PARKED_PER_REQUEST + 44
        for _ in range(sent):
            peer.notify(ctx_agent.name, watch)
        arrived = lambda: len(table.parked.get(77, ())) == MAX_PARKED_PER_REQUEST  # noqa: E731
        assert _wait_for(arrived, progress=peer.poll_notifications), len(table.parked.get(77, ()))
        time.sleep(0.2)  # the rest arrived too, and were dropped
        assert len(table.parked[77]) == MAX_PARKED_PER_REQUEST
    finally:
        peer.close()
