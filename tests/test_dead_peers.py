"""READs to dead ctx peers (issues 22, 29): the gen's blocks come back within the deadline, live requests do not wait
behind them, and new ctx instances are reached during and after a flood. Three runs, each beside ordinary requests to
a live ctx in this process:

- 600 dead ctx instances (clones of one on a host that vanished, ``tests.dead_host``) flood one gen instance;
- 200 hung ones (the host up, its process stopped: UCX answers nothing, the kernel acknowledges everything);
- a ctx instance on such a host dies (link down, SIGKILL) with 50 READs from it in flight (it was stopped first, so
  they cannot finish before).

Each asserts: every request to a dead peer ends in error by its deadline; its gen blocks are free and unpoisoned
within its deadline + 1 s (hung peers: all but those whose abandoned READ is still in progress, the documented gap);
no first-contact slot is taken then; the live requests, timed as a serving engine sees them (submitted, then polled
from one thread), keep their median within 2x (p99 5x) of the same requests just before and after the event (the
larger), looser on a loaded machine (``NOISE``); in a flood, a ctx instance started halfway through and one started
after it each have their first request within 2 s and their later ones within 2x the live median without the flood;
every live request arrives byte for byte; nothing is left after close. The figures are printed (``pytest -s``) and in
RELIABILITY.md. Needs root (network namespaces), as CI here has.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nixl_kv.cache import PagedKVCache
from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.harness.pair import percentile
from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.transceiver import CacheTransceiver
from tests import dead_host
from tests.conftest import Shape, Side

pytestmark = pytest.mark.skipif(bool(dead_host.can_build()), reason=dead_host.can_build() or "")

LEASE_MS = 2000  # the dead ctx's lease: the gen's deadline for its requests
LIVE_TOKENS = 40
DEAD_TOKENS = 16
BASELINE_ROUNDS = 150
NOISE = 2.0  # the ratios asserted are the targets times this (2 cores shared with other work); RELIABILITY has the real
LATE_S = 0.05  # how late after its deadline a dead request may be reported ended on a loaded machine (target: 0)
RELEASE_S = 1.0  # the target: blocks free and unpoisoned within the deadline plus this
# How many dead (vanished) and hung (stopped) ctx peers flood the gen: fewer than the 600 and 2,000 of RELIABILITY.md
# for the hung ones in CI, where the property is the same (every first-contact slot taken many times over); the
# figures there come from NIXL_KV_TEST_DEAD_PEERS=2000 / NIXL_KV_TEST_HUNG_PEERS=2000.
DEAD_PEERS = int(os.environ.get("NIXL_KV_TEST_DEAD_PEERS", "600"))
HUNG_PEERS = int(os.environ.get("NIXL_KV_TEST_HUNG_PEERS", "200"))
FIRST_S = 2.0  # the target: a ctx instance met during or after the flood has its first request within this
NEWCOMER_ROUNDS = 20  # at least this many later requests to it, held to 2x the live ones' p50 without the flood


@dataclass
class TimedCache(PagedKVCache):
    """A paged cache that notes when each request's blocks went back (freed and no longer pinned)."""

    released: dict[int, float] = field(init=False, default_factory=dict)

    def _release_if_done(self, request_id: int, entry) -> None:  # noqa: ANN001
        super()._release_if_done(request_id, entry)
        if request_id not in self._requests:
            self.released[request_id] = time.monotonic()


@dataclass
class Figures:
    baseline_s: list[float] = field(default_factory=list)  # live requests just before the event
    after_s: list[float] = field(default_factory=list)  # and just after it (the machine may have got busier)
    during_s: list[float] = field(default_factory=list)
    wrong_elements: int = 0
    newcomers: dict[str, list[float]] = field(default_factory=dict)  # a ctx met during/after the flood: its requests
    first_contacts: int = -1  # first-contact slots taken at the last deadline plus RELEASE_S
    dead_late_s: list[float] = field(default_factory=list)  # each dead request's end minus its deadline
    released_late_s: list[float] = field(default_factory=list)  # its blocks' return minus its deadline

    def without(self, fraction: float) -> float:
        """The live requests' percentile without the event: the larger of before and after it."""
        return max(percentile(self.baseline_s, fraction), percentile(self.after_s, fraction))

    def ratio(self, fraction: float) -> float:
        return percentile(self.during_s, fraction) / self.without(fraction)

    def line(self, run: str) -> str:
        ms = lambda value: f"{value * 1e3:.1f}"  # noqa: E731
        p50, p99 = percentile(self.during_s, 0.5), percentile(self.during_s, 0.99)
        met = "".join(
            f"; ctx met {when}: first {ms(times[0])} ms, then p50 {ms(percentile(times[1:], 0.5))} ms"
            for when, times in self.newcomers.items()
        )
        return (
            f"[{run}] live p50 {ms(self.without(0.5))} -> {ms(p50)} ms ({self.ratio(0.5):.2f}x), "
            f"p99 {ms(self.without(0.99))} -> {ms(p99)} ms ({self.ratio(0.99):.2f}x), max {ms(max(self.during_s))} ms, "
            f"{len(self.during_s)} live during, {self.wrong_elements} wrong elements; {len(self.dead_late_s)} dead: "
            f"last ended {max(self.dead_late_s):+.3f} s from its deadline, blocks back by "
            f"{max(self.released_late_s):+.3f} s (median {percentile(self.released_late_s, 0.5):+.3f} s), "
            f"{sum(late > RELEASE_S for late in self.released_late_s)} not within +{RELEASE_S:.0f} s; "
            f"{self.first_contacts} first-contact slots taken at +{RELEASE_S:.0f} s{met}"
        )


