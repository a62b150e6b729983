"""Agreement on transfer outcomes across ranks, with a fake communicator that answers for the other ranks."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nixl_kv.comm import SingleProcessComm
from nixl_kv.consensus import Outcome, Vote, ready_everywhere, reduce_in_stages, reduce_outcomes


class FakeComm:
    """A communicator of ``size`` ranks seen from ``rank``: allgather returns the caller's value at ``rank`` and
    pre-set values for every other rank. Each call's own contribution is recorded in ``sent``."""

    def __init__(self, size: int, others: list[Any] | None = None, rank: int = 0) -> None:
        others = [] if others is None else others
        assert len(others) == size - 1, "one pre-set value per other rank"
        self.rank = rank
        self.size = size
        self._others = list(others)
        self.sent: list[Any] = []

    def allgather(self, value: Any) -> list[Any]:
        self.sent.append(value)
        return self._others[: self.rank] + [value] + self._others[self.rank :]

    def bcast(self, value: Any, root: int = 0) -> Any:
        raise AssertionError("not used by consensus")

    def barrier(self) -> None:
        raise AssertionError("not used by consensus")

    def split(self, color: int, key: int) -> FakeComm:
        raise AssertionError("not used by consensus")


RankState = tuple[set[int], set[int], set[int]]  # completed, failed, timed out


def contribution(completed: set[int], failed: set[int], timed_out: set[int] = frozenset()) -> Any:
    """What a rank with this state hands to allgather (captured from the library, not reimplemented)."""
    probe = FakeComm(2, [[]])
    reduce_outcomes(probe, completed, failed, timed_out)
    return probe.sent[0]


def agree(states: list[RankState]) -> Outcome:
    """Run reduce_outcomes as every rank of the group in turn; all of them must reach the same outcome."""
    outcomes = []
    for rank, state in enumerate(states):
        others = [contribution(*other) for r, other in enumerate(states) if r != rank]
        comm = FakeComm(len(states), others, rank)
        outcomes.append(reduce_outcomes(comm, *state))
        assert len(comm.sent) == (1 if len(states) > 1 else 0)
    assert all(outcome == outcomes[0] for outcome in outcomes)
    return outcomes[0]


def test_contribution_is_one_vote_per_request_and_state() -> None:
    votes = contribution({1, 2, 3}, {3, 4}, {5, 4})
    assert sorted(votes) == sorted(
        [(1, Vote.COMPLETED), (2, Vote.COMPLETED), (3, Vote.FAILED), (4, Vote.FAILED)]
        + [(4, Vote.TIMED_OUT), (5, Vote.TIMED_OUT)]
    )


def test_completed_only_when_every_rank_completed() -> None:
    outcome = agree([({1, 2}, set(), set()), ({1}, set(), set()), ({1, 2}, set(), set())])
    assert outcome == Outcome(completed={1}, failed=set(), timed_out=set())


def test_completed_on_one_of_two_ranks_is_neither() -> None:
    outcome = agree([({7}, set(), set()), (set(), set(), set())])
    assert outcome == Outcome(completed=set(), failed=set(), timed_out=set())


def test_failed_only_when_every_rank_is_terminal() -> None:
    # 3: failed on rank 0, completed on rank 1 -> failed; 4: failed on rank 0, still running on rank 1 -> neither
    outcome = agree([(set(), {3, 4}, set()), ({3}, set(), set())])
    assert outcome == Outcome(completed=set(), failed={3}, timed_out=set())


def test_failed_everywhere() -> None:
    outcome = agree([(set(), {9}, set()), (set(), {9}, set()), (set(), {9}, set()), (set(), {9}, set())])
    assert outcome == Outcome(completed=set(), failed={9}, timed_out=set())


def test_failed_wins_over_completed_on_the_same_rank() -> None:
    outcome = agree([({5}, {5}, set()), ({5}, set(), set())])
    assert outcome == Outcome(completed=set(), failed={5}, timed_out=set())


def test_timeout_on_any_rank_is_reported_and_fails_a_terminal_request() -> None:
    # 1: timed out (and failed) on rank 1, completed on rank 0 -> failed and timed out
    # 2: completed everywhere, but rank 0 saw it time out -> failed and timed out
    # 3: timed out on rank 0 while rank 1 has not finished -> timed out only
    outcome = agree([({1, 2}, set(), {2, 3}), ({2}, {1}, {1})])
    assert outcome == Outcome(completed=set(), failed={1, 2}, timed_out={1, 2, 3})


def test_timeout_alone_is_not_a_terminal_vote() -> None:
    """A rank that only reports a timeout has not completed or failed the request: the group does not decide."""
    outcome = agree([(set(), set(), {4}), ({4}, set(), set())])
    assert outcome == Outcome(completed=set(), failed=set(), timed_out={4})


