"""The hold board and the direct path's checks: a READ completes without a verdict only when the ctx rank showed
the request's hold token after the READ ended; every other case asks the ctx rank, and the ctx rank refuses a
READ of blocks other than the ones it pinned. Real agents throughout."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from nixl_kv import wire
from nixl_kv.holds import (
    MAX_PROMISE_NS,
    WINDOW,
    HoldBoard,
    LandingRing,
    hold_token,
    promise_mask,
    promised_until,
    shows_token,
    window_start,
)
from nixl_kv.layout import LayoutKind
from nixl_kv.params_seal import encode_params
from nixl_kv.protocol import StageClaim
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.state import ContextPhaseParams
from tests.conftest import Pair

KEY = bytes(range(16))


# --- the board on its own -------------------------------------------------------------------------------------
def test_a_token_shows_from_post_to_clear_and_a_full_window_refuses() -> None:
    board = HoldBoard(slots=64)
    start = 5
    tokens = [start + 64 * i for i in range(WINDOW + 1)]  # all in the window starting at 5
    assert all(window_start(t, 64) == start for t in tokens)
    assert all(board.post(t) for t in tokens[:WINDOW])
    assert not board.post(tokens[WINDOW])  # the window is full: that request's readers ask for verdicts
    window = board._entries[start : start + WINDOW]
    assert sorted(int(v) for v in window[:, 0]) == sorted(tokens[:WINDOW])
    board.clear(tokens[3])
    assert not shows_token(board._entries[start : start + WINDOW], tokens[3])
    assert shows_token(board._entries[start : start + WINDOW], tokens[4])
    assert board.post(tokens[WINDOW])  # the freed entry is reused
    assert board.posted == WINDOW


def test_the_last_window_overlaps_the_end_of_the_table() -> None:
    board = HoldBoard(slots=16)
    token = 15 + 16 * 7  # window 15: entries 15..22 of a 16 + 8 entry table
    assert all(board.post(token + 16 * 100 * i) for i in range(WINDOW))
    assert board._entries[15 : 15 + WINDOW, 0].tolist() == [token + 16 * 100 * i for i in range(WINDOW)]
    assert len(board._entries) == 16 + WINDOW


def test_a_token_depends_on_every_input_and_the_key() -> None:
    base = hold_token(KEY, 7, 100, [3, 4, 5, 6], None)
    assert base == hold_token(KEY, 7, 100, np.array([3, 4, 5, 6]), None) != 0
    variants = [
        hold_token(bytes(16), 7, 100, [3, 4, 5, 6], None),
        hold_token(KEY, 8, 100, [3, 4, 5, 6], None),
        hold_token(KEY, 7, 101, [3, 4, 5, 6], None),
        hold_token(KEY, 7, 100, [3, 4, 6, 5], None),
        hold_token(KEY, 7, 100, [3, 4, 5, 6], 0),
    ]
    assert len({base, *variants}) == 6


def test_a_promise_reads_back_only_under_its_tokens_mask() -> None:
    board, now = HoldBoard(slots=64), 10**15
    token, other = 5 + 64, 5 + 128  # one window
    assert board.post(token, (now + 7) ^ promise_mask(KEY, token))
    assert board.post(other, 0 ^ promise_mask(KEY, other))  # no promise
    window = board._entries[5 : 5 + WINDOW].copy()
    assert promised_until(window, token, promise_mask(KEY, token), now) == now + 7
    assert promised_until(window, other, promise_mask(KEY, other), now) == 0
    assert promised_until(window, 5 + 192, promise_mask(KEY, 5 + 192), now) is None  # not posted
    # a copy torn between our token and the promise of a token posted later in the same entry: garbage, no promise
    torn = window.copy()
    torn[0, 1] = (now + 9) ^ promise_mask(KEY, 5 + 256)
    assert promised_until(torn, token, promise_mask(KEY, token), now) == 0
    far = (now + MAX_PROMISE_NS + 1) ^ promise_mask(KEY, token)
    torn[0, 1] = far
    assert promised_until(torn, token, promise_mask(KEY, token), now) == 0


def test_a_landing_window_is_zeroed_when_taken() -> None:
    ring = LandingRing(windows=2)
    first = ring.take()
    ring.window(first)[:] = 99
    ring.give(first)
    second, third = ring.take(), ring.take()
    assert ring.take() is None
    assert {second, third} == {0, 1} and not ring.window(first).any()


# --- through the transceivers ---------------------------------------------------------------------------------
def _poll(pair: Pair, request: TransferRequest, timeout_s: float = 10.0) -> RequestState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        statuses = pair.gen.transceiver.check_gen_transfer_status(at_least=1)
        if request.request_id in statuses.completed_request_ids | statuses.error_request_ids:
            return request.state
    return request.state


def _spy(pair: Pair, part: str, step: str) -> list[int]:
    """Transfer ids of the direct pulls that take ``step`` of the receiver's ``part`` from now on."""
    owner = getattr(pair.gen.transceiver._receiver, part)
    seen: list[int] = []
    original = getattr(owner, step)

    def spy(incoming, pull) -> object:  # noqa: ANN001
        seen.append(pull.transfer_id)
        return original(incoming, pull)

    setattr(owner, step, spy)
    return seen


