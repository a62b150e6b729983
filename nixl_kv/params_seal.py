"""The params' seal: a checksum over their encoded bytes, so params damaged on the way are refused before any READ.

``ContextPhaseParams.checksum`` is the last field the encoder writes, and its value always has the top bit set,
so it is always the message's last 9 bytes: msgpack's uint64 marker and 8 big-endian bytes. The ctx side encodes
the params with a placeholder there and writes over it a 63-bit keyless BLAKE2b of everything before it; the gen
side recomputes that over the bytes it received before decoding them. It catches damage, not forgery: the router
that carries the params is trusted (docs/trust_model.md). The seal and its check are compiled
(``nixl_kv._fastpath``: BLAKE2b over the caller's buffer, no copy; the same digest as ``hashlib.blake2b`` with
``digest_size=8, person=b"nixl_kv-params"``).

``prompt_digest`` binds params to their prompt: the ctx side puts the digest of the prompt's token ids in the
params, and the gen side compares it with the prompt it is asked to decode, so KV made for one prompt is never
decoded (or kept for prefix reuse) under another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from nixl_kv import wire
from nixl_kv.state import ContextPhaseParams

_fastpath = wire._fastpath  # the compiled module (wire says how to build it where it is missing)

TOP_BIT = 1 << 63
PLACEHOLDER = TOP_BIT  # what the encoder writes first: 0xcf + 8 bytes
PROMPT_DIGEST_BYTES = 16

_digest = _fastpath.params_digest  # the seal of a body (the encoded params less their last 8 bytes)
# ``seal(encoded)``: encoded params that end in a uint64 (the checksum, or its placeholder), that uint64 set to the
# checksum; ValueError when they do not end in one. ``is_sealed(data)``: whether ``data`` ends in the checksum of
# everything before it; False for any value that is not a C-contiguous buffer of bytes (a str, None, a memoryview
# of ints...) or is longer than MAX_PARAMS_BYTES, both refused in O(1) time before any byte is read, so a caller's
# mistake costs nothing (params of 14 MiB once took 3-4 s and 600 MB to refuse). ``params_problem(data)``: what is
# wrong with them, completing "the params ..." ("" when nothing): the error a gen request ends with.
seal = _fastpath.seal
is_sealed = _fastpath.is_sealed
params_problem = _fastpath.params_problem
MAX_PARAMS_BYTES = _fastpath.MAX_PARAMS_BYTES  # real ones: 1.5 KB (one rank) to ~100s of KB (many ranks, long prompts)


def encode_params(params: ContextPhaseParams) -> bytes:
    """The params' wire bytes, sealed: what ``TransferRequest.context_phase_params`` carries."""
    return seal(wire.encode_with_last(params, PLACEHOLDER))  # checksum, the last field, set to the placeholder


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """A 128-bit BLAKE2b of the token ids (each as 8 little-endian bytes, so no two lists share an encoding; ids
    outside int64 raise OverflowError: check them against the vocabulary first)."""
    import numpy as np  # not at import time: nixl_kv's imports stay cheap

    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=PROMPT_DIGEST_BYTES, person=b"nixl_kv-prompt").digest()
