"""The stepped paths of a ``nixl_kv.gen.pull.Pull``: advanced a step at a time by the progress loop.

They take what the fast path does not: staged reads (claim a box, the ctx packs it into a slot and grants it, READ
the slot, unpack it), layer-wise requests (watch the peer, read each group of layers once it is ready), and peers
without a hold board. Each READ carries its ``ReadDone`` and is proven by the ctx rank's verdict.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from nixl_kv.errors import BufferExhaustedError, NixlKvError, TransferError
from nixl_kv.gen import finish
from nixl_kv.gen.pull import IN_TRANSFER, Pull, Step
from nixl_kv.gen.reads import LONG_RUN_BYTES, Reads, too_late_to_start, why_expired
from nixl_kv.gen.side import GenSide, Incoming, proven_answer
from nixl_kv.interfaces import TransferStatus
from nixl_kv.peers import kv_list
from nixl_kv.protocol import LayersReady, LayerWatch, NoReaders, ReadVerdict, StageClaim, StageGrant

log = logging.getLogger(__name__)

CLAIM_RETRY_S = 1e-3


class SteppedPulls:
    def __init__(self, side: GenSide, reads: Reads) -> None:
        self._side = side
        self._reads = reads
        self._by_transfer: dict[int, tuple[Incoming, Pull]] = {}

    def tick(self, now: float) -> bool:
        """Advance every stepped request once; whether there were any."""
        active = self._side.requests.all_stepped()
        for incoming in active:
            try:
                self._advance(incoming, now)
            except NixlKvError as exc:
                self.fail(incoming, str(exc))
            except Exception as exc:  # a bug or an out-of-memory must end the request, never leave it half done
                log.exception("request %s failed unexpectedly", incoming.key)
                self.fail(incoming, f"{type(exc).__name__}: {exc}")
        return bool(active)

    def _advance(self, incoming: Incoming, now: float) -> None:
        for pull in incoming.pulls:
            if pull.step is not Step.DONE:
                self._advance_pull(incoming, pull, now)
                if incoming.future.done():
                    return
        if all(pull.step is Step.DONE for pull in incoming.pulls):
            self._end(incoming, None)
        elif reason := why_expired(incoming, now):
            self.fail(incoming, reason)

    def _advance_pull(self, incoming: Incoming, pull: Pull, now: float) -> None:
        if pull.step in (Step.CONNECT, Step.LAYERS, Step.SLOT):
            self._next(incoming, pull, now)
            return
        if pull.step is Step.CLAIM:
            self._on_granted(incoming, pull, now)
            return
        if pull.step is Step.READ:
            status = self._side.agent.status(pull.handle)
            if status is TransferStatus.FAILED:
                self._side.stuck.close_when_free({pull.rank.agent_name})  # (its connection may be broken)
                raise TransferError(f"READ from {pull.rank.agent_name} failed")
            if status is TransferStatus.IN_PROGRESS:
                return
            self._side.agent.release_transfer(pull.handle)
            pull.handle = None
            self._side.peers.proven(pull.rank.agent_name)
            self._reads.transport_check(pull.rank.agent_name, pull.timed_bytes, pull.posted_at, pull.posts_before, now)
            if pull.reading_piece:
                self._unpack(incoming, pull)
            pull.step = Step.VERDICT  # only once the bytes are in place
        if pull.verdict is None:
            return
        if pull.verdict:
            raise TransferError(f"ctx side refused: {pull.rank.agent_name}: {pull.verdict}")
        self._by_transfer.pop(pull.transfer_id, None)
        pull.step = Step.CONNECT  # for the next READ, unless that was the last
        if not pull.steps.kv_left:  # the state was read: that was the last READ
            pull.step = Step.DONE
            return
        pull.piece += 1
        if not pull.steps.plan.staged or pull.piece == len(pull.steps.plan.pieces):
            pull.steps.plan, pull.piece = None, 0
            if pull.last_step:
                pull.steps.kv_left = False
                if pull.read.state is None:
                    pull.step = Step.DONE

    def _next(self, incoming: Incoming, pull: Pull, now: float) -> None:
        """Between READs: once the peer is ready (and for layer-wise requests, layers are), begin the next one."""
        if not self._peer_ready(incoming, pull):
            return
        if not pull.steps.started and too_late_to_start(incoming, now):
            raise TransferError(f"{pull.rank.agent_name} was loaded too close to the deadline to start a READ")
        if pull.steps.kv_left and pull.steps.plan is None and not self._next_layers(incoming, pull):
            pull.step = Step.LAYERS
            return
        if now >= pull.steps.retry_at:
            self._begin(incoming, pull)

    def _peer_ready(self, incoming: Incoming, pull: Pull) -> bool:
        """Whether the peer is loaded (its KV list prepared) for the next step; its loading is queued if not, and a
        loading that failed ends the request."""
        if reason := self._side.peers.failure(pull.rank.agent_name, incoming.request.transfer_start):
            raise TransferError(reason)
        direct_kv = pull.read.local_indices is not None and pull.read.expected_readers
        return self._side.peers.ready(pull.rank, (kv_list(pull.read.coarse),) if direct_kv else ())

    def _next_layers(self, incoming: Incoming, pull: Pull) -> bool:
        """Layer-wise: watch the peer, then plan the next group of ready layers; False while none is ready."""
        if not pull.steps.watching:
            pull.steps.started = True
            self._side.peers.connect(pull.rank)
            self._side.control.send(
                pull.rank.agent_name, LayerWatch(*incoming.key, self._side.metadata), incoming.secret
            )
            pull.steps.watching = True
            return False
        upper = min(pull.steps.ready_below, pull.read.layers.stop)
        if upper <= pull.steps.planned_below:
            return False
        step = dataclasses.replace(
            incoming.read_request, layers=range(pull.steps.planned_below, upper), only_peer=pull.read.peer_rank
        )
        (pull.steps.plan,) = self._side.formatter.plan(step)
        pull.steps.planned_below = upper
        return True

    def _begin(self, incoming: Incoming, pull: Pull) -> None:
        """Post the direct READ, claim the next staged piece, or tell an unneeded ctx rank it has no reader."""
        pull.steps.started = True
        if pull.read.expected_readers == 0:
            self._side.peers.connect(pull.rank)
            self._side.control.send(
                pull.rank.agent_name, NoReaders(*incoming.key, self._side.metadata), incoming.secret
            )
            pull.step = Step.DONE
            return
        pull.transfer_id, pull.verdict, pull.steps.grant = next(self._side.transfer_ids), None, None
        if not pull.steps.kv_left:
            state = pull.read.state
            self._side.peers.connect(pull.rank)
            pull.handle = self._reads.to_peer(
                pull.rank,
                self._side.agent.read_ranges,
                pull.rank.agent_name,
                state.local_rows,
                self._side.cache.layout.pools[0].memory,
                state.remote_rows,
                pull.rank.layout.pools[0].memory,
                self._read_done(incoming, pull, final=True),
            )
            long_runs = state.nbytes >= LONG_RUN_BYTES * len(state.local_rows)
            pull.timed_bytes = self._reads.measurable(pull.rank.agent_name, state.nbytes, long_runs)
            pull.posted_at, pull.posts_before = time.monotonic(), self._reads.posts
        elif not pull.steps.plan.staged:
            coarse = pull.steps.plan.coarse
            remote = self._side.peers.descriptors(pull.rank, coarse)
            notification = self._read_done(incoming, pull, final=pull.final_kv_read)
            pull.handle = self._reads.to_peer(
                pull.rank,
                self._side.agent.read,
                self._side.local[coarse],
                pull.steps.plan.local_indices,
                remote,
                pull.steps.plan.remote_indices,
                notification,
            )
            pull.timed_bytes = self._reads.measurable(pull.rank.agent_name, pull.steps.plan.nbytes, coarse)
            pull.posted_at, pull.posts_before = time.monotonic(), self._reads.posts
        else:
            if pull.slot is None:
                try:
                    # no lease: the receiver itself returns the slot (or poisons it) when the piece ends
                    pull.slot = self._side.staging.acquire(incoming.key, float("inf"), 1)
                except BufferExhaustedError:
                    pull.steps.retry_at, pull.step = time.monotonic() + CLAIM_RETRY_S, Step.SLOT
                    return
            self._side.peers.connect(pull.rank)
            box = pull.steps.plan.pieces[pull.piece]
            claim = StageClaim(
                ctx_instance_id=incoming.key[0],
                request_id=incoming.key[1],
                transfer_id=pull.transfer_id,
                reader_metadata=self._side.metadata,
                num_blocks=incoming.num_blocks,
                layers=(box.layers.start, box.layers.stop),
                heads=(box.heads.start, box.heads.stop),
                blocks=(box.blocks.start, box.blocks.stop),
            )
            self._side.control.send(pull.rank.agent_name, claim, incoming.secret)
        pull.step = Step.CLAIM if pull.handle is None else Step.READ
        self._by_transfer[pull.transfer_id] = (incoming, pull)

    def _on_granted(self, incoming: Incoming, pull: Pull, now: float) -> None:
        grant = pull.steps.grant
        if grant is None:
            return
        if not grant.ok:
            if not grant.retry:
                raise TransferError(f"ctx side refused to stage: {pull.rank.agent_name}: {grant.reason}")
            self._by_transfer.pop(pull.transfer_id, None)
            pull.step, pull.steps.retry_at = Step.SLOT, now + CLAIM_RETRY_S
            return
        staging = pull.rank.staging
        if staging is None or not (
            staging.address <= grant.address and grant.address + grant.nbytes <= staging.address + staging.nbytes
        ):
            raise TransferError(f"{pull.rank.agent_name} granted memory outside its staging buffer")
        box_bytes = self._side.formatter.box_bytes(self._side.self_state.cache, pull.steps.plan.pieces[pull.piece])
        if grant.nbytes != box_bytes or grant.nbytes > pull.slot.region.nbytes:
            raise TransferError(
                f"{pull.rank.agent_name} granted {grant.nbytes} bytes for a {box_bytes}-byte box "
                f"(local slot {pull.slot.region.nbytes} bytes)"
            )
        last = pull.final_kv_read and pull.piece == len(pull.steps.plan.pieces) - 1
        notification = self._read_done(incoming, pull, final=last)
        slot = pull.slot.region
        pull.timed_bytes = self._reads.measurable(pull.rank.agent_name, grant.nbytes, True)
        pull.posted_at, pull.posts_before = time.monotonic(), self._reads.posts
        pull.handle = self._reads.to_peer(
            pull.rank,
            self._side.agent.read_ranges,
            pull.rank.agent_name,
            np.array([[slot.address, grant.nbytes, slot.device_id]], dtype=np.uint64),
            slot.memory,
            np.array([[grant.address, grant.nbytes, staging.device_id]], dtype=np.uint64),
            staging.memory,
            notification,
        )
        pull.step = Step.READ

    def _unpack(self, incoming: Incoming, pull: Pull) -> None:
        box = pull.steps.plan.pieces[pull.piece]
        blocks = np.asarray(self._side.cache.block_ids(incoming.request.request_id))
        local = self._side.formatter.localize(
            self._side.self_state.cache, self._side.self_rank, box, incoming.num_blocks, blocks
        )
        self._side.formatter.unpack(self._side.cache.layout, self._side.views, local, pull.slot.array)
        self._side.staging.release(pull.slot)
        pull.slot = None

    def _read_done(self, incoming: Incoming, pull: Pull, final: bool) -> bytes:
        return self._side.read_done(
            incoming.key, incoming.secret, pull.transfer_id, pull.read.expected_readers, final, False
        )

    def on_verdict(self, sender: str, verdict: ReadVerdict) -> None:
        pull = self._owner(sender, verdict)
        if pull is not None:
            pull.verdict = "" if verdict.ok else (verdict.reason or "refused by the ctx side")

    def on_grant(self, sender: str, grant: StageGrant) -> None:
        pull = self._owner(sender, grant)
        if pull is not None and pull.steps.grant is None:  # the first answer to a claim is the answer
            pull.steps.grant = grant

    def on_layers_ready(self, sender: str, message: LayersReady) -> None:
        incoming = self._side.requests.get((message.ctx_instance_id, message.request_id))
        if incoming is None or self._side.control.forged(message, incoming.secret, sender):
            return
        for pull in incoming.pulls:
            if pull.rank.agent_name == sender:
                pull.steps.ready_below = max(pull.steps.ready_below, message.ready_below)

    def _owner(self, sender: str, message: ReadVerdict | StageGrant) -> Pull | None:
        """The pull whose transfer in progress the (proven) answer is about; None (dropped) otherwise."""
        transfer_id = message.transfer_id
        found = self._by_transfer.get(transfer_id)
        if found is None:
            return None  # the request already ended
        incoming, pull = found
        if not (pull.step in IN_TRANSFER and pull.transfer_id == transfer_id):
            log.warning("ignored an answer from %s for transfer %d not in progress", sender, transfer_id)
            return None
        return pull if proven_answer(self._side, incoming, pull, sender, message) else None

    def fail(self, incoming: Incoming, reason: str) -> None:
        """End a request in error (``finish.fail``); its verdicts are no longer awaited."""
        self._forget_transfers(incoming)
        finish.fail(self._side, incoming, reason)

    def _end(self, incoming: Incoming, failure: str | None) -> None:
        self._forget_transfers(incoming)
        finish.end(self._side, incoming, failure)

    def _forget_transfers(self, incoming: Incoming) -> None:
        for pull in incoming.pulls:
            if pull.step in IN_TRANSFER:
                self._by_transfer.pop(pull.transfer_id, None)
