"""Deterministic KV content from global coordinates (DESIGN §7).

Every element gets a 64-bit hash of (request, layer, kv, head, token, dim), truncated to the element width.
A receiver that knows which global layers, heads and tokens it holds can check every element it received,
whatever the layouts on either side; misplaced or unwritten bytes never match by accident.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from nixl_kv.rnn import RnnShare, conv_sections
from nixl_kv.state import RnnConfig

_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# Odd constants that spread each coordinate over all 64 bits before mixing.
_SPREAD = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD)


@dataclass(frozen=True)
class Slice:
    """Which global coordinates a rank holds: layers, heads and tokens as [start, start + count)."""

    layer_start: int
    num_layers: int
    head_start: int
    num_heads: int
    kv_factor: int
    head_dim: int
    token_start: int
    num_tokens: int


ROWS_PER_PASS = 1 << 21  # rows (elements without the head dim) hashed at once: bounds the uint64 temporaries


def expected(request_seed: int, where: Slice, itemsize: int, xp: ModuleType = np) -> Any:
    """Elements of ``where`` as ``[layer, kv, head, token, dim]`` unsigned integers of ``itemsize`` bytes."""
    out = xp.empty(
        (where.num_layers, where.kv_factor, where.num_heads, where.num_tokens, where.head_dim),
        dtype=np.dtype(f"u{itemsize}"),
    )
    # As many layers a pass as the bound allows: each array operation may release the GIL, and under a busy
    # thread (``--busy-thread``) every release costs a switch interval, so a small request fills in a few passes.
    step = max(1, ROWS_PER_PASS // max(1, where.kv_factor * where.num_heads * where.num_tokens))
    for first in range(0, where.num_layers, step):
        _fill_layers(out[first : first + step], request_seed, where.layer_start + first, where, xp)
    return out


def _fill_layers(out: Any, request_seed: int, first_layer: int, where: Slice, xp: ModuleType) -> None:
    """Consecutive layers: ``a ^ (b * (2 * dim + 1))`` in the element width, with (a, b) a strong hash of the row.

    ``b`` is odd, so within a row distinct dims (below half the width's range) always differ; two rows agree
    only if both of their hash halves agree. Two full-size passes, whatever the element width.
    """
    u64 = np.uint64
    seed = u64(request_seed * 0x2545F4914F6CDD1D % (1 << 64))
    layer = xp.arange(first_layer, first_layer + out.shape[0], dtype=u64).reshape(-1, 1, 1, 1) * u64(_SPREAD[0])
    kv = xp.arange(where.kv_factor, dtype=u64).reshape(1, -1, 1, 1) * u64(_SPREAD[1])
    head = xp.arange(where.head_start, where.head_start + where.num_heads, dtype=u64).reshape(1, 1, -1, 1)
    token = xp.arange(where.token_start, where.token_start + where.num_tokens, dtype=u64).reshape(1, 1, 1, -1)
    rows = _mix(kv + head * u64(_SPREAD[2]) + token * u64(_SPREAD[3]) + (layer + seed))  # sums wrap at 2**64
    narrow = out.dtype  # truncating to the element width keeps the low bytes
    low = rows.astype(narrow)[..., None]
    odd = ((rows >> u64(32)) | u64(1)).astype(narrow)[..., None]
    dims = (xp.arange(where.head_dim, dtype=u64) * u64(2) + u64(1)).astype(narrow)
    xp.multiply(odd, dims, out=out)
    xp.bitwise_xor(out, low, out=out)


def _mix(x: Any) -> Any:
    """splitmix64's finaliser: every input bit affects every output bit."""
    u64 = np.uint64
    x = x ^ (x >> u64(30))
    x = x * u64(_MIX1)
    x = x ^ (x >> u64(27))
    x = x * u64(_MIX2)
    return x ^ (x >> u64(31))


def count_mismatches(actual: Any, request_seed: int, where: Slice, xp: ModuleType = np) -> int:
    """Elements of ``actual`` (``[layer, kv, head, token, dim]``) that differ from the expected fill."""
    want = expected(request_seed, where, actual.dtype.itemsize, xp)
    return int((actual != want).sum())


# Seeds of the state beside the KV: the same request never fills two kinds of state alike.
INDEXER_SALT, CONV_SALT, SSM_SALT = 1 << 40, 2 << 40, 3 << 40


def indexer_expected(request_seed: int, layers: range, tokens: range, bytes_per_token: int, xp: ModuleType = np) -> Any:
    """The indexer-K cache of ``layers`` and ``tokens`` as ``[layer, token, bytes]`` uint8."""
    where = Slice(layers.start, len(layers), 0, 1, 1, bytes_per_token, tokens.start, len(tokens))
    return expected(request_seed ^ INDEXER_SALT, where, 1, xp)[:, 0, 0]


def rnn_expected(request_seed: int, held: RnnShare, config: RnnConfig, xp: ModuleType = np) -> tuple[Any, Any]:
    """A rank's Mamba state: conv ``[layer, channels, d_conv - 1]`` (each channel hashed by its global index in
    the conv state, section offsets included) and SSM ``[layer, heads, head_dim, d_state]``."""
    layers, sections = held.layers, conv_sections(config)
    conv = [
        expected(
            request_seed ^ CONV_SALT,
            Slice(layers.start, len(layers), sum(sections[:i]) + part.start, len(part), 1, config.d_conv - 1, 0, 1),
            config.conv_dtype.itemsize,
            xp,
        )[:, 0, :, 0]
        for i, part in enumerate(held.channels)
    ]
    ssm_where = Slice(
        layers.start, len(layers), held.heads.start, len(held.heads), 1, config.d_state, 0, config.head_dim
    )
    ssm = expected(request_seed ^ SSM_SALT, ssm_where, config.ssm_dtype.itemsize, xp)[:, 0]
    return xp.concatenate(conv, axis=1), ssm