class Engine:
    """Drives a gen instance from one thread as a serving engine does: submits, then polls status checks; live
    requests are prefilled on the live ctx in this process one at a time and checked element by element."""

    def __init__(self, shape: Shape, gen: Side, ctx: Side) -> None:
        self.shape, self.gen, self.ctx = shape, gen, ctx
        self.dead: dict[int, TransferRequest] = {}
        self.live_ids = iter(range(1, 1 << 20))
        self.figures = Figures()
        self.met: dict[str, Side] = {}  # ctx instances met during the event

    def live_round(self, into: list[float], ctx: Side | None = None) -> None:
        """One ordinary request to ``ctx`` (the live ctx unless given), timed and checked."""
        ctx = ctx or self.ctx
        rid = next(self.live_ids)
        ctx.cache.allocate(rid, LIVE_TOKENS)
        ctx.cache.write_tokens(rid, _expected(self.shape, rid, LIVE_TOKENS))
        ctx_request = TransferRequest(rid, num_tokens=LIVE_TOKENS)
        ctx.transceiver.respond_and_send_async(ctx_request)
        self.gen.cache.allocate(rid, LIVE_TOKENS)
        request = TransferRequest(rid, context_phase_params=ctx_request.context_phase_params)
        started = time.monotonic()
        self.gen.transceiver.request_and_receive_async(request)
        deadline = started + 10.0
        while request.state is RequestState.GENERATION_TRANS_IN_PROGRESS and time.monotonic() < deadline:
            self.poll(at_least=1)
        into.append(time.monotonic() - started)
        assert request.state is RequestState.GENERATION_TRANS_COMPLETE, request.error
        self.figures.wrong_elements += _mismatches(self.shape, self.gen.cache, rid, LIVE_TOKENS)
        self.gen.cache.free(rid)
        ctx.transceiver.check_context_transfer_status(0, mark_complete=True)
        ctx.cache.free(rid)

    def submit_dead(self, request_id: int, params: bytes) -> None:
        self.gen.cache.allocate(request_id, DEAD_TOKENS)
        request = TransferRequest(request_id, context_phase_params=params)
        self.dead[request_id] = request
        self.gen.transceiver.request_and_receive_async(request)

    def poll(self, at_least: int = 0) -> None:
        statuses = self.gen.transceiver.check_gen_transfer_status(at_least=at_least)
        for rid in statuses.completed_request_ids | statuses.error_request_ids:
            if rid in self.dead:
                assert rid in statuses.error_request_ids, f"dead request {rid} completed"
                self.gen.cache.free(rid)  # as a server does: its blocks come back once no READ may land there

    def meet(self, when: str, ctx: Side) -> None:
        """A ctx instance the gen never met: its first request, timed; ``rounds`` then sends it one with each live
        request, so that its later ones span the rest of the event as the live ones do."""
        self.figures.newcomers[when] = []
        self.met[when] = ctx
        self.live_round(self.figures.newcomers[when], ctx)

    def rounds(self, into: list[float]) -> None:
        """A live request, and one to each ctx instance met during the event."""
        self.live_round(into)
        for when, ctx in self.met.items():
            self.live_round(self.figures.newcomers[when], ctx)

    def until_released(self, live: bool, grace_s: float = 3.0) -> None:
        """Live rounds (or polls) until the last dead request's deadline plus RELEASE_S, when the first-contact slots
        taken are noted (or at once, if that has passed), then until every dead request's blocks are back, or its
        deadline plus ``grace_s``."""
        last = max(request.transfer_deadline for request in self.dead.values())
        while time.monotonic() < last + RELEASE_S:
            self._round(live)
        self.figures.first_contacts = self.gen.transceiver._peers.first_contacts
        while not set(self.dead) <= set(self.gen.cache.released) and time.monotonic() < last + grace_s:
            self._round(live)
        self.poll()

    def _round(self, live: bool) -> None:
        if live:
            self.rounds(self.figures.during_s)
        else:
            self.poll(at_least=0)
            time.sleep(0.005)

    def settle(self) -> Figures:
        """Every dead request ended in error; when each ended and when its blocks came back, against its deadline."""
        for rid, request in self.dead.items():
            assert request.state is RequestState.TRANS_ERROR, (rid, request.state)
            self.figures.dead_late_s.append(request.transfer_end - request.transfer_deadline)
            released = self.gen.cache.released.get(rid, float("inf"))
            self.figures.released_late_s.append(released - request.transfer_deadline)
        return self.figures