def _verdicts(pair: Pair) -> list[int]:
    """The direct pulls that waited for a verdict."""
    return _spy(pair, "_direct", "await_verdict")


def _checks_after_the_read(pair: Pair) -> list[int]:
    """The direct pulls that checked the board after their READ (no promise relied on)."""
    return _spy(pair, "_prove", "post_check")


def _board_reads(pair: Pair) -> list[int]:
    """Transfer ids of the direct pulls that READ a board window from now on (beside or after the KV READ)."""
    prove = pair.gen.transceiver._receiver._prove
    seen: list[int] = []
    original = prove.read_board

    def spy(pull, notification: bytes):  # noqa: ANN001, ANN202
        seen.append(pull.transfer_id)
        return original(pull, notification)

    prove.read_board = spy
    return seen


@pytest.mark.parametrize("promise_ms", [5000, 0])
def test_the_common_case_needs_no_verdict(pair_factory, promise_ms: int) -> None:
    """With a promise in the params (same host here), no board is read at all; without, the board is read after
    the READ. Neither waits for a verdict."""
    pair = pair_factory(ctx_config={"hold_promise_ms": promise_ms})
    verdicts, after, board_reads = _verdicts(pair), _checks_after_the_read(pair), _board_reads(pair)
    request = pair.gen_request(5, pair.prefill(1, 40))
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE
    assert pair.mismatches(5, 1, 40) == 0 and verdicts == []
    assert len(after) == len(board_reads) == (0 if promise_ms else 1)
    assert pair.ctx.transceiver.check_context_transfer_status(None).completed_request_ids == {1}
    assert pair.ctx.transceiver._board.posted == 0  # cleared before the blocks were released


@pytest.mark.parametrize("why", ["promise ran out", "another clock"])
def test_without_a_promise_in_force_the_board_is_read_after_the_read(pair_factory, why: str) -> None:
    pair = pair_factory(ctx_config={"hold_promise_ms": 1 if why == "promise ran out" else 5000})
    after = _checks_after_the_read(pair)
    if why == "another clock":
        pair.gen.transceiver._receiver._side.clock_domain = "a host of its own"
    ctx_request = pair.prefill(1, 40)
    time.sleep(0.05)
    request = pair.gen_request(5, ctx_request)
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE, request.error
    assert pair.mismatches(5, 1, 40) == 0 and len(after) == 1


