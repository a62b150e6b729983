"""The decode side's pulls, owned by one thread.

vLLM's engine thread only hands work over (``submit``, ``cancel``) and collects typed results (``take``): posting a
READ (UCX may move the bytes inside the post: 16 ms for 32 MiB here) and polling the transfers never run on it, so
they cost vLLM's steps nothing. With tensor parallelism a status check is a collective that every rank must make in
the same order, so there the engine thread pumps instead, once per step, in lockstep with the other ranks.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from nixl_kv.requests import RequestState, TransferRequest
from nixl_kv.transceiver import CacheTransceiver
from nixl_kv.vllm.blocks import VllmBlocks
from nixl_kv.vllm.metadata import Receive

log = logging.getLogger(__name__)

POLL_S = 0.0005  # how long the owner thread waits between polls while pulls are in flight (new work wakes it)
IDLE_S = 0.05
JOIN_S = 5.0


@dataclass(frozen=True)
class Pulled:
    """A pull that ended and can land nothing more in its blocks: they are vLLM's again."""

    vllm_id: str
    ok: bool
    moved_blocks: tuple[int, ...]  # the blocks it wrote (load errors when it failed)
    seconds: float
    nbytes: int
    error: str | None = None
    receive: Receive | None = None  # what the scheduler asked for


@dataclass
class _Pull:
    receive: Receive
    request: TransferRequest
    ended: bool = False


class Puller:
    def __init__(self, transceiver: CacheTransceiver, blocks: VllmBlocks, threaded: bool) -> None:
        self._transceiver, self._blocks = transceiver, blocks
        self._commands: queue.SimpleQueue[tuple[str, Receive | str]] = queue.SimpleQueue()
        self._results: list[Pulled] = []
        self._lock = threading.Lock()
        self._wake, self._stopping = threading.Event(), threading.Event()
        self._pulls: dict[int, _Pull] = {}  # the pumping thread's own
        self._ours: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="nixl_kv-puller", daemon=True)
            self._thread.start()

    def submit(self, receive: Receive) -> None:
        self._commands.put(("pull", receive))
        self._wake.set()

    def cancel(self, vllm_id: str) -> None:
        self._commands.put(("cancel", vllm_id))
        self._wake.set()

    def take(self) -> list[Pulled]:
        if self._thread is None:
            self.pump()
        with self._lock:
            results, self._results = self._results, []
        return results

    def close(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(JOIN_S)

    # --- the pumping thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.pump()
            except Exception:  # a bug must not end the thread silently: every pull would then wait forever
                log.exception("nixl_kv: the puller failed a round")
            self._wake.wait(POLL_S if self._pulls else IDLE_S)
            self._wake.clear()

    def pump(self) -> None:
        """One round: start what was submitted, cancel what was asked, and report pulls that are over."""
        while True:
            try:
                command, item = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "pull":
                self._start(item)
            elif item in self._ours:
                self._transceiver.cancel_request(self._pulls[self._ours[item]].request)
        statuses = self._transceiver.check_gen_transfer_status(0)
        for ours in statuses.completed_request_ids | statuses.error_request_ids:
            if ours in self._pulls:
                self._pulls[ours].ended = True
        for ours, pull in list(self._pulls.items()):
            if pull.ended and not self._blocks.pinned(ours):  # a READ that may still land keeps the blocks
                self._finish(ours, pull)

    def _start(self, receive: Receive) -> None:
        request = TransferRequest(
            receive.request_id, context_phase_params=receive.params, reused_blocks=receive.reused_blocks
        )
        pull = self._pulls[receive.request_id] = _Pull(receive, request)
        self._ours[receive.vllm_id] = receive.request_id
        try:
            self._blocks.register(receive.request_id, receive.block_ids, receive.slot)
            self._transceiver.request_and_receive_async(request)
        except Exception as exc:  # refused before any READ (undecodable params, incompatible pair)
            request.fail(f"{type(exc).__name__}: {exc}")
            pull.ended = True

    def _finish(self, ours: int, pull: _Pull) -> None:
        del self._pulls[ours]
        del self._ours[pull.receive.vllm_id]
        self._blocks.forget(ours)
        request, receive = pull.request, pull.receive
        ok = request.state is RequestState.GENERATION_TRANS_COMPLETE
        result = Pulled(
            receive.vllm_id,
            ok,
            receive.block_ids[receive.reused_blocks :],
            request.transfer_end - request.transfer_start if ok else 0.0,
            request.transfer_bytes if ok else 0,
            None if ok else request.error,
            receive,
        )
        with self._lock:
            self._results.append(result)
