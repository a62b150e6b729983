"""What the ctx and gen servers share: one rank's pools and transceiver, and the loop that drives every rank.

Rank 0 owns the model and the HTTP side; handlers ``submit`` jobs. Its engine thread takes the jobs that queued
up, ``plan``s one step per rank (model work happens here, on rank 0 only), sends the steps (``Lockstep``), and
every rank ``apply``s its step: the same transceiver calls in the same order, as its collectives need. Rank 0
then ``finish``es: it resolves the jobs' futures. Between steps it does its own ``local_work`` (decoding).
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from nixl_kv.comm import CacheTransceiverComm
from nixl_kv.config import CacheTransceiverConfig
from nixl_kv.layout import LayoutKind
from nixl_kv.serving.checkpoints import load_model
from nixl_kv.serving.lockstep import Lockstep
from nixl_kv.serving.model_cache import build_pools, probe_geometry
from nixl_kv.transceiver import CacheTransceiver

log = logging.getLogger(__name__)

BUSY_WAIT_S = 0.001  # how long the engine waits for new jobs while transfers are in flight or tokens to decode
IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class InstanceOptions:
    """One server instance: its model, its parallelism and its pools (every rank the same)."""

    model_dir: str
    dtype: str = "float32"
    tp: int = 1
    layout: str = LayoutKind.BLOCK_MAJOR.value
    tokens_per_block: int = 16
    num_blocks: int = 512
    num_slots: int = 64  # Mamba state slots (requests held at once), for hybrid models
    transfer_timeout_ms: int = 10_000  # the gen side fails a transfer that has not ended by then
    lease_ms: int = 60_000  # the ctx side keeps a request's blocks this long for its readers, then frees them
    max_prompt_tokens: int = 1024
    step_timeout_s: float = 60.0  # the most a request waits on the engine for one step (a prefill, a token)


class EngineStopped(RuntimeError):
    """The engine is not running (stopped, or its loop failed): the server answers 503."""


class Engine(ABC):
    """One rank of a server instance; ``start`` on rank 0, ``follow`` on the others."""

    def __init__(self, options: InstanceOptions, comm: CacheTransceiverComm) -> None:
        self.options = options
        self.lockstep = Lockstep(comm)
        self.model = load_model(options.model_dir, options.dtype) if self.lockstep.is_lead else None
        self.geometry = comm.bcast(probe_geometry(self.model) if self.model is not None else None)
        self.state = self.geometry.cache_state(options.tp, options.tokens_per_block)
        self.pools = build_pools(
            self.state, comm.rank, LayoutKind(options.layout), options.num_blocks, options.num_slots, self.geometry
        )
        config = CacheTransceiverConfig.from_env(
            CacheTransceiverConfig(
                kv_transfer_timeout_ms=options.transfer_timeout_ms,
                enable_inflight_cancel=True,
                lease_ms=options.lease_ms,
            )
        )
        self.transceiver = CacheTransceiver(self.pools, self.state, config, comm)
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    # --- rank 0 -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._lead, name=f"{type(self).__name__}", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def submit(self, job: Any) -> None:
        if not self.healthy:
            raise EngineStopped(f"the engine is not running ({self.failure or 'stopped'})")
        self._jobs.put(job)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _lead(self) -> None:
        try:
            while not self._stopping.is_set():
                jobs = self._take_jobs()
                if jobs or self.in_flight():
                    self.finish(self.apply(self.lockstep.send(self.plan(jobs))))
                self.local_work()
        except BaseException as exc:  # every waiting job learns of it; health turns 503
            log.exception("the engine loop failed")
            self.failure = exc
        finally:
            self.lockstep.send([None] * self.lockstep.size)
            self._fail_pending(self.failure or EngineStopped("the server is stopping"))
            self.transceiver.close()

    def _take_jobs(self) -> list[Any]:
        busy = self.in_flight() or self.has_local_work()
        try:
            jobs = [self._jobs.get(timeout=BUSY_WAIT_S if busy else IDLE_WAIT_S)]
        except queue.Empty:
            return []
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                return jobs

    def _fail_pending(self, error: BaseException) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            fail_future(job.future, error)
        self.fail_all(error)

    # --- the other ranks ----------------------------------------------------------------------------------------
    def follow(self) -> None:
        """Apply rank 0's steps until it says stop."""
        try:
            while (step := self.lockstep.receive()) is not None:
                self.apply(step)
        finally:
            self.transceiver.close()

    # --- what each server defines -------------------------------------------------------------------------------
    @abstractmethod
    def plan(self, jobs: list[Any]) -> list[Any]:
        """Rank 0: one step per rank for these new jobs (and what is in flight)."""

    @abstractmethod
    def apply(self, step: Any) -> Any:
        """Every rank: carry out its step; on rank 0 the result goes to ``finish``."""

    @abstractmethod
    def finish(self, outcome: Any) -> None: ...

    @abstractmethod
    def in_flight(self) -> bool:
        """Whether a step is needed even without new jobs (transfers to poll)."""

    def has_local_work(self) -> bool:
        return False

    def local_work(self) -> None:  # noqa: B027 - only the gen side decodes between steps
        """Rank 0's own work between steps."""

    def fail_all(self, error: BaseException) -> None:  # noqa: B027 - a server with jobs past submit fails them here
        """Fail every job the engine took and did not finish (it is stopping)."""


def fail_future(future: Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