@pytest.mark.parametrize("change", ["promise word", "block ids", "request id", "maker rank"])
def test_params_whose_promise_does_not_fit_them_are_checked_on_the_board(pair_factory, change: str) -> None:
    """The params' promise is masked under the hold token: altered params (or a word made for other params)
    carry none, so the board is read after the READ; params made by another rank promise nothing for this one,
    whose board is read beside the READ. Here the blocks are the request's, so it completes (altered ids are
    refused: test_params_naming_other_pinned_blocks_are_refused)."""
    pair = pair_factory(ctx_config={"hold_promise_ms": 5000})
    after, board_reads = _checks_after_the_read(pair), _board_reads(pair)
    ctx_request = pair.prefill(1, 40)
    params = wire.decode(ctx_request.context_phase_params, ContextPhaseParams)
    assert params.masked_promise
    if change == "promise word":
        altered = {"masked_promise": params.masked_promise ^ (1 << 63)}
    elif change == "block ids":  # the same blocks listed twice over: the token differs, the blocks are held
        altered = {"block_ids": (params.block_ids[0],), "num_tokens": params.num_tokens - 1}
    elif change == "request id":
        other = wire.decode(pair.prefill(2, 40).context_phase_params, ContextPhaseParams)
        altered = {"masked_promise": other.masked_promise}
    else:
        altered = {"ctx_rank": 1}
    request = pair.gen_request(5, ctx_request)
    request.context_phase_params = encode_params(ContextPhaseParams(**{**params.__dict__, **altered}))
    pair.gen.transceiver.request_and_receive_async(request)
    state = _poll(pair, request)
    if change == "block ids":  # a token count the ctx never pinned: refused on the board and by the verdict
        assert state is RequestState.TRANS_ERROR and "does not match what request 1 pinned" in request.error
    else:
        assert state is RequestState.GENERATION_TRANS_COMPLETE, request.error
        assert pair.mismatches(5, 1, 40) == 0
    assert len(board_reads) == 1  # another rank's params: its board is read beside the READ, promised there
    assert len(after) == (0 if change == "maker rank" else 1)


def test_blocks_of_a_request_ended_early_stay_pinned_until_its_promise(pair_factory) -> None:
    """A ctx cancel right after the params left: a reader on the same host may already rely on the promise,
    so the blocks go back to the pool only when it runs out."""
    pair = pair_factory(ctx_config={"hold_promise_ms": 400})
    cache = pair.ctx.cache
    free_before = cache.free_blocks
    request = pair.prefill(1, 40)  # 3 blocks of 16 tokens
    assert pair.ctx.transceiver.cancel_request(request)
    cache.free(1)
    assert cache.free_blocks == free_before - 3
    time.sleep(0.6)
    assert cache.free_blocks == free_before


@pytest.mark.parametrize("why", ["ctx window full", "no landing window"])
def test_without_a_hold_check_the_ctx_verdict_decides(pair_factory, why: str) -> None:
    pair = pair_factory(ctx_config={"hold_promise_ms": 0})  # no promise to complete on
    verdicts = _verdicts(pair)
    if why == "ctx window full":
        pair.ctx.transceiver._board.post = lambda token, masked=0: False
    else:
        ring = pair.gen.transceiver._landing
        taken = [index for index in iter(ring.take, None)]
    request = pair.gen_request(5, pair.prefill(1, 40))
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE, request.error
    assert pair.mismatches(5, 1, 40) == 0 and len(verdicts) == 1
    assert pair.ctx.transceiver.check_context_transfer_status(None).completed_request_ids == {1}
    if why == "no landing window":
        for index in taken:
            ring.give(index)


def test_params_naming_other_pinned_blocks_are_refused(pair_factory) -> None:
    """Block ids of another live request in the params: the READ lands the wrong bytes, but the hold token the
    reader computes is not on the board and the ctx rank refuses it: the request fails, never completes."""
    pair = pair_factory()
    victim, other = pair.prefill(1, 40), pair.prefill(2, 40)
    params = wire.decode(victim.context_phase_params, ContextPhaseParams)
    other_ids = wire.decode(other.context_phase_params, ContextPhaseParams).block_ids
    forged = encode_params(ContextPhaseParams(**{**params.__dict__, "block_ids": other_ids}))
    pair.gen.cache.allocate(5, 40)
    request = TransferRequest(5, context_phase_params=forged)
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.TRANS_ERROR
    assert "does not match what request 1 pinned" in request.error


