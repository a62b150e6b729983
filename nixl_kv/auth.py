"""Per-request secrets and the proofs that control messages carry (docs/trust_model.md).

The router that carries a request's params is trusted; no other agent on the fabric is. A ctx instance keeps a
private key (shared by its ranks at start, never sent) and derives each request's secret from it and the request
id, so every rank agrees on it without talking, and can check a message's proof without holding the request (a
late message about a finished request is answered only if it proves the secret). The secret travels only in the
params, to the gen instance. A control message carries a proof instead: a MAC, under the secret, of the sender's
agent name and every other field of the message. So an agent that observes the fabric learns no secret, cannot
change a field of a message it saw, and cannot count as another reader by replaying one under its own name. A
message whose proof does not match is dropped before anything is done for it and counted (``forged_messages``).
Agent names are never the proof: NIXL lets any agent take any name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Any, TypeVar

from nixl_kv import wire

SECRET_BYTES = 16  # 128 bits
PROOF_BYTES = 16
KEY_BYTES = 32

Message = TypeVar("Message")


def request_secret(key: bytes, request_id: int) -> bytes:
    """The request's secret (request ids are unique within a ctx instance's life, as its cache requires)."""
    digest = hashlib.blake2b(key=key, digest_size=SECRET_BYTES, person=b"nixl_kv-secret")
    digest.update(request_id.to_bytes(8, "little"))
    return digest.digest()


def prove(message: Message, secret: bytes, sender: str) -> Message:
    """``message`` (a protocol dataclass with a ``proof`` field) with its proof, as agent ``sender`` sends it."""
    return dataclasses.replace(message, proof=_mac(message, secret, sender))  # type: ignore[type-var]


def proves(message: Any, secret: bytes, sender: str) -> bool:
    """Whether a message that arrived from agent ``sender`` proves the request's secret (constant time); no
    secret known means no proof."""
    return bool(secret) and hmac.compare_digest(message.proof, _mac(message, secret, sender))


def _mac(message: Any, secret: bytes, sender: str) -> bytes:
    digest = hashlib.blake2b(key=secret, digest_size=PROOF_BYTES, person=b"nixl_kv-proof")
    digest.update(sender.encode("utf-8", "surrogatepass"))
    digest.update(b"\0")
    digest.update(wire.encode(message, omit="proof"))
    return digest.digest()
