"""The fast path of a ``nixl_kv.gen.pull.Pull``: posted on the caller's thread, advanced by whoever polls.

Status checks call ``progress``, so a request completes on the caller's thread; the progress loop polls only the
pulls no caller polls (``tick``). Every pull is polled from a ``PollQueue`` (soonest due first, a bounded batch per
call) and ends by its request's deadline (``expire``). The direct lock guards the pulls: the caller's thread or the
loop thread.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import threading
import time

from nixl_kv.errors import BufferExhaustedError, NixlKvError, TransferError
from nixl_kv.gen import finish, gather
from nixl_kv.gen.plan import Planner
from nixl_kv.gen.poll_queue import PollQueue
from nixl_kv.gen.prove import Prove
from nixl_kv.gen.pull import Pull, Step
from nixl_kv.gen.reads import LONG_RUN_BYTES, Reads, give_up_at, start_by, too_late_to_start, why_expired
from nixl_kv.gen.side import GenSide, Incoming, proven_answer
from nixl_kv.gen.stuck import RequestKey
from nixl_kv.interfaces import PeerRead, TransferStatus
from nixl_kv.loop import IDLE_WAIT_S
from nixl_kv.peers import BOARD, kv_list
from nixl_kv.protocol import NoReaders, ReadVerdict

log = logging.getLogger(__name__)

DIRECT_BATCH = 64  # direct pulls whose status one progress call checks (oldest first): a tick's cost is bounded
CALLER_HANDOFF_S = 1e-3  # the loop thread progresses direct pulls the caller's thread has not polled for this long
SPIN_GBPS = {"DRAM": 2.0, "VRAM": 100.0}  # a conservative READ rate: how long a caller spins before it sleeps
SPIN_BASE_S = 300e-6  # at least this, and twice the fixed cost direct requests showed lately (EWMA)
MAX_SPIN_S = 5e-3
EXPIRE_SLICE_S = 2e-3  # the longest the loop thread ends expired direct requests for before it lets the lock go
CONNECT_RECHECK_S = 0.05  # a pull waiting for its peer is woken when the peer directory is done; else polled this often

Unit = tuple[RequestKey, int]  # (request, ctx peer rank): one pull


class DirectPulls:
    def __init__(self, side: GenSide, planner: Planner, reads: Reads, prove: Prove) -> None:
        self._side = side
        self._planner = planner
        self._reads = reads
        self._prove = prove
        self.lock = threading.RLock()  # the direct pulls: the caller's thread or the loop thread
        self._queue: PollQueue[Unit, tuple[Incoming, Pull]] = PollQueue()
        self.by_transfer: dict[int, tuple[Incoming, Pull]] = {}  # pulls that may get a verdict
        self._deadlines: list[tuple[float, RequestKey]] = []  # when to look at a request next (``_expire``)
        self._connecting: dict[str, set[Unit]] = {}  # peer -> direct pulls waiting for it
        self._changed_peers: collections.deque[str] = collections.deque()  # from the peer directory's thread
        self._caller_polled_at = 0.0
        self._ended = 0  # direct requests ended, ever (progress reports the difference)
        self._fixed_cost_s = 0.0  # EWMA of what direct requests took beyond their bytes at the spin rate

    # --- start ------------------------------------------------------------------------------------------
    def start(self, incoming: Incoming) -> None:
        """On the caller's thread: no hop into the loop thread before the READ is posted."""
        with self.lock:
            if incoming.future.done():  # cancelled or closed between admit and here: nothing may be posted
                return
            try:
                for pull in incoming.pulls:
                    self._post_when_ready(incoming, pull)
            except Exception as exc:  # noqa: BLE001 - any failure must end the request, here or in the loop
                self.fail(incoming, f"{type(exc).__name__}: {exc}")
                return
            if all(pull.step is Step.DONE for pull in incoming.pulls):
                finish.end(self._side, incoming, None)
                return
            heapq.heappush(self._deadlines, (start_by(incoming), incoming.key))

    def _post_when_ready(self, incoming: Incoming, pull: Pull) -> None:
        """Post now if the peer is ready (loaded, its lists prepared); else wait for it (CONNECT) while the peer
        directory loads it off this thread: a peer that is slow to load must not hold up requests to live peers."""
        if self._side.peers.ready(pull.rank, self._lists(pull.read)):
            self._post(incoming, pull)
            return
        pull.step, pull.waiting_since = Step.CONNECT, time.monotonic()
        unit = (incoming.key, pull.read.peer_rank)
        self._connecting.setdefault(pull.rank.agent_name, set()).add(unit)
        self._queue.put(unit, (incoming, pull), pull.waiting_since, due=pull.waiting_since + CONNECT_RECHECK_S)

    def peer_changed(self, name: str) -> None:
        """The peer directory's thread: a peer got ready, failed to load, or was closed."""
        self._changed_peers.append(name)
        self._side.loop.wake()

    def _hurry_connecting(self, now: float) -> None:
        """Under the lock: the pulls waiting for peers that changed are due now."""
        while self._changed_peers:
            for unit in self._connecting.get(self._changed_peers.popleft(), ()):
                self._queue.hurry(unit, now)

    def _stop_connecting(self, unit: Unit, pull: Pull) -> None:
        waiting = self._connecting.get(pull.rank.agent_name)
        if waiting is not None:
            waiting.discard(unit)
            if not waiting:
                del self._connecting[pull.rank.agent_name]

    @staticmethod
    def _lists(read: PeerRead) -> tuple[bytes, ...]:
        """The peer's lists a direct pull uses: its KV list (a READ of pool units or segments), its board (the hold
        check after any READ); a pull that only tells the peer it has no reader needs none."""
        if not read.expected_readers:
            return ()
        return (kv_list(read.coarse), BOARD) if read.local_indices is not None else (BOARD,)

    def _post(self, incoming: Incoming, pull: Pull) -> None:
        """READ, or for a ctx rank no gen rank needs, the NoReaders notice."""
        side, read, reads = self._side, pull.read, self._reads
        if read.expected_readers == 0:
            side.peers.connect(pull.rank)
            side.control.send(pull.rank.agent_name, NoReaders(*incoming.key, side.metadata), incoming.secret)
            pull.step = Step.DONE
            return
        if read.gathered:
            self._post_piece(incoming, pull)
            return
        if read.local_indices is not None:
            remote = side.peers.descriptors(pull.rank, read.coarse)
            local, indices = side.local[read.coarse], (read.local_indices, read.remote_indices)
            pull.handle = reads.to_peer(pull.rank, side.agent.read, local, indices[0], remote, indices[1], b"")
        else:
            side.peers.connect(pull.rank)
            pull.handle = reads.to_peer(
                pull.rank,
                side.agent.read_ranges,
                pull.rank.agent_name,
                read.state.local_rows,
                side.cache.layout.pools[0].memory,
                read.state.remote_rows,
                pull.rank.layout.pools[0].memory,
                b"",
            )
        self._prove.early_check(pull, len(self._queue))
        long_runs = read.coarse or (
            read.state is not None and read.state.nbytes >= LONG_RUN_BYTES * len(read.state.local_rows)
        )
        pull.timed_bytes = reads.measurable(pull.rank.agent_name, pull.nbytes, long_runs and len(incoming.pulls) == 1)
        pull.posted_at, pull.posts_before = time.monotonic(), reads.posts
        self._poll(incoming, pull, pull.nbytes)

    def _poll(self, incoming: Incoming, pull: Pull, nbytes: int = 0) -> None:
        """Poll the pull's step from now on, expected to move ``nbytes`` at the spin rate."""
        expected_s = nbytes / (self._side.spin_gbps * 1e9)
        self._queue.put((incoming.key, pull.read.peer_rank), (incoming, pull), time.monotonic(), expected_s)

    # --- gathered pieces --------------------------------------------------------------------------------
    def _post_piece(self, incoming: Incoming, pull: Pull) -> None:
        """A gathered READ of the next piece into our staging slot; without a free slot, wait for one (SLOT)."""
        self._poll(incoming, pull)
        if pull.slot is None:
            try:  # no lease: the slot comes back (or stays poisoned with its READ) when the request ends
                pull.slot = self._side.staging.acquire((incoming.key, pull.read.peer_rank), float("inf"), 1)
            except BufferExhaustedError:
                pull.step = Step.SLOT
                return
        nbytes = gather.read_piece(self._side, self._reads, incoming, pull)
        pull.step = Step.READ
        self._poll(incoming, pull, nbytes)
        pull.posted_at, pull.posts_before = time.monotonic(), self._reads.posts

    # --- advancing --------------------------------------------------------------------------------------
    def progress(self, from_caller: bool = True) -> int:
        """Advance the pulls due (at most DIRECT_BATCH status checks, soonest due first); returns how many requests
        ended.

        The caller announces itself before it takes the lock, so the loop thread stops polling, and waits for the
        lock rather than spinning in Python while the loop thread holds it (which would keep that thread from the
        GIL for a switch interval). The loop thread polls only pulls no caller polls (``tick``) and never waits."""
        if from_caller:
            self._caller_polled_at = time.monotonic()
            if not self.lock.acquire(timeout=MAX_SPIN_S):
                return 0
        elif not self.lock.acquire(blocking=False):
            return 0
        ended = self._ended
        try:
            now = time.monotonic()
            self._hurry_connecting(now)
            self._queue.visit(now, DIRECT_BATCH, self._visit, time.monotonic)
            return self._ended - ended
        finally:
            self.lock.release()

    def _visit(self, unit: Unit, item: tuple[Incoming, Pull]) -> None:
        incoming, pull = item
        if incoming.future.done():
            self._queue.pop(unit)
            return
        try:
            self._advance(unit, incoming, pull)
        except NixlKvError as exc:
            self.fail(incoming, str(exc))
        except Exception as exc:  # a bug or an out-of-memory must end the request, never leave it half done
            log.exception("request %s failed unexpectedly", incoming.key)
            self.fail(incoming, f"{type(exc).__name__}: {exc}")

    def spin_budget_s(self) -> float:
        """How long a waiting caller should poll before it sleeps: about the time the pending READs take (their
        bytes at a conservative rate, plus twice the fixed cost recent direct requests showed)."""
        if not self._queue:
            return 0.0
        if not self.lock.acquire(blocking=False):  # the queue is being advanced: never walk it meanwhile
            return SPIN_BASE_S
        try:
            pending = sum(pull.nbytes for _, pull in itertools.islice(self._queue.values(), DIRECT_BATCH))
        finally:
            self.lock.release()
        fixed = max(SPIN_BASE_S, 2 * self._fixed_cost_s)
        return min(MAX_SPIN_S, fixed + pending / (self._side.spin_gbps * 1e9))

    def hand_off(self) -> None:
        """The caller stops polling (it sleeps on the futures): the loop thread takes the direct pulls over now."""
        if self._queue:
            self._caller_polled_at = 0.0
            self._side.loop.wake()

    def tick(self, now: float) -> bool:
        """The loop thread: poll what no caller polls (an embedder that checks rarely), end what is past its
        deadline; whether more is due before the loop's idle wait ends."""
        neglected = bool(self._queue) and now - self._caller_polled_at > CALLER_HANDOFF_S
        if neglected:
            self.progress(from_caller=False)
            neglected = self._queue.next_due() <= time.monotonic() + IDLE_WAIT_S  # else: sleep till due
        return self._expire(now) or neglected

    def _advance(self, unit: Unit, incoming: Incoming, pull: Pull) -> None:
        if pull.step is Step.CONNECT:
            self._connect(unit, incoming, pull)
            return
        if pull.step is Step.SLOT:
            self._queue.pop(unit)
            self._post_piece(incoming, pull)
            return
        side = self._side
        agent = side.agent
        if pull.handle is not None:
            status = agent.status(pull.handle)
            if status is TransferStatus.IN_PROGRESS:
                return
            if status is TransferStatus.FAILED:
                side.stuck.close_when_free({pull.rank.agent_name})  # (its connection may be broken)
                raise TransferError(f"{pull.step.value.split()[0]} from {pull.rank.agent_name} failed")
            agent.release_transfer(pull.handle)
            pull.handle = None
            side.peers.proven(pull.rank.agent_name)
            pull.proof.read_seen_ns = time.monotonic_ns()
            pull.proof.promised = pull.proof.read_seen_ns < pull.proof.promised_until_ns
        if pull.proof.early is not None and not self._prove.early_check_ended(incoming, pull):
            return
        self._queue.pop(unit)
        if pull.step is Step.READ and pull.read.gathered:
            gather.unpack_piece(self._side, self._planner.local_blocks(incoming.request.request_id), incoming, pull)
            pull.piece += 1
            if pull.piece < len(pull.read.pieces):
                self._post_piece(incoming, pull)
                return
            side.staging.release(pull.slot)
            pull.slot = None
        if pull.step is Step.READ:
            self._reads.transport_check(
                pull.rank.agent_name, pull.timed_bytes, pull.posted_at, pull.posts_before, time.monotonic()
            )
            if pull.proof.promised:
                self._prove.release_hold(incoming, pull)  # queued first: it goes out even if ending the request fails
                self._done(incoming, pull)
                return
            self.by_transfer[pull.transfer_id] = (incoming, pull)  # a verdict may overtake the check: kept till then
            if self._prove.post_check(incoming, pull):
                self._poll(incoming, pull)
            else:
                self.await_verdict(incoming, pull)
            return
        if self._prove.check_ended(pull):  # Step.CHECK finished
            self._done(incoming, pull)
        else:
            self.await_verdict(incoming, pull)

    def _connect(self, unit: Unit, incoming: Incoming, pull: Pull) -> None:
        """The peer directory loaded the peer (post now), failed to (end the request), or is still at it."""
        peers = self._side.peers
        if reason := peers.failure(pull.rank.agent_name, pull.waiting_since):
            raise TransferError(reason)
        if not peers.ready(pull.rank, self._lists(pull.read)):
            self._queue.put(unit, (incoming, pull), pull.waiting_since, due=time.monotonic() + CONNECT_RECHECK_S)
            return
        if too_late_to_start(incoming, time.monotonic()):
            raise TransferError(f"{pull.rank.agent_name} was loaded too close to the deadline to start a READ")
        self._stop_connecting(unit, pull)
        self._queue.pop(unit)
        pull.step = Step.READ
        self._post(incoming, pull)
        if all(p.step is Step.DONE for p in incoming.pulls):  # (it only told the peer it has no reader)
            self._ended += 1
            finish.end(self._side, incoming, None)

    def await_verdict(self, incoming: Incoming, pull: Pull) -> None:
        """Rare: the hold was not on the board; the peer answers the ReadDone with a verdict."""
        pull.step = Step.VERDICT
        if pull.verdict is not None:
            self._take_verdict(incoming, pull)

    def _take_verdict(self, incoming: Incoming, pull: Pull) -> None:
        self.by_transfer.pop(pull.transfer_id, None)
        if pull.verdict:
            self.fail(incoming, f"ctx side refused: {pull.rank.agent_name}: {pull.verdict}")
        else:
            self._done(incoming, pull)

    def _done(self, incoming: Incoming, pull: Pull) -> None:
        pull.step = Step.DONE
        self.by_transfer.pop(pull.transfer_id, None)
        if all(p.step is Step.DONE for p in incoming.pulls):
            request = incoming.request
            elapsed = time.monotonic() - request.transfer_start
            fixed = max(0.0, elapsed - request.transfer_bytes / (self._side.spin_gbps * 1e9))
            self._fixed_cost_s += 0.1 * (min(fixed, MAX_SPIN_S) - self._fixed_cost_s)
            self._ended += 1
            finish.end(self._side, incoming, None)

    def on_verdict(self, sender: str, verdict: ReadVerdict) -> bool:
        """A verdict for a direct pull; False when it is not one."""
        with self.lock:
            found = self.by_transfer.get(verdict.transfer_id)
            if found is None:
                return False
            incoming, pull = found
            if not proven_answer(self._side, incoming, pull, sender, verdict):
                return True
            pull.verdict = "" if verdict.ok else (verdict.reason or "refused by the ctx side")
            if pull.step is Step.VERDICT and not incoming.future.done():
                self._take_verdict(incoming, pull)
            return True

    # --- ending -----------------------------------------------------------------------------------------
    def _expire(self, now: float) -> bool:
        """End the direct requests whose time is up (``why_expired``): each is looked at when it must start its
        READs by (it ends then if a pull still waits for its peer) and when a READ in flight is given up. The lock
        is held for at most EXPIRE_SLICE_S at a time, so that hundreds due at once (a flood to dead peers) neither
        wait for many loop ticks nor stall the live requests' polling. Returns whether more are due."""
        if not self._deadlines or self._deadlines[0][0] > now:
            return False  # nothing due: no lock taken (a spinning caller holds it often)
        with self.lock:
            stop = time.monotonic() + EXPIRE_SLICE_S
            while self._deadlines and self._deadlines[0][0] <= now and time.monotonic() < stop:
                _, key = heapq.heappop(self._deadlines)
                incoming = self._side.requests.get(key)
                if incoming is None or not incoming.fast or incoming.future.done():
                    continue
                if reason := why_expired(incoming, now):
                    self.fail(incoming, reason)
                else:  # looked at when it had to start by: next, when its READs are given up
                    heapq.heappush(self._deadlines, (give_up_at(incoming), key))
            return bool(self._deadlines) and self._deadlines[0][0] <= now

    def fail(self, incoming: Incoming, reason: str) -> None:
        """End a direct request in error (``finish.fail``), once its pulls are out of the poll queue."""
        with self.lock:
            if incoming.future.done():
                return
            for pull in incoming.pulls:
                unit = (incoming.key, pull.read.peer_rank)
                self._queue.pop(unit)
                if pull.step is Step.CONNECT:
                    self._stop_connecting(unit, pull)
                self.by_transfer.pop(pull.transfer_id, None)
            finish.fail(self._side, incoming, reason)
