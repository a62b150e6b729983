"""Per-request secrets: the proof every control message about a request carries (docs/trust_model.md).

The router that carries a request's params is trusted; no other agent on the fabric is. A ctx instance keeps a
private key (shared by its ranks at start, never sent), and derives each request's secret from it and what every
rank of the instance knows about the request (its id, token count and block ids per CP rank), so all ranks
agree on it without talking. The secret travels only in the params, to the gen instance, and back in each
control message about the request; a message whose proof does not match is dropped and counted
(``forged_messages``). Agent names are never the proof: NIXL lets any agent take any name.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import numpy as np

SECRET_BYTES = 16  # 128 bits
KEY_BYTES = 32


def request_secret(key: bytes, request_id: int, num_tokens: int, block_ids_per_cp: Sequence[Sequence[int]]) -> bytes:
    """The request's secret, the same on every ctx rank of the instance (each has the CP-gathered block ids)."""
    digest = hashlib.blake2b(key=key, digest_size=SECRET_BYTES, person=b"nixl_kv-secret")
    digest.update(np.array([request_id, num_tokens, len(block_ids_per_cp)], dtype=np.int64).tobytes())
    for ids in block_ids_per_cp:
        digest.update(np.array([len(ids)], dtype=np.int64).tobytes())
        digest.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
    return digest.digest()


def proves(proof: bytes, secret: bytes) -> bool:
    """Whether a message's proof is the request's secret (constant time); no secret known means no proof."""
    return bool(secret) and hmac.compare_digest(proof, secret)
