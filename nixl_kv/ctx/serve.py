"""Serve a request's readers: staged claims (pack a box into a leased staging slot, grant it) and layer watches.

A slot is freed when its reader's READ of it is done (``free_slot``, from count), and poisoned if the request ends
while it is granted (``poison_granted``, from release), for one lease more: ``CacheTransBufferManager.expire_leases``
says why that is safe.
"""

from __future__ import annotations

import logging
import time

from nixl_kv.buffers import CacheTransBufferManager, SlotState, StagingSlot
from nixl_kv.cache import CacheManager
from nixl_kv.ctx.readers import Readers
from nixl_kv.ctx.table import Outgoing, RequestTable
from nixl_kv.errors import BufferExhaustedError, NixlKvError
from nixl_kv.interfaces import Box, Formatter
from nixl_kv.protocol import LayersReady, LayerWatch, StageClaim, StageGrant
from nixl_kv.state import CacheState
from nixl_kv.views import pool_views

log = logging.getLogger(__name__)


class Serve:
    def __init__(
        self,
        instance_id: str,
        rank: int,
        cache_state: CacheState,
        cache: CacheManager,
        formatter: Formatter,
        staging: CacheTransBufferManager,
        table: RequestTable,
        readers: Readers,
        layers: range,
    ) -> None:
        self._instance_id = instance_id
        self._rank = rank
        self._cache_state = cache_state
        self._cache = cache
        self._formatter = formatter
        self._staging = staging
        self._table = table
        self._readers = readers
        self._layers = layers  # the global layers this rank holds
        self._views = pool_views(cache.layout)
        self._granted: dict[tuple[str, int], tuple[int, StagingSlot]] = {}  # (reader, transfer) -> (request, slot)

    # --- claims and grants ------------------------------------------------------------------------------
    def on_stage_claim(self, reader: str, claim: StageClaim) -> None:
        if self._readers.forged(reader, claim) or not self._readers.reachable(reader, claim.reader_metadata):
            return
        if self._table.park(reader, claim, self.on_stage_claim):
            return
        if failure := self._readers.tell(reader, self.grant(reader, claim)):
            log.warning("could not answer the stage claim of %s for request %d: %s", reader, claim.request_id, failure)
            self.free_slot(reader, claim.transfer_id, claim.request_id)

    def grant(self, reader: str, claim: StageClaim) -> StageGrant:
        """The answer (not yet proven) to a proven claim."""

        def refuse(reason: str, retry: bool = False) -> StageGrant:
            return StageGrant(self._instance_id, claim.request_id, claim.transfer_id, False, retry=retry, reason=reason)

        entry = self._table.get(claim.request_id)
        if entry is None:
            return refuse(f"request {claim.request_id} is not pinned here (unknown, finished, cancelled or expired)")
        box = Box(range(*claim.layers), range(*claim.heads), range(*claim.blocks))
        if box.layers.stop > self.ready_below(entry):
            return refuse(f"layers up to {box.layers.stop} are not computed yet", retry=True)
        if (reader, claim.transfer_id) in self._granted:
            return refuse(f"transfer {claim.transfer_id} already holds a granted slot")
        try:
            local = self._formatter.localize(self._cache_state, self._rank, box, entry.num_blocks, entry.block_ids)
            nbytes = self._formatter.box_bytes(self._cache_state, box)
            slot = self._staging.acquire((reader, claim.transfer_id), entry.lease_deadline - time.monotonic(), nbytes)
        except BufferExhaustedError as exc:
            return refuse(str(exc), retry=nbytes <= self._staging.slot_bytes)
        except NixlKvError as exc:
            return refuse(str(exc))
        try:
            self._formatter.pack(self._cache.layout, self._views, local, slot.array)
        except Exception as exc:  # out of memory on the device, say: the reader gets a refusal, the slot comes back
            log.exception("packing request %d for %s failed", claim.request_id, reader)
            self._staging.release(slot)
            return refuse(f"packing failed: {type(exc).__name__}: {exc}")
        self._granted[(reader, claim.transfer_id)] = (claim.request_id, slot)
        return StageGrant(self._instance_id, claim.request_id, claim.transfer_id, True, slot.region.address, nbytes)

    def free_slot(self, reader: str, transfer_id: int, request_id: int) -> None:
        """The reader is done with the slot granted for ``transfer_id`` (its READ ended, or no grant reached it)."""
        found = self._granted.get((reader, transfer_id))
        if found is None or found[0] != request_id:  # a message naming another request never frees this slot
            return
        del self._granted[(reader, transfer_id)]
        _, slot = found
        if slot.state is SlotState.POISONED:  # its request ended while granted; the reader is now done with it
            self._staging.clear_poison(slot)
        else:
            self._staging.release(slot)

    def granted_readers(self) -> set[str]:
        """Readers holding a granted slot (any thread: the table is copied at once)."""
        return {reader for reader, _ in list(self._granted)}

    def poison_granted(self, request_id: int, back_at: float) -> None:
        """The request ended: a slot still granted for it may still be read, so it is not reused before ``back_at``."""
        for (reader, _), (rid, slot) in self._granted.items():
            if rid == request_id and slot.state is SlotState.LEASED:
                self._staging.poison(slot, f"request {rid} ended while its slot was granted to {reader}", back_at)

    # --- layers -----------------------------------------------------------------------------------------
    def on_layer_watch(self, reader: str, message: LayerWatch) -> None:
        if self._readers.forged(reader, message) or not self._readers.reachable(reader, message.reader_metadata):
            return
        if self._table.park(reader, message, self.on_layer_watch):
            return
        with self._table.lock:
            entry = self._table.outgoing.get(message.request_id)
            if entry is None:
                return
            if entry.progress is not None:  # else every layer is ready now: one announcement, nothing to watch
                entry.watchers.add(reader)
                self._table.watched[message.request_id] = entry
        self._announce(entry, [reader])

    def announce_changes(self) -> None:
        """Tell the watchers of layer-wise requests whose ready layers changed (costs the watched requests only)."""
        table = self._table
        with table.lock:
            table.watched = {rid: e for rid, e in table.watched.items() if table.outgoing.get(rid) is e}
            changed = [e for e in table.watched.values() if e.progress.layers_ready != e.announced]
        for entry in changed:
            entry.announced = entry.progress.layers_ready
            self._announce(entry, sorted(entry.watchers))

    def _announce(self, entry: Outgoing, readers: list[str]) -> None:
        ready = LayersReady(self._instance_id, entry.request.request_id, self.ready_below(entry))
        for reader in readers:
            if failure := self._readers.tell(reader, ready):
                log.warning("could not tell %s about ready layers of request %d: %s", reader, ready.request_id, failure)

    def ready_below(self, entry: Outgoing) -> int:
        """Global layers below this are ready (all of them for requests that are not layer-wise)."""
        if entry.progress is None:
            return self._layers.stop
        return self._layers.start + entry.progress.layers_ready
