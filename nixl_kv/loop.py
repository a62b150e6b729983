"""The progress loop: the one thread that talks to the transfer agent.

NIXL agents are used without internal locking, so every agent call runs here. The loop runs submitted
calls, polls notifications and hands each to the handler of its message type, and ticks the sender and
receiver so they can check transfers and deadlines. Each ticker says what it has pending (``Tick``):
BUSY, pass again after ``busy_sleep_s``; WAITING, messages from peers are expected; IDLE, nothing outstanding.
Otherwise the loop waits on its command queue: IDLE_WAIT_S when idle; while waiting, briefly after a pass that
brought messages (an exchange, such as staged claims, goes on), then twice as long after each pass that brought
none, up to IDLE_WAIT_S. A side that only waits for its peers (a ctx holding blocks until each reader's ReadDone)
thus polls at a cadence instead of spinning: control messages are not latency-critical, the gen side proves its
holds on its own, and every wake-up costs CPU (60-260 us on a virtual machine). Polling also advances our UCX
workers (NIXL runs no progress thread for us): a new peer's connection set-up, and READs over transports that
need the target's progress (TCP), go at this cadence.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from nixl_kv import wire
from nixl_kv.errors import NixlKvError, WireFormatError
from nixl_kv.interfaces import TransferAgent

log = logging.getLogger(__name__)

PR_SET_TIMERSLACK = 29
BUSY_SLEEP_S = 50e-6
IDLE_WAIT_S = 2e-3  # the longest a pass waits: deadlines, leases, peers' messages and UCX's progress go this often


class Tick(enum.IntEnum):
    """What a ticker has pending, so how soon the loop should pass again (the loop takes the most urgent)."""

    IDLE = 0
    WAITING = 1
    BUSY = 2


def _nothing() -> None:
    return None


def set_timer_slack_ns(slack_ns: int) -> None:
    """Set the calling thread's timer slack (Linux prctl PR_SET_TIMERSLACK); elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(slack_ns), 0, 0, 0)
    except (OSError, AttributeError):
        pass


class ProgressLoop:
    def __init__(
        self, agent: TransferAgent, busy_sleep_s: float = BUSY_SLEEP_S, name: str = "nixl_kv-progress"
    ) -> None:
        self.agent = agent
        self._busy_sleep_s = busy_sleep_s
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._handlers: dict[type, Callable[[str, Any], None]] = {}
        self._tickers: list[Callable[[float], Tick]] = []
        self._stopping = threading.Event()
        self.passes = 0  # passes made, ever (``nixl-kv pair`` reports them per request: CPU a load cannot blur)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def on_message(self, message_type: type, handler: Callable[[str, Any], None]) -> None:
        """Call ``handler(sender, message)`` for every notification that decodes as ``message_type``."""
        self._handlers[message_type] = handler

    def add_ticker(self, tick: Callable[[float], Tick]) -> None:
        """``tick(now)`` runs every pass; it returns what it has pending (``Tick``)."""
        self._tickers.append(tick)

    def submit(self, function: Callable[[], Any]) -> Future:
        future: Future = Future()
        if self._stopping.is_set():
            future.set_exception(NixlKvError("the transceiver is closed"))
            return future
        self._commands.put((function, future))
        return future

    def wake(self) -> None:
        """New work was registered from another thread: end an idle wait now rather than after IDLE_WAIT_S."""
        self._commands.put((_nothing, Future()))

    def call(self, function: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        """Run ``function`` on the loop thread and return its result (within ``timeout_s``)."""
        if threading.current_thread() is self._thread:
            return function()
        return self.submit(function).result(timeout=timeout_s)

    @property
    def stopped(self) -> bool:
        """The loop thread has ended (nothing runs on it any more)."""
        return not self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        self.wake()  # (out of an idle wait at once)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.error("progress loop did not stop within %.1f s", timeout_s)

    def _run(self) -> None:
        set_timer_slack_ns(1000)  # a 50 us sleep would otherwise last over 100 us (the kernel's default slack)
        wait_s = IDLE_WAIT_S
        while not self._stopping.is_set():
            try:
                pending, active = self._iterate()
            except Exception:  # a bug must not kill the only thread that makes progress
                log.exception("progress loop iteration failed")
                pending, active = Tick.WAITING, False
            if pending is Tick.BUSY:
                wait_s = self._busy_sleep_s
                if wait_s > 0:
                    time.sleep(wait_s)
                else:
                    time.sleep(0)  # spin, but let other threads of this process have the GIL
                continue
            if pending is Tick.IDLE:
                wait_s = IDLE_WAIT_S
            elif active:  # an exchange goes on: its next message comes soon
                wait_s = max(self._busy_sleep_s, 1e-6)
            else:
                wait_s = min(IDLE_WAIT_S, 2 * wait_s)
            try:
                function, future = self._commands.get(timeout=wait_s)
            except queue.Empty:
                continue
            self._execute(function, future)
        self._drain_on_stop()

    def _iterate(self) -> tuple[Tick, bool]:
        """One pass; returns (the most urgent ticker's ``Tick``, whether commands ran or notifications came)."""
        self.passes += 1
        ran = False
        while True:
            try:
                function, future = self._commands.get_nowait()
            except queue.Empty:
                break
            self._execute(function, future)
            ran = True
        notes = self.agent.poll_notifications()
        for sender, data in notes:
            self._dispatch(sender, data)
        now = time.monotonic()
        pending = Tick.IDLE
        for tick in self._tickers:
            pending = max(pending, tick(now))
        return Tick(pending), ran or bool(notes)

    def _dispatch(self, sender: str, data: bytes) -> None:
        try:
            message = wire.decode_one_of(data, tuple(self._handlers))
        except WireFormatError as exc:
            log.warning("dropped a malformed notification from %s: %s", sender, exc)
            return
        try:
            self._handlers[type(message)](sender, message)
        except Exception:  # one bad message must not cost the others in the batch
            log.exception("handling %s from %s failed", type(message).__name__, sender)

    @staticmethod
    def _execute(function: Callable[[], Any], future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function())
        except BaseException as exc:
            future.set_exception(exc)

    def _drain_on_stop(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(NixlKvError("the transceiver is closed"))