def test_one_rank_group_needs_no_allgather() -> None:
    comm = FakeComm(1)
    outcome = reduce_outcomes(comm, {1, 2, 3}, {2}, {3})
    assert comm.sent == []
    assert outcome == Outcome(completed={1}, failed={2, 3}, timed_out={3})
    assert reduce_outcomes(SingleProcessComm(), {1}, set()) == Outcome(completed={1})


rank_states = st.tuples(
    st.sets(st.integers(0, 5), max_size=6),
    st.sets(st.integers(0, 5), max_size=3),
    st.sets(st.integers(0, 5), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(rank_states, min_size=1, max_size=5))
def test_reduce_outcomes_matches_the_rules(states: list[RankState]) -> None:
    outcome = agree(states)
    rids = set().union(*(c | f | t for c, f, t in states))
    completed = {rid for rid in rids if all(rid in c and rid not in f for c, f, _ in states)}
    terminal = {rid for rid in rids if all(rid in c | f for c, f, _ in states)}
    timed_out = {rid for rid in rids if any(rid in t for _, _, t in states)}
    failed = {rid for rid in terminal if any(rid in f or rid in t for _, f, t in states)}
    assert outcome.timed_out == timed_out
    assert outcome.failed == failed
    assert outcome.completed == completed - timed_out
    assert not outcome.completed & outcome.failed


def grid_outcome(grid: list[list[RankState]], row: int, col: int) -> Outcome:
    """reduce_in_stages on rank (row, col) of a grid: stage 1 over the row (TP), stage 2 over the column (PP).

    The other ranks' answers are pre-set: stage 1 from their own states, stage 2 from what the other rows'
    stage-1 outcomes contribute."""
    row_states = grid[row]
    tp = FakeComm(len(row_states), [contribution(*s) for c, s in enumerate(row_states) if c != col], col)
    other_rows = [agree(grid[r]) for r in range(len(grid)) if r != row]
    pp = FakeComm(len(grid), [contribution(o.completed, o.failed, o.timed_out) for o in other_rows], row)
    outcome = reduce_in_stages([tp, pp], *row_states[col])
    stage1 = agree(row_states)
    assert len(pp.sent) == 1
    assert sorted(pp.sent[0]) == sorted(contribution(stage1.completed, stage1.failed, stage1.timed_out))
    return outcome


NONE: RankState = (set(), set(), set())


@pytest.mark.parametrize(
    "grid,want",
    [
        # completed on all four ranks
        ([[({1}, set(), set())] * 2] * 2, Outcome(completed={1})),
        # one rank of the second row has not finished
        ([[({1}, set(), set())] * 2, [({1}, set(), set()), NONE]], Outcome()),
        # failed on one rank, completed on the other three
        ([[(set(), {1}, set()), ({1}, set(), set())], [({1}, set(), set())] * 2], Outcome(failed={1})),
        # failed on one rank, another rank still busy
        ([[(set(), {1}, set()), ({1}, set(), set())], [({1}, set(), set()), NONE]], Outcome()),
        # timed out on one rank only: reported everywhere, decided nowhere
        ([[(set(), set(), {1}), ({1}, set(), set())], [({1}, set(), set())] * 2], Outcome(timed_out={1})),
        # completed everywhere but one rank saw a timeout
        ([[({1}, set(), {1}), ({1}, set(), set())], [({1}, set(), set())] * 2], Outcome(failed={1}, timed_out={1})),
    ],
    ids=["completed", "one-busy", "one-failed", "failed-and-busy", "timeout-only", "completed-with-timeout"],
)
def test_reduce_in_stages_on_a_two_by_two_grid(grid: list[list[RankState]], want: Outcome) -> None:
    for row in range(2):
        for col in range(2):
            assert grid_outcome(grid, row, col) == want


def test_reduce_in_stages_with_no_groups_is_the_local_state() -> None:
    assert reduce_in_stages([], {1}, {2}, {3}) == Outcome(completed={1}, failed={2}, timed_out={3})


def test_reduce_in_stages_of_one_rank_groups() -> None:
    comms = [FakeComm(1), FakeComm(1)]
    assert reduce_in_stages(comms, {1, 2}, {2}) == Outcome(completed={1}, failed={2})
    assert all(comm.sent == [] for comm in comms)


def test_ready_everywhere() -> None:
    comm = FakeComm(3, [[1, 2, 3, 5, 5], [2, 3, 4, 5]], rank=1)
    assert ready_everywhere(comm, [3, 2, 9]) == {2, 3}
    assert comm.sent == [[3, 2, 9]]


def test_ready_everywhere_counts_a_repeated_id_once_per_rank() -> None:
    comm = FakeComm(3, [[5, 5, 5], []])
    assert ready_everywhere(comm, [5]) == set()


def test_ready_everywhere_on_one_rank() -> None:
    comm = FakeComm(1)
    assert ready_everywhere(comm, [4, 4, 1]) == {1, 4}
    assert comm.sent == []