def _expected(shape: Shape, seed: int, tokens: int):  # noqa: ANN202
    from nixl_kv.harness.fill import expected

    return expected(seed, shape.where(tokens), shape.dtype.itemsize)


def _mismatches(shape: Shape, cache: PagedKVCache, rid: int, tokens: int) -> int:
    from nixl_kv.harness.fill import count_mismatches

    return count_mismatches(cache.read_tokens(rid, tokens), rid, shape.where(tokens))


@dataclass
class World:
    shape: Shape
    host: dead_host.DeadHost
    gen: Side
    ctx: Side
    newcomers: list[Side] = field(default_factory=list)  # ctx instances started during or after the flood

    def new_ctx(self) -> Side:
        side = _side(self.shape)
        self.newcomers.append(side)
        return side

    def close(self) -> dict[str, object]:
        """Close every instance; what they still hold (all must be empty)."""
        for side in (self.gen, self.ctx, *self.newcomers):
            side.transceiver.close()
        return {
            "gen agent": self.gen.transceiver._agent.live_handles,
            "ctx agent": self.ctx.transceiver._agent.live_handles,
            "new ctx agents": [side.transceiver._agent.live_handles for side in self.newcomers if _holds(side)],
            "gen pinned": self.gen.cache.pinned_requests,
            "gen free blocks": self.gen.cache.free_blocks - self.shape.num_blocks,
            "poisoned": dict(self.gen.transceiver._receiver.poisoned),
            "gen slots not free": len(self.gen.transceiver._staging.slots) - self.gen.transceiver._staging.free_slots,
        }


NOTHING_LEFT = {
    "gen agent": {"transfers": 0, "prepared": 0, "remotes": 0, "registrations": 0},
    "ctx agent": {"transfers": 0, "prepared": 0, "remotes": 0, "registrations": 0},
    "new ctx agents": [],
    "gen pinned": 0,
    "gen free blocks": 0,
    "poisoned": {},
    "gen slots not free": 0,
}


def _holds(side: Side) -> bool:
    return any(side.transceiver._agent.live_handles.values())


def _side(shape: Shape) -> Side:
    cache = _timed_cache(shape)
    return Side(cache, CacheTransceiver(cache, shape.state(), CacheTransceiverConfig()))


@pytest.fixture
def world() -> Iterator[World]:
    """The dead host's link first (the gen agent lists its TCP devices when it starts), then a gen instance and a
    live ctx instance in this process."""
    host = dead_host.DeadHost().up()
    shape = Shape(num_blocks=max(1024, max(DEAD_PEERS, HUNG_PEERS) + 256))
    sides: list[Side] = []
    made: World | None = None
    try:
        sides.extend(_side(shape) for _ in ("gen", "ctx"))
        made = World(shape, host, *sides)
        yield made
    finally:
        for side in sides + (made.newcomers if made is not None else []):
            side.transceiver.close()
        host.close()


def _timed_cache(shape: Shape) -> TimedCache:
    return TimedCache(
        num_blocks=shape.num_blocks,
        num_layers=shape.layers,
        num_heads=shape.heads,
        tokens_per_block=shape.tokens_per_block,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
    )


def test_600_dead_ctx_peers_flooding_a_gen_release_its_blocks_and_do_not_hold_up_live_or_new_ctx_instances(
    world: World, tmp_path: Path
) -> None:
    (params,) = world.host.start(["1", str(DEAD_TOKENS), str(LEASE_MS)], tmp_path / "boot_id")
    world.host.die()
    engine = _flood(world, params)
    _settle_and_check(engine, world, f"{DEAD_PEERS} dead ctx peers")


