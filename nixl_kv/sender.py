"""CacheSender: the ctx side. Pins a request's blocks, serves its readers, releases at the end (DESIGN §5).

A request is done when every expected reader reported its final READ finished (``ReadDone``); each report
gets a ``ReadVerdict`` that is ok only while the blocks are still pinned. When the lease runs out first, the
blocks are released and the request fails; a reader that reports later gets a refusal, never a false ok.
Staged readers claim boxes (``StageClaim``): the box is packed into a leased staging slot and granted; the
slot is freed when the reader's READ of it is done, and poisoned if the request ends while it is granted (for one
lease more: ``CacheTransBufferManager.expire_leases`` says why that is safe).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from nixl_kv.auth import request_secret
from nixl_kv.buffers import CacheTransBufferManager, SlotState, StagingSlot
from nixl_kv.cache import CacheManager
from nixl_kv.control import Control
from nixl_kv.errors import AgentError, BufferExhaustedError, NixlKvError, TransferError
from nixl_kv.holds import HoldBoard, hold_token, promise_mask
from nixl_kv.interfaces import Box, Formatter
from nixl_kv.loop import ProgressLoop
from nixl_kv.metrics import TransferMetrics
from nixl_kv.params import ParamsMaker
from nixl_kv.peers import PEER_IDLE_S, PEER_SWEEP_S
from nixl_kv.progress import ContextProgress
from nixl_kv.protocol import LayersReady, LayerWatch, NoReaders, ReadDone, ReadVerdict, StageClaim, StageGrant
from nixl_kv.requests import TransferRequest
from nixl_kv.state import CacheState
from nixl_kv.topology import layer_range, position
from nixl_kv.views import pool_views

log = logging.getLogger(__name__)
Answer = TypeVar("Answer", ReadVerdict, StageGrant, LayersReady)

MAX_KNOWN_READERS = 1024  # gen agents whose metadata stays loaded; the oldest is forgotten beyond this
EARLY_GRACE_S = 1.0  # a claim, watch or NoReaders for a request this rank has not registered yet waits this long
MAX_PARKED = 4096  # requests with early messages waiting; beyond it the oldest are dropped
MAX_PARKED_PER_REQUEST = 256  # early messages kept for one request (a reader sends a few); later ones are dropped
MAX_FINISHED = 4096  # recently finished requests, whose late messages are refused at once rather than parked


@dataclass
class _Outgoing:
    request: TransferRequest
    block_ids: np.ndarray
    num_blocks: int
    lease_deadline: float
    future: Future
    expected_readers: int | None = None
    finished_readers: dict[str, str] = field(default_factory=dict)  # reader -> failure, "" when ok
    progress: ContextProgress | None = None  # layer-wise requests: per-layer readiness
    watchers: set[str] = field(default_factory=set)  # readers told about layer readiness
    announced: int = -1  # the last ready_below sent to the watchers
    token: int = 0  # its hold token (nixl_kv.holds), 0 without a board
    posted: bool = False  # the token is on the board (else its readers ask for verdicts: its window was full)
    promised_until_ns: int = 0  # its blocks are not released before this (CLOCK_MONOTONIC), whatever happens
    masked_promise: int = 0  # the promise as posted on the board and carried in the params
    secret: bytes = b""  # the request's secret (nixl_kv.auth): the proof its readers' messages must carry


@dataclass(frozen=True)
class SenderContext:
    """Who the sender is: its instance, its rank, its cache and how long it keeps blocks for readers."""

    instance_id: str
    rank: int
    cache_state: CacheState
    serialized_state: bytes
    lease_ms: int
    auth_key: bytes  # the instance's private key for request secrets (nixl_kv.auth): never leaves the instance
    hold_key: bytes = b""
    board: HoldBoard | None = None
    hold_promise_ms: int = 0

    def params_maker(self) -> ParamsMaker:
        return ParamsMaker(
            self.serialized_state, self.lease_ms, self.cache_state.parallel.dp_rank, self.rank, self.auth_key
        )


class CacheSender:
    def __init__(
        self,
        loop: ProgressLoop,
        cache: CacheManager,
        context: SenderContext,
        formatter: Formatter,
        staging: CacheTransBufferManager,
        metrics: TransferMetrics | None = None,
    ) -> None:
        self._loop = loop
        self._cache = cache
        self._context = context
        self._metrics = metrics or TransferMetrics(context.instance_id)
        self._formatter = formatter
        self._staging = staging
        self._views = pool_views(cache.layout)
        self._control = Control(loop.agent, self._metrics, "ctx")
        self._lock = threading.Lock()
        self._outgoing: dict[int, _Outgoing] = {}
        self._granted: dict[tuple[str, int], tuple[int, StagingSlot]] = {}  # (reader, transfer) -> (request, slot)
        self._known_readers: OrderedDict[str, float] = OrderedDict()  # loaded reader agents -> last use, LRU first
        self._readers_swept_at = 0.0
        # messages that arrived before this rank registered their request (ranks respond at slightly different
        # times); READ completions are never parked: a READ before registration may have read unfinished KV
        self._parked: OrderedDict[int, list[tuple[float, str, Any, Callable[[str, Any], None]]]] = OrderedDict()
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._leases: list[tuple[float, int, int, _Outgoing]] = []  # (deadline, order, request id, entry): a heap
        self._lease_order = itertools.count()
        self._watched: dict[int, _Outgoing] = {}  # layer-wise requests with watchers
        self._deferred: list[tuple[int, int]] = []  # (promised until ns, request id): unpins kept to a promise
        loop.on_message(ReadDone, self._on_read_done)
        loop.on_message(StageClaim, self._on_stage_claim)
        loop.on_message(NoReaders, self._on_no_readers)
        loop.on_message(LayerWatch, self._on_layer_watch)
        self._layers = layer_range(
            context.cache_state.parallel, position(context.cache_state.parallel, context.rank).pp_rank
        )
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
        future: Future = Future()
        state = self._context.cache_state
        rnn_slot = self._cache.rnn_slot(request.request_id) if state.rnn is not None else None  # before pinning
        blocks = np.asarray(self._cache.pin(request.request_id), dtype=np.int64)
        request.transfer_start = time.monotonic()
        request.transfer_bytes = _held_bytes(self._cache, len(blocks))
        num_blocks = -(-request.num_tokens // self._context.cache_state.model.tokens_per_block)
        deadline = request.transfer_start + self._context.lease_ms / 1000
        request.transfer_deadline = deadline
        entry = _Outgoing(request, blocks, num_blocks, deadline, future, progress=progress)
        maker = self._context.params_maker()
        entry.secret = maker.secret(request.request_id)
        with self._lock:  # the hold is posted before any thread can see (and so finish) the entry
            if request.request_id in self._outgoing:
                self._cache.unpin(request.request_id)
                raise ValueError(f"request {request.request_id} is already being sent")
            self._post_hold(entry, rnn_slot)
            self._outgoing[request.request_id] = entry
            heapq.heappush(self._leases, (deadline, next(self._lease_order), request.request_id, entry))
        request.context_phase_params = maker.make(
            request.request_id,
            block_ids_per_cp,
            request.num_tokens,
            request.first_gen_tokens,
            request.draft_tokens,
            layerwise=progress is not None,
            rnn_slot=rnn_slot,
            masked_promise=entry.masked_promise if entry.posted and progress is None else 0,
            prompt_digest=request.prompt_digest,
        )
        self._loop.wake()  # poll for its readers at once, not after an idle wait
        return future

    def _post_hold(self, entry: _Outgoing, rnn_slot: int | None) -> None:
        """Show the hold on the board before the params leave this rank: readers check their READs on it."""
        board = self._context.board
        if board is None:
            return
        request, key = entry.request, self._context.hold_key
        entry.token = hold_token(key, request.request_id, request.num_tokens, entry.block_ids, rnn_slot)
        promise_ms = min(self._context.hold_promise_ms, self._context.lease_ms)
        entry.promised_until_ns = time.monotonic_ns() + promise_ms * 1_000_000 if promise_ms else 0
        entry.masked_promise = entry.promised_until_ns ^ promise_mask(key, entry.token)
        entry.posted = board.post(entry.token, entry.masked_promise)

    def cancel(self, request_id: int) -> bool:
        """Stop serving a request: its blocks are released and late readers are refused."""
        with self._lock:
            entry = self._outgoing.pop(request_id, None)
        if entry is None:
            return False
        self._loop.call(lambda: self._finish(entry, f"request {request_id} was cancelled on the ctx side"))
        return True

    def cancel_all(self) -> None:
        with self._lock:
            request_ids = list(self._outgoing)
        for request_id in request_ids:
            self.cancel(request_id)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._outgoing)

    # --- progress loop side ---------------------------------------------------------------------------
    def _forged(self, reader: str, message: Any) -> bool:
        """A message that does not prove it knows its request's secret (or names another instance): dropped and
        counted before anything else is done for it. Nothing is loaded for it and nothing answered: one malformed
        metadata blob aborts the whole process inside UCX (an address-version assertion, found by scripts/fuzz.sh)."""
        ours = message.ctx_instance_id == self._context.instance_id
        return self._control.forged(message, self._secret(message.request_id) if ours else b"", reader)

    def _secret(self, request_id: int) -> bytes:
        return request_secret(self._context.auth_key, request_id)

    def _parked_early(self, reader: str, message: Any, handler: Callable[[str, Any], None]) -> bool:
        """Park a (proven) message for a request this rank has not registered yet."""
        if message.request_id in self._finished:
            return False
        with self._lock:
            if message.request_id in self._outgoing:
                return False
        waiting = self._parked.setdefault(message.request_id, [])
        if len(waiting) >= MAX_PARKED_PER_REQUEST:  # only a peer holding the secret gets here: bounded all the same
            log.debug("dropped an early %s for request %d from %s", type(message).__name__, message.request_id, reader)
            return True
        waiting.append((time.monotonic(), reader, message, handler))
        while len(self._parked) > MAX_PARKED:
            self._drop_parked(*self._parked.popitem(last=False))
        return True

    def _replay_parked(self, now: float) -> None:
        with self._lock:
            ready = [rid for rid in self._parked if rid in self._outgoing]
        for rid in ready:
            for _, reader, message, handler in self._parked.pop(rid):
                handler(reader, message)
        stale = [rid for rid, waiting in self._parked.items() if now - waiting[0][0] > EARLY_GRACE_S]
        for rid in stale:
            self._drop_parked(rid, self._parked.pop(rid))

    def _drop_parked(self, request_id: int, waiting: list) -> None:
        """The request never showed up here: claims are refused, other messages dropped."""
        self._finished[request_id] = None
        for _, reader, message, handler in waiting:
            if isinstance(message, StageClaim):
                handler(reader, message)  # now refused: the request counts as finished

    def _on_stage_claim(self, reader: str, claim: StageClaim) -> None:
        if self._forged(reader, claim) or not self._reachable(reader, claim.reader_metadata):
            return
        if self._parked_early(reader, claim, self._on_stage_claim):
            return
        if failure := self._tell(reader, self._grant(reader, claim)):
            log.warning("could not answer the stage claim of %s for request %d: %s", reader, claim.request_id, failure)
            self._free_slot(reader, claim.transfer_id, claim.request_id)

    def _grant(self, reader: str, claim: StageClaim) -> StageGrant:
        """The answer (not yet proven) to a proven claim (``_forged``)."""

        def refuse(reason: str, retry: bool = False) -> StageGrant:
            return StageGrant(
                self._context.instance_id, claim.request_id, claim.transfer_id, False, retry=retry, reason=reason
            )

        with self._lock:
            entry = self._outgoing.get(claim.request_id)
        if entry is None:
            return refuse(f"request {claim.request_id} is not pinned here (unknown, finished, cancelled or expired)")
        box = Box(range(*claim.layers), range(*claim.heads), range(*claim.blocks))
        if box.layers.stop > self._ready_below(entry):
            return refuse(f"layers up to {box.layers.stop} are not computed yet", retry=True)
        if (reader, claim.transfer_id) in self._granted:
            return refuse(f"transfer {claim.transfer_id} already holds a granted slot")
        try:
            local = self._formatter.localize(
                self._context.cache_state, self._context.rank, box, entry.num_blocks, entry.block_ids
            )
            nbytes = self._formatter.box_bytes(self._context.cache_state, box)
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
        return StageGrant(
            self._context.instance_id, claim.request_id, claim.transfer_id, True, slot.region.address, nbytes
        )

    def _on_layer_watch(self, reader: str, message: LayerWatch) -> None:
        if self._forged(reader, message) or not self._reachable(reader, message.reader_metadata):
            return
        if self._parked_early(reader, message, self._on_layer_watch):
            return
        with self._lock:
            entry = self._outgoing.get(message.request_id)
            if entry is None:
                return
            if entry.progress is not None:  # else every layer is ready now: one announcement, nothing to watch
                entry.watchers.add(reader)
                self._watched[message.request_id] = entry
        self._announce(entry, [reader])

    def _announce(self, entry: _Outgoing, readers: list[str]) -> None:
        ready = LayersReady(self._context.instance_id, entry.request.request_id, self._ready_below(entry))
        for reader in readers:
            if failure := self._tell(reader, ready):
                log.warning("could not tell %s about ready layers of request %d: %s", reader, ready.request_id, failure)

    def _ready_below(self, entry: _Outgoing) -> int:
        """Global layers below this are ready (all of them for requests that are not layer-wise)."""
        if entry.progress is None:
            return self._layers.stop
        return self._layers.start + entry.progress.layers_ready

    def _on_no_readers(self, reader: str, message: NoReaders) -> None:
        """Nothing is answered, so the reader's metadata is not loaded."""
        if self._forged(reader, message):
            return
        if self._parked_early(reader, message, self._on_no_readers):
            return
        with self._lock:
            entry = self._outgoing.get(message.request_id)
            if entry is None or entry.finished_readers:
                return
            del self._outgoing[message.request_id]
        log.debug("request %d: %s says no gen rank reads this rank's part", message.request_id, reader)
        self._finish(entry, None)

    def _on_read_done(self, reader: str, message: ReadDone) -> None:
        if self._forged(reader, message) or not self._reachable(reader, message.reader_metadata):
            return
        self._free_slot(reader, message.transfer_id, message.request_id)
        with self._lock:
            entry = self._outgoing.get(message.request_id)
        ours = entry is not None
        wrong = ours and bool(message.hold_token) and message.hold_token != entry.token
        mismatch = f"the reader's hold token does not match what request {message.request_id} pinned here" * wrong
        refusal = self._record(reader, message, mismatch)
        if ours and message.checks_hold and entry.posted and not wrong and not message.failed:
            return  # the reader saw the hold on the board after its READ: it needs no verdict
        verdict = ReadVerdict(self._context.instance_id, message.request_id, message.transfer_id, not refusal, refusal)
        if failure := self._tell(reader, verdict):
            log.warning("could not answer reader %s of request %d: %s", reader, message.request_id, failure)

    def _tell(self, reader: str, answer: Answer) -> str:
        """Answer a reader, proven under the request's secret; "" or why it failed. A failed send forgets the reader
        (its connection may have broken, as the transport ends one to a host that stopped answering): the next
        message it sends carries its metadata, and loads it again."""
        failure = self._control.tell(reader, answer, self._secret(answer.request_id))
        if failure and reader in self._known_readers:
            self._forget_reader(reader)
        return failure

    def _free_slot(self, reader: str, transfer_id: int, request_id: int) -> None:
        found = self._granted.get((reader, transfer_id))
        if found is None or found[0] != request_id:  # a message naming another request never frees this slot
            return
        del self._granted[(reader, transfer_id)]
        _, slot = found
        if slot.state is SlotState.POISONED:  # its request ended while granted; the reader is now done with it
            self._staging.clear_poison(slot)
        else:
            self._staging.release(slot)

    def _record(self, reader: str, message: ReadDone, refusal: str = "") -> str:
        """Record one reader's report (``refusal``: a reason to fail it however it reports); returns "" for ok or
        the reason of refusal."""
        failure = refusal or ((message.reason or "the reader's READ failed") if message.failed else "")
        with self._lock:
            entry = self._outgoing.get(message.request_id)
            if entry is None:
                return f"request {message.request_id} is not pinned here (unknown, finished, cancelled or expired)"
            if not (message.final or message.failed):
                return ""
            if entry.expected_readers is None:
                entry.expected_readers = message.expected_readers
            entry.finished_readers[reader] = failure
            finished = len(entry.finished_readers) >= entry.expected_readers
            if finished:
                del self._outgoing[message.request_id]
        if finished:
            failures = [f"{name}: {why}" for name, why in entry.finished_readers.items() if why]
            self._finish(entry, "; ".join(failures) if failures else None)
        return failure

    def _reachable(self, reader: str, metadata: bytes) -> bool:
        """A NIXL agent can only notify agents whose metadata it loaded."""
        if reader in self._known_readers:
            self._known_readers[reader] = time.monotonic()
            self._known_readers.move_to_end(reader)
            return True
        try:
            self._loop.agent.load_remote(metadata, reader)
        except AgentError as exc:
            log.warning("reader %s sent unusable metadata: %s", reader, exc)
            return False
        self._known_readers[reader] = time.monotonic()
        while len(self._known_readers) > MAX_KNOWN_READERS:
            self._forget_reader(next(iter(self._known_readers)))
        return True

    def _forget_reader(self, reader: str) -> None:
        """Unload a reader's metadata: safe at any time, every message a reader sends carries it again."""
        del self._known_readers[reader]
        try:
            self._loop.agent.forget_remote(reader)
        except AgentError as exc:
            log.info("could not forget reader %s: %s", reader, exc)

    def _forget_idle_readers(self, now: float) -> None:
        """Readers not heard from for PEER_IDLE_S (dead or departed gen instances) are unloaded, once a second."""
        if now - self._readers_swept_at < PEER_SWEEP_S:
            return
        self._readers_swept_at = now
        while self._known_readers and now - next(iter(self._known_readers.values())) > PEER_IDLE_S:
            self._forget_reader(next(iter(self._known_readers)))

    def _tick(self, now: float) -> bool:
        """Costs what changed, not what is outstanding: leases come off a heap, announcements from the
        layer-wise requests someone watches."""
        entries = []
        with self._lock:
            while self._leases and self._leases[0][0] <= now:
                _, _, rid, entry = heapq.heappop(self._leases)
                if self._outgoing.get(rid) is entry:
                    entries.append(self._outgoing.pop(rid))
            busy = bool(self._outgoing)
            self._watched = {rid: e for rid, e in self._watched.items() if self._outgoing.get(rid) is e}
            layerwise = [e for e in self._watched.values() if e.progress.layers_ready != e.announced]
        for entry in layerwise:
            entry.announced = entry.progress.layers_ready
            self._announce(entry, sorted(entry.watchers))
        for entry in entries:
            self._finish(
                entry,
                f"lease of {self._context.lease_ms} ms expired with {len(entry.finished_readers)} of "
                f"{entry.expected_readers or '?'} readers done",
            )
        # a slot whose lease ran out while granted is poisoned, and comes back one lease later (expire_leases)
        self._staging.expire_leases(now, self._context.lease_ms / 1000)
        self._replay_parked(now)
        self.release_deferred()
        self._forget_idle_readers(now)
        return busy or bool(self._parked)

    def release_deferred(self, everything: bool = False) -> None:
        """Unpin the requests whose promise has run out (``everything``: all of them, at close, once no READ
        can reach this rank any more)."""
        now_ns = time.monotonic_ns()
        while self._deferred and (everything or self._deferred[0][0] <= now_ns):
            _, rid = heapq.heappop(self._deferred)
            self._cache.unpin(rid)

    def _finish(self, entry: _Outgoing, failure: str | None) -> None:
        """End a request: poison slots a reader may still read, unpin its blocks, resolve its future."""
        rid = entry.request.request_id
        self._finished[rid] = None
        while len(self._finished) > MAX_FINISHED:
            self._finished.popitem(last=False)
        back_at = time.monotonic() + self._context.lease_ms / 1000  # (a READ from it then is of a refused request)
        for (reader, _), (request_id, slot) in self._granted.items():
            if request_id == rid and slot.state is SlotState.LEASED:
                self._staging.poison(slot, f"request {rid} ended while its slot was granted to {reader}", back_at)
        entry.request.transfer_end = time.monotonic()
        if entry.posted:
            self._context.board.clear(entry.token)  # before the blocks can be reused
        if entry.posted and entry.promised_until_ns > time.monotonic_ns():  # a reader may rely on it: keep it
            heapq.heappush(self._deferred, (entry.promised_until_ns, rid))
        else:
            self._cache.unpin(rid)
        if failure is None:
            entry.future.set_result(None)
        else:
            entry.future.set_exception(TransferError(failure))


def _held_bytes(cache: CacheManager, num_blocks: int) -> int:
    """What a request holds on this rank: its KV blocks, their indexer-K part, its Mamba state slot."""
    held = num_blocks * cache.layout.block_bytes
    indexer = getattr(cache, "indexer_layout", None)
    rnn = getattr(cache, "rnn_layout", None)
    if indexer is not None:
        held += num_blocks * indexer.block_bytes
    if rnn is not None:
        held += rnn.num_layers * (rnn.conv_slot_bytes + rnn.ssm_slot_bytes)
    return held
