"""Per-request secrets: the proof every control message about a request carries (docs/trust_model.md).

The router that carries a request's params is trusted; no other agent on the fabric is. A ctx instance keeps a
private key (shared by its ranks at start, never sent) and derives each request's secret from it and the request
id, so every rank agrees on it without talking, and can check a message's proof without holding the request (a
late message about a finished request is answered only if it proves the secret). The secret travels only in the
params, to the gen instance, and back in each control message about the request; a message whose proof does not
match is dropped before anything is done for it and counted (``forged_messages``). Agent names are never the
proof: NIXL lets any agent take any name.
"""

from __future__ import annotations

import hashlib
import hmac

SECRET_BYTES = 16  # 128 bits
KEY_BYTES = 32


def request_secret(key: bytes, request_id: int) -> bytes:
    """The request's secret (request ids are unique within a ctx instance's life, as its cache requires)."""
    digest = hashlib.blake2b(key=key, digest_size=SECRET_BYTES, person=b"nixl_kv-secret")
    digest.update(request_id.to_bytes(8, "little"))
    return digest.digest()


def proves(proof: bytes, secret: bytes) -> bool:
    """Whether a message's proof is the request's secret (constant time); no secret known means no proof."""
    return bool(secret) and hmac.compare_digest(proof, secret)