def test_a_flood_of_hung_ctx_peers_leaves_no_first_contact_slot_taken_and_new_ctx_instances_are_served(
    world: World, tmp_path: Path
) -> None:
    """Hung peers (their host up, their process stopped: its kernel acknowledges, UCX answers nothing) are the
    worst case: their READs never leave in progress, so their destination stays poisoned (the documented gap: NIXL
    cannot close a peer with a READ in flight without letting a late answer land), yet none of them keeps a
    first-contact slot once its requests ended, and ctx instances met during and after the flood are served."""
    (params,) = world.host.start(["1", str(DEAD_TOKENS), str(LEASE_MS)], tmp_path / "boot_id")
    world.host.stop()
    engine = _flood(world, params, HUNG_PEERS)
    engine.until_released(live=True, grace_s=RELEASE_S)
    figures = engine.settle()
    for _ in range(BASELINE_ROUNDS):
        engine.live_round(figures.after_s)
    print(figures.line(f"{HUNG_PEERS} hung ctx peers"))
    _assert_liveness(figures)
    assert max(figures.dead_late_s) <= RELEASE_S, figures.dead_late_s  # (on time: the test above; here, they end)
    receiver = world.gen.transceiver._receiver
    stuck = {read.request_id for read in receiver._stuck._reads}
    assert set(engine.dead) - set(world.gen.cache.released) == stuck  # held back: exactly those whose READ may land
    assert {key for key in receiver.poisoned} == {read.key for read in receiver._stuck._reads}
    assert world.gen.cache.pinned_requests == len(stuck)
    assert world.close() == NOTHING_LEFT  # (closing the gen's agent ends them)


def test_a_ctx_killed_with_50_reads_in_flight_releases_them_and_does_not_hold_up_live_requests(
    world: World, tmp_path: Path
) -> None:
    dying = world.host.start(["50", str(DEAD_TOKENS), str(LEASE_MS)], tmp_path / "boot_id")
    engine = Engine(world.shape, world.gen, world.ctx)
    for _ in range(BASELINE_ROUNDS):
        engine.live_round(engine.figures.baseline_s)
    world.host.stop()
    for index, params in enumerate(dying):
        engine.submit_dead(200_000 + index, params)
    agent = world.gen.transceiver._agent
    deadline = time.monotonic() + 5
    while agent.live_handles["transfers"] < 50 and time.monotonic() < deadline:
        engine.poll()
    assert agent.live_handles["transfers"] >= 50 and world.gen.transceiver._receiver.pending == 50  # in flight
    world.host.die()
    _settle_and_check(engine, world, "ctx killed with 50 READs in flight")


def _flood(world: World, params: bytes, peers: int = DEAD_PEERS) -> Engine:
    """The live requests without the flood, then the flood: ``peers`` clones of the dead ctx, 20 between two live
    requests, a ctx instance never met before started halfway through; and one more once it is over."""
    engine = Engine(world.shape, world.gen, world.ctx)
    for _ in range(BASELINE_ROUNDS):
        engine.live_round(engine.figures.baseline_s)
    clones = [(100_000 + i, dead_host.clone(params, i)) for i in range(peers)]
    halfway = len(clones) // 2
    while clones:
        for rid, cloned in clones[:20]:
            engine.submit_dead(rid, cloned)
        del clones[:20]
        engine.rounds(engine.figures.during_s)
        if len(clones) <= halfway and "during the flood" not in engine.figures.newcomers:
            engine.meet("during the flood", world.new_ctx())
    engine.meet("after the flood", world.new_ctx())
    return engine


def _settle_and_check(engine: Engine, world: World, name: str) -> None:
    """After the event: every dead request's blocks back (or their grace passed), the live rounds after it, the
    figures printed and held to the targets, and nothing left once the world closes."""
    engine.until_released(live=True)
    figures = engine.settle()
    for _ in range(BASELINE_ROUNDS):
        engine.live_round(figures.after_s)
    print(figures.line(name))
    _assert_targets(figures)
    if figures.newcomers:
        _assert_liveness(figures)
    assert world.close() == NOTHING_LEFT


def _assert_targets(figures: Figures) -> None:
    assert figures.wrong_elements == 0
    assert max(figures.dead_late_s) <= LATE_S, figures.dead_late_s
    assert max(figures.released_late_s) <= RELEASE_S, sorted(figures.released_late_s)[-5:]
    assert figures.ratio(0.5) <= 2 * NOISE and figures.ratio(0.99) <= 5 * NOISE, figures.line("ratios")


def _assert_liveness(figures: Figures) -> None:
    """Ctx instances met during and after the flood were served (first request within FIRST_S, later ones within
    2x the live p50 without the flood, looser by NOISE), and no first-contact slot was still taken at the last
    deadline plus RELEASE_S."""
    assert figures.wrong_elements == 0
    assert set(figures.newcomers) == {"during the flood", "after the flood"}
    for when, times in figures.newcomers.items():
        assert len(times) > NEWCOMER_ROUNDS and times[0] <= FIRST_S * NOISE, (when, figures.line("first request"))
        assert percentile(times[1:], 0.5) <= 2 * NOISE * figures.without(0.5), (when, figures.line("later ones"))
    assert figures.first_contacts == 0, figures.line("slots")
