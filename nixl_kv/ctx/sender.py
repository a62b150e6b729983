"""CacheSender: the ctx side's driver. Pins a request's blocks, serves its readers, releases at the end (DESIGN §5).

One request goes respond -> serve -> count -> release (``nixl_kv.ctx``, docs/reading_path.md): ``respond`` pins the
blocks and makes the params; ``serve`` answers staged claims and layer watches; ``count`` collects each reader's
``ReadDone`` (or a ``NoReaders``) and answers with a verdict where one is needed; ``release`` is the one path that
unpins, when the readers are counted, the request is cancelled, or its lease runs out. This class owns the table
they share and says who advances: the caller's thread responds, the progress loop does the rest.
"""

from __future__ import annotations

from concurrent.futures import Future

from nixl_kv.buffers import CacheTransBufferManager
from nixl_kv.cache import CacheManager
from nixl_kv.control import Control
from nixl_kv.ctx.count import Count
from nixl_kv.ctx.readers import Readers
from nixl_kv.ctx.release import Release
from nixl_kv.ctx.respond import SenderContext, respond
from nixl_kv.ctx.serve import Serve
from nixl_kv.ctx.table import RequestTable
from nixl_kv.interfaces import Formatter
from nixl_kv.loop import ProgressLoop, Tick
from nixl_kv.metrics import TransferMetrics
from nixl_kv.peers import PeerDirectory
from nixl_kv.progress import ContextProgress
from nixl_kv.protocol import LayerWatch, NoReaders, ReadDone, StageClaim
from nixl_kv.requests import TransferRequest
from nixl_kv.topology import layer_range, position

__all__ = ["CacheSender", "SenderContext"]


class CacheSender:
    def __init__(
        self,
        loop: ProgressLoop,
        cache: CacheManager,
        context: SenderContext,
        formatter: Formatter,
        staging: CacheTransBufferManager,
        peers: PeerDirectory,
        metrics: TransferMetrics | None = None,
    ) -> None:
        self._loop = loop
        self._cache = cache
        self._context = context
        self._staging = staging
        metrics = metrics or TransferMetrics(context.instance_id)
        control = Control(loop.agent, metrics, "ctx")
        self._table = RequestTable()
        self._readers = Readers(control, peers, context.instance_id, context.auth_key)
        parallel = context.cache_state.parallel
        layers = layer_range(parallel, position(parallel, context.rank).pp_rank)
        self._serve = Serve(
            context.instance_id,
            context.rank,
            context.cache_state,
            cache,
            formatter,
            staging,
            self._table,
            self._readers,
            layers,
        )
        self._release = Release(cache, context.board, context.lease_ms, self._table, self._serve.poison_granted)
        self._count = Count(
            context.instance_id, self._table, self._readers, self._serve.free_slot, self._release.finish
        )
        loop.on_message(ReadDone, self._count.on_read_done)
        loop.on_message(StageClaim, self._serve.on_stage_claim)
        loop.on_message(NoReaders, self._count.on_no_readers)
        loop.on_message(LayerWatch, self._serve.on_layer_watch)
        loop.add_ticker(self._tick)

    def send_async(
        self,
        request: TransferRequest,
        block_ids_per_cp: tuple[tuple[int, ...], ...],
        progress: ContextProgress | None = None,
    ) -> Future:
        """Pin the request's blocks and serve them; the future ends when its readers are done or the lease ends.

        With ``progress`` the request is layer-wise: readers learn which layers are ready and read them as
        they become so, while prefill goes on."""
        future = respond(self._context, self._cache, self._table, request, block_ids_per_cp, progress)
        return future

    def cancel(self, request_id: int) -> bool:
        """Stop serving a request: its blocks are released and late readers are refused."""
        entry = self._table.take(request_id)
        if entry is None:
            return False
        self._loop.call(lambda: self._release.finish(entry, f"request {request_id} was cancelled on the ctx side"))
        return True

    def cancel_all(self) -> None:
        with self._table.lock:
            request_ids = list(self._table.outgoing)
        for request_id in request_ids:
            self.cancel(request_id)

    @property
    def pending(self) -> int:
        with self._table.lock:
            return len(self._table.outgoing)

    def busy_readers(self) -> set[str]:
        """Readers this rank still owes answers (layer watchers of requests it serves, holders of granted slots): the
        peer directory keeps them loaded."""
        return self._table.watchers() | self._serve.granted_readers()

    def release_deferred(self, everything: bool = False) -> None:
        """Unpin the requests whose promise has run out (``everything``: all, at close: see ``Release``)."""
        self._release.release_deferred(everything)

    def _tick(self, now: float) -> Tick:
        """Costs what changed, not what is outstanding: leases come off a heap, announcements from the
        layer-wise requests someone watches. Busy (iterate again at once) only while messages wait to be replayed
        or prefill goes on under watchers; requests that only wait for their readers' ReadDone are not."""
        self._release.expire(now)
        self._serve.announce_changes()
        # a slot whose lease ran out while granted is poisoned, and comes back one lease later (expire_leases)
        self._staging.expire_leases(now, self._context.lease_ms / 1000)
        self._table.replay_parked(now)
        self._release.release_deferred()
        if self._table.parked or self._table.watched:
            return Tick.BUSY
        return Tick.WAITING if self._table.outgoing else Tick.IDLE  # (held blocks alone: polled at a cadence)
