"""The gen agents (readers) a ctx rank answers: loaded from the metadata their messages carry, forgotten when idle.

Every message a reader sends carries its metadata, so forgetting one is safe at any time: its next message loads it
again. Nothing is loaded for a message that does not prove its request's secret, and nothing answered: one
malformed metadata blob aborts the whole process inside UCX (an address-version assertion, found by
scripts/fuzz.sh).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from nixl_kv.auth import request_secret
from nixl_kv.control import Control
from nixl_kv.errors import AgentError
from nixl_kv.interfaces import TransferAgent
from nixl_kv.peers import PEER_IDLE_S, PEER_SWEEP_S

log = logging.getLogger(__name__)

MAX_KNOWN_READERS = 1024  # gen agents whose metadata stays loaded; the oldest is forgotten beyond this


class Readers:
    """Check what readers send, answer them (``tell``), keep the ones in use loaded (loop thread only)."""

    def __init__(self, agent: TransferAgent, control: Control, instance_id: str, auth_key: bytes) -> None:
        self._agent = agent
        self._control = control
        self._instance_id = instance_id
        self._auth_key = auth_key
        self._known: OrderedDict[str, float] = OrderedDict()  # loaded reader agents -> last use, LRU first
        self._swept_at = 0.0

    def secret(self, request_id: int) -> bytes:
        return request_secret(self._auth_key, request_id)

    def forged(self, reader: str, message: Any) -> bool:
        """A message that does not prove its request's secret (or names another instance): counted, to be dropped
        before anything else is done for it."""
        ours = message.ctx_instance_id == self._instance_id
        return self._control.forged(message, self.secret(message.request_id) if ours else b"", reader)

    def reachable(self, reader: str, metadata: bytes) -> bool:
        """Load the reader (a NIXL agent can only notify agents whose metadata it loaded); False if unusable."""
        if reader in self._known:
            self._known[reader] = time.monotonic()
            self._known.move_to_end(reader)
            return True
        try:
            self._agent.load_remote(metadata, reader)
        except AgentError as exc:
            log.warning("reader %s sent unusable metadata: %s", reader, exc)
            return False
        self._known[reader] = time.monotonic()
        while len(self._known) > MAX_KNOWN_READERS:
            self._forget(next(iter(self._known)))
        return True

    def tell(self, reader: str, answer: Any) -> str:
        """Answer a reader, proven under the request's secret; "" or why it failed. A failed send forgets the reader
        (its connection may have broken, as the transport ends one to a host that stopped answering)."""
        failure = self._control.tell(reader, answer, self.secret(answer.request_id))
        if failure and reader in self._known:
            self._forget(reader)
        return failure

    def forget_idle(self, now: float) -> None:
        """Readers not heard from for PEER_IDLE_S (dead or departed gen instances) are unloaded, once a second."""
        if now - self._swept_at < PEER_SWEEP_S:
            return
        self._swept_at = now
        while self._known and now - next(iter(self._known.values())) > PEER_IDLE_S:
            self._forget(next(iter(self._known)))

    def _forget(self, reader: str) -> None:
        del self._known[reader]
        try:
            self._agent.forget_remote(reader)
        except AgentError as exc:
            log.info("could not forget reader %s: %s", reader, exc)
