"""The gen agents (readers) a ctx rank answers: their messages checked, their answers proven, their metadata loaded.

A reader is loaded from the metadata its (proven) message carries, in the rank's one peer directory
(``PeerDirectory.reachable``), and forgotten like any other agent there (idle, or beyond its bound), or when an
answer cannot reach it: every message a reader sends carries its metadata again. Nothing is loaded for a message that
does not prove its request's secret, and nothing answered: one malformed metadata blob aborts the whole process inside
UCX (an address-version assertion, found by scripts/fuzz.sh).
"""

from __future__ import annotations

from typing import Any

from nixl_kv.auth import request_secret
from nixl_kv.control import Control
from nixl_kv.peers import PeerDirectory


class Readers:
    def __init__(self, control: Control, peers: PeerDirectory, instance_id: str, auth_key: bytes) -> None:
        self._control = control
        self._peers = peers
        self._instance_id = instance_id
        self._auth_key = auth_key

    def secret(self, request_id: int) -> bytes:
        return request_secret(self._auth_key, request_id)

    def forged(self, reader: str, message: Any) -> bool:
        """A message that does not prove its request's secret (or names another instance): counted, to be dropped
        before anything else is done for it."""
        ours = message.ctx_instance_id == self._instance_id
        return self._control.forged(message, self.secret(message.request_id) if ours else b"", reader)

    def reachable(self, reader: str, metadata: bytes) -> bool:
        """Load the reader (a NIXL agent can only notify agents whose metadata it loaded); False if unusable."""
        return self._peers.reachable(reader, metadata)

    def tell(self, reader: str, answer: Any) -> str:
        """Answer a reader, proven under the request's secret; "" or why it failed. A failed send forgets the reader
        (its connection may have broken, as the transport ends one to a host that stopped answering)."""
        failure = self._control.tell(reader, answer, self.secret(answer.request_id))
        if failure:
            self._peers.forget(reader)
        return failure