def test_a_read_after_the_lease_ended_fails_even_when_the_blocks_hold_new_bytes(pair_factory) -> None:
    # the late reader's deadline is the lease: 1 s leaves room for its board check and the ctx's verdict under load
    # (100 ms did not, at a load average of 30)
    pair = pair_factory(ctx_config={"lease_ms": 1000})
    pair.meet()  # (first contact would take much of the time the late reader has)
    ctx_request = pair.prefill(1, 40)
    time.sleep(1.2)  # the lease ends: the token is cleared and the blocks go back to the pool
    statuses = pair.ctx.transceiver.check_context_transfer_status(None)
    assert statuses.error_request_ids == {1}
    pair.ctx.cache.free(1)
    pair.prefill(2, 40, seed=77)  # the same blocks, new bytes (the allocator hands the freed blocks out again)
    request = pair.gen_request(5, ctx_request)
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.TRANS_ERROR
    assert "not pinned here" in request.error


def test_a_peer_claiming_a_board_of_another_size_is_read_the_slow_way(pair_factory) -> None:
    """A ctx state is untrusted: a board that is not the protocol's size is never prepared or read (a huge one
    would otherwise cost a descriptor per claimed window); the request takes the verdict path and verifies."""
    pair = pair_factory()
    ctx = pair.ctx.transceiver
    ranks = ctx.state.comm.ranks
    huge = dataclasses.replace(ranks[0].board, nbytes=1 << 40)
    state = dataclasses.replace(
        ctx.state, comm=dataclasses.replace(ctx.state.comm, ranks=(dataclasses.replace(ranks[0], board=huge),))
    )
    ctx_request = pair.prefill(1, 40)
    params = wire.decode(ctx_request.context_phase_params, ContextPhaseParams)
    forged = encode_params(dataclasses.replace(params, ctx_state=wire.encode(state)))
    pair.gen.cache.allocate(5, 40)
    request = TransferRequest(5, context_phase_params=forged)
    prepared_before = pair.gen.transceiver._agent.live_handles["prepared"]
    pair.gen.transceiver.request_and_receive_async(request)
    assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE, request.error
    assert pair.mismatches(5, 1, 40) == 0
    assert pair.gen.transceiver._agent.live_handles["prepared"] == prepared_before + 1  # the pool list, no board


@pytest.mark.parametrize("slots_free", [True, False])
def test_gathered_pieces_need_no_ctx_packing(pair_factory, slots_free: bool) -> None:
    """Block-major ctx -> per-layer NHD gen: the gen side READs whole ctx blocks into its own staging slot, piece
    by piece (slots of 2 blocks here), and unpacks them; the ctx side never packs. With every slot taken at
    first, the pull waits for one, then completes."""
    pair = pair_factory(gen_kind=LayoutKind.PER_LAYER_NHD, gen_config={"max_tokens_in_buffer": 32})
    claims = []
    pair.ctx.transceiver._loop.on_message(StageClaim, lambda reader, claim: claims.append(claim))
    verdicts = _verdicts(pair)
    staging = pair.gen.transceiver._staging
    held = [] if slots_free else [staging.acquire(("test", i), float("inf"), 1) for i in range(len(staging.slots))]
    request = pair.gen_request(5, pair.prefill(1, 100))  # 7 blocks of 16 tokens: 4 pieces
    pair.gen.transceiver.request_and_receive_async(request)
    if held:
        time.sleep(0.05)
        assert request.state is RequestState.GENERATION_TRANS_IN_PROGRESS
        for slot in held:
            staging.release(slot)
    assert _poll(pair, request) is RequestState.GENERATION_TRANS_COMPLETE, request.error
    assert pair.mismatches(5, 1, 100) == 0 and claims == [] and verdicts == []
    assert all(slot.state.value == "free" for slot in staging.slots)
