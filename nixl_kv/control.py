"""Control messages, both sides: every message sent proves its request's secret, every one received is checked.

Sending is: connect (a NIXL agent can only notify an agent whose metadata it loaded), prove (``nixl_kv.auth``),
encode (``nixl_kv.wire``), notify. Receiving is: verify the proof before anything is done for the message, and
count the ones that fail (``forged_messages``). Both sides do it here, so that no path sends an unproven message
or acts on an unchecked one.
"""

from __future__ import annotations

import logging
from typing import Any

from nixl_kv import wire
from nixl_kv.auth import prove, proves
from nixl_kv.errors import AgentError
from nixl_kv.interfaces import TransferAgent
from nixl_kv.metrics import TransferMetrics

log = logging.getLogger(__name__)


class Control:
    """One side's (``side``: "gen" or "ctx") sending and checking of control messages, through ``agent``."""

    def __init__(self, agent: TransferAgent, metrics: TransferMetrics, side: str) -> None:
        self._agent = agent
        self._metrics = metrics
        self._side = side

    @property
    def name(self) -> str:
        return self._agent.name

    def encode(self, message: Any, secret: bytes) -> bytes:
        """The message proven as this agent sends it, encoded (also a notification a READ carries)."""
        return wire.encode(prove(message, secret, self._agent.name))

    def send(self, peer: str, message: Any, secret: bytes) -> None:
        """Prove, encode and notify a loaded peer; raises AgentError."""
        self._agent.notify(peer, self.encode(message, secret))

    def tell(self, peer: str, message: Any, secret: bytes) -> str:
        """``send``, best effort: "" or why it failed."""
        try:
            self.send(peer, message, secret)
        except AgentError as exc:
            return str(exc)
        return ""

    def forged(self, message: Any, secret: bytes, sender: str) -> bool:
        """Whether a message from agent ``sender`` fails to prove ``secret`` (b"": none known, so no proof): such a
        message is counted and must be dropped before anything is done for it (an agent may take any name, so the
        name is no proof)."""
        if proves(message, secret, sender):
            return False
        self._metrics.add(self._side, forged_messages=1)
        kind = type(message).__name__
        log.debug("dropped a %s for request %s from %s: wrong proof", kind, message.request_id, sender)
        return True
