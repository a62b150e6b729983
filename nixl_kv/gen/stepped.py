"""The stepped pulls (``nixl_kv.gen.pull.SteppedPull``): advanced step by step by the progress loop.

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
from nixl_kv.gen.pull import SteppedPull, Transfer
from nixl_kv.gen.reads import LONG_RUN_BYTES, Reads, too_late_to_start
from nixl_kv.gen.side import GenSide, Incoming
from nixl_kv.interfaces import TransferStatus
from nixl_kv.peers import kv_list
from nixl_kv.protocol import LayersReady, LayerWatch, NoReaders, ReadVerdict, StageClaim, StageGrant

log = logging.getLogger(__name__)

CLAIM_RETRY_S = 1e-3


class SteppedPulls:
    def __init__(self, side: GenSide, reads: Reads) -> None:
        self._side = side
        self._reads = reads
        self._by_transfer: dict[int, tuple[Incoming, SteppedPull]] = {}

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
        for peer in incoming.peers:
            if not peer.done:
                self._advance_peer(incoming, peer, now)
                if incoming.future.done():
                    return
        if all(peer.done for peer in incoming.peers):
            self._end(incoming, None)
        elif now > incoming.deadline:
            waiting = [f"{p.rank.agent_name} ({self._peer_step(p)})" for p in incoming.peers if not p.done]
            self.fail(incoming, f"deadline passed waiting for {', '.join(waiting)}")

    @staticmethod
    def _peer_step(peer: SteppedPull) -> str:
        current = peer.current
        if current is None:
            return f"waiting for layers from {peer.planned_below}" if peer.layerwise else "not started"
        if peer.reading_piece and current.grant is None:
            return "waiting for a stage grant"
        return "READ in flight" if not current.finished else "waiting for the ctx confirmation"

    def _advance_peer(self, incoming: Incoming, peer: SteppedPull, now: float) -> None:
        current = peer.current
        if current is None:
            if not self._stepped_peer_ready(incoming, peer):
                return
            if not peer.started and too_late_to_start(incoming, now):
                raise TransferError(f"{peer.rank.agent_name} was loaded too close to the deadline to start a READ")
            if peer.kv_left and peer.plan is None and not self._next_step(incoming, peer):
                return
            if now >= peer.retry_at:
                self._begin(incoming, peer)
            return
        if peer.reading_piece and current.handle is None and not current.finished:
            self._on_granted(incoming, peer, current, now)
            return
        if not current.finished:
            status = self._side.agent.status(current.handle)
            if status is TransferStatus.FAILED:
                self._side.stuck.close_when_free({peer.rank.agent_name})  # (its connection may be broken)
                raise TransferError(f"READ from {peer.rank.agent_name} failed")
            if status is TransferStatus.IN_PROGRESS:
                return
            self._side.agent.release_transfer(current.handle)
            current.handle = None
            self._side.peers.proven(peer.rank.agent_name)
            self._reads.transport_check(
                peer.rank.agent_name, current.nbytes, current.posted_at, current.posts_before, now
            )
            if peer.reading_piece:
                self._unpack(incoming, peer)
            current.finished = True  # only once the bytes are in place
        if current.verdict is None:
            return
        if current.verdict:
            raise TransferError(f"ctx side refused: {peer.rank.agent_name}: {current.verdict}")
        self._by_transfer.pop(current.transfer_id, None)
        peer.current = None
        if not peer.kv_left:  # the state was read: that was the last READ
            peer.done = True
            return
        peer.next_piece += 1
        if not peer.plan.staged or peer.next_piece == len(peer.plan.pieces):
            peer.plan, peer.next_piece = None, 0
            if peer.last_step:
                peer.kv_left = False
                peer.done = peer.full.state is None

    def _stepped_peer_ready(self, incoming: Incoming, peer: SteppedPull) -> bool:
        """Whether the peer is loaded (its KV list prepared) for the next step; its loading is queued if not, and a
        loading that failed ends the request."""
        if reason := self._side.peers.failure(peer.rank.agent_name, incoming.request.transfer_start):
            raise TransferError(reason)
        direct_kv = peer.full.local_indices is not None and peer.full.expected_readers
        return self._side.peers.ready(peer.rank, (kv_list(peer.full.coarse),) if direct_kv else ())

    def _next_step(self, incoming: Incoming, peer: SteppedPull) -> bool:
        """Layer-wise: watch the peer, then plan the next group of ready layers; False while none is ready."""
        if not peer.watching:
            peer.started = True
            self._side.peers.connect(peer.rank)
            self._side.control.send(
                peer.rank.agent_name, LayerWatch(*incoming.key, self._side.metadata), incoming.secret
            )
            peer.watching = True
            return False
        upper = min(peer.ready_below, peer.full.layers.stop)
        if upper <= peer.planned_below:
            return False
        step = dataclasses.replace(
            incoming.read_request, layers=range(peer.planned_below, upper), only_peer=peer.full.peer_rank
        )
        (peer.plan,) = self._side.formatter.plan(step)
        peer.planned_below = upper
        return True

    def _begin(self, incoming: Incoming, peer: SteppedPull) -> None:
        """Post the direct READ, claim the next staged piece, or tell an unneeded ctx rank it has no reader."""
        peer.started = True
        if peer.full.expected_readers == 0:
            self._side.peers.connect(peer.rank)
            self._side.control.send(
                peer.rank.agent_name, NoReaders(*incoming.key, self._side.metadata), incoming.secret
            )
            peer.done = True
            return
        transfer = Transfer(next(self._side.transfer_ids))
        if not peer.kv_left:
            state = peer.full.state
            self._side.peers.connect(peer.rank)
            transfer.handle = self._reads.to_peer(
                peer.rank,
                self._side.agent.read_ranges,
                peer.rank.agent_name,
                state.local_rows,
                self._side.cache.layout.pools[0].memory,
                state.remote_rows,
                peer.rank.layout.pools[0].memory,
                self._read_done(incoming, peer, transfer, final=True),
            )
            long_runs = state.nbytes >= LONG_RUN_BYTES * len(state.local_rows)
            transfer.nbytes = self._reads.measurable(peer.rank.agent_name, state.nbytes, long_runs)
            transfer.posted_at, transfer.posts_before = time.monotonic(), self._reads.posts
        elif not peer.plan.staged:
            coarse = peer.plan.coarse
            remote = self._side.peers.descriptors(peer.rank, coarse)
            notification = self._read_done(incoming, peer, transfer, final=peer.final_kv_read)
            transfer.handle = self._reads.to_peer(
                peer.rank,
                self._side.agent.read,
                self._side.local[coarse],
                peer.plan.local_indices,
                remote,
                peer.plan.remote_indices,
                notification,
            )
            transfer.nbytes = self._reads.measurable(peer.rank.agent_name, peer.plan.nbytes, coarse)
            transfer.posted_at, transfer.posts_before = time.monotonic(), self._reads.posts
        else:
            if peer.slot is None:
                try:
                    # no lease: the receiver itself returns the slot (or poisons it) when the piece ends
                    peer.slot = self._side.staging.acquire(incoming.key, float("inf"), 1)
                except BufferExhaustedError:
                    peer.retry_at = time.monotonic() + CLAIM_RETRY_S
                    return
            self._side.peers.connect(peer.rank)
            box = peer.plan.pieces[peer.next_piece]
            claim = StageClaim(
                ctx_instance_id=incoming.key[0],
                request_id=incoming.key[1],
                transfer_id=transfer.transfer_id,
                reader_metadata=self._side.metadata,
                num_blocks=incoming.num_blocks,
                layers=(box.layers.start, box.layers.stop),
                heads=(box.heads.start, box.heads.stop),
                blocks=(box.blocks.start, box.blocks.stop),
            )
            self._side.control.send(peer.rank.agent_name, claim, incoming.secret)
        peer.current = transfer
        self._by_transfer[transfer.transfer_id] = (incoming, peer)

    def _on_granted(self, incoming: Incoming, peer: SteppedPull, current: Transfer, now: float) -> None:
        grant = current.grant
        if grant is None:
            return
        if not grant.ok:
            if not grant.retry:
                raise TransferError(f"ctx side refused to stage: {peer.rank.agent_name}: {grant.reason}")
            self._by_transfer.pop(current.transfer_id, None)
            peer.current, peer.retry_at = None, now + CLAIM_RETRY_S
            return
        staging = peer.rank.staging
        if staging is None or not (
            staging.address <= grant.address and grant.address + grant.nbytes <= staging.address + staging.nbytes
        ):
            raise TransferError(f"{peer.rank.agent_name} granted memory outside its staging buffer")
        box_bytes = self._side.formatter.box_bytes(self._side.self_state.cache, peer.plan.pieces[peer.next_piece])
        if grant.nbytes != box_bytes or grant.nbytes > peer.slot.region.nbytes:
            raise TransferError(
                f"{peer.rank.agent_name} granted {grant.nbytes} bytes for a {box_bytes}-byte box "
                f"(local slot {peer.slot.region.nbytes} bytes)"
            )
        last = peer.final_kv_read and peer.next_piece == len(peer.plan.pieces) - 1
        notification = self._read_done(incoming, peer, current, final=last)
        slot = peer.slot.region
        current.nbytes = self._reads.measurable(peer.rank.agent_name, grant.nbytes, True)
        current.posted_at, current.posts_before = time.monotonic(), self._reads.posts
        current.handle = self._reads.to_peer(
            peer.rank,
            self._side.agent.read_ranges,
            peer.rank.agent_name,
            np.array([[slot.address, grant.nbytes, slot.device_id]], dtype=np.uint64),
            slot.memory,
            np.array([[grant.address, grant.nbytes, staging.device_id]], dtype=np.uint64),
            staging.memory,
            notification,
        )

    def _unpack(self, incoming: Incoming, peer: SteppedPull) -> None:
        box = peer.plan.pieces[peer.next_piece]
        blocks = np.asarray(self._side.cache.block_ids(incoming.request.request_id))
        local = self._side.formatter.localize(
            self._side.self_state.cache, self._side.self_rank, box, incoming.num_blocks, blocks
        )
        self._side.formatter.unpack(self._side.cache.layout, self._side.views, local, peer.slot.array)
        self._side.staging.release(peer.slot)
        peer.slot = None

    def _read_done(self, incoming: Incoming, peer: SteppedPull, transfer: Transfer, final: bool) -> bytes:
        return self._side.read_done(
            incoming.key, incoming.secret, transfer.transfer_id, peer.full.expected_readers, final, False
        )

    def on_verdict(self, sender: str, verdict: ReadVerdict) -> None:
        transfer = self._owned_transfer(sender, verdict)
        if transfer is not None:
            transfer.verdict = "" if verdict.ok else (verdict.reason or "refused by the ctx side")

    def on_grant(self, sender: str, grant: StageGrant) -> None:
        transfer = self._owned_transfer(sender, grant)
        if transfer is not None and transfer.grant is None:  # the first answer to a claim is the answer
            transfer.grant = grant

    def on_layers_ready(self, sender: str, message: LayersReady) -> None:
        incoming = self._side.requests.get((message.ctx_instance_id, message.request_id))
        if incoming is None or self._side.control.forged(message, incoming.secret, sender):
            return
        for peer in incoming.peers:
            if peer.rank.agent_name == sender:
                peer.ready_below = max(peer.ready_below, message.ready_below)

    def _owned_transfer(self, sender: str, message: ReadVerdict | StageGrant) -> Transfer | None:
        transfer_id, request_id = message.transfer_id, message.request_id
        found = self._by_transfer.get(transfer_id)
        if found is None:
            return None  # the request already ended
        incoming, peer = found
        if sender != peer.rank.agent_name or request_id != incoming.key[1] or peer.current is None:
            log.warning("ignored an answer from %s for transfer %d it does not own", sender, transfer_id)
            return None
        if self._side.control.forged(message, incoming.secret, sender):
            return None
        return peer.current

    def fail(self, incoming: Incoming, reason: str) -> None:
        """End a request in error: abandon READs still in flight and tell the ctx peers not to wait."""
        for peer in incoming.peers:
            current = peer.current
            if current is not None and current.handle is not None:
                finish.abandon(self._side, incoming, current.handle, peer.slot, None, reason, peer.rank.agent_name)
                current.handle, peer.slot = None, None  # the slot was released, or poisoned with the READ
            if peer.slot is not None:
                self._side.staging.release(peer.slot)
                peer.slot = None
            if not peer.done and peer.full.expected_readers:
                transfer_id = current.transfer_id if current is not None else 0
                finish.tell_ctx_failed(self._side, incoming, peer.rank, transfer_id, peer.full.expected_readers, reason)
        self._end(incoming, reason)

    def _end(self, incoming: Incoming, failure: str | None) -> None:
        for peer in incoming.peers:
            if peer.current is not None:
                self._by_transfer.pop(peer.current.transfer_id, None)
        finish.end(self._side, incoming, failure)
