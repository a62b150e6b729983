"""Descriptor rows as flat entries, shared by the agents that post one request per entry (Mooncake, UCX).

``what`` is the whole failure prefix (``"UCX could not prepare descriptors of local memory"``): every helper raises
AgentError naming it, so an agent's callers see one exception type whatever the rows held.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nixl_kv.errors import AgentError


def table(descriptors: np.ndarray, width: tuple[int, ...], what: str) -> np.ndarray:
    """The rows as a uint64 matrix of one of the ``width`` column counts."""
    try:
        rows = np.asarray(descriptors, dtype=np.uint64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise AgentError(f"{what}: {type(exc).__name__}: {exc}") from exc
    if rows.ndim != 2 or rows.shape[1] not in width:
        raise AgentError(f"{what}: rows of shape {rows.shape}, expected Nx{'/'.join(map(str, width))}")
    return rows


def expand(descriptors: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nx3 (address, length, device) or strided Nx5 (.., stride, count) rows as one entry per unit:
    (addresses, lengths, the row of each entry)."""
    rows = table(descriptors, (3, 5), what)
    if rows.shape[1] == 3:
        return rows[:, 0].copy(), rows[:, 1].copy(), np.arange(len(rows))
    row_of, step = repeats(rows[:, 4])
    return rows[row_of, 0] + step * rows[row_of, 3], rows[row_of, 1], row_of


def repeats(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Item i repeated ``counts[i]`` times: (the item of each repeat, the repeat's position within its item)."""
    counts = counts.astype(np.int64)
    item = np.repeat(np.arange(len(counts)), counts)
    position = np.arange(len(item)) - np.repeat(np.cumsum(counts) - counts, counts)
    return item, position.astype(np.uint64)


def picked(indices: np.ndarray, count: int, what: str) -> np.ndarray:
    """Indices into a list of ``count`` entries, checked."""
    chosen = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(chosen) and (chosen.min() < 0 or chosen.max() >= count):
        raise AgentError(f"{what}: an index is outside the {count} entries")
    return chosen


def region_of(addresses: np.ndarray, lengths: np.ndarray, regions: Sequence[tuple[int, int]]) -> np.ndarray:
    """For each entry, the index (into ``regions``, (address, nbytes) pairs) of a region holding it whole, or -1."""
    if not regions or not len(addresses):
        return np.full(len(addresses), -1, dtype=np.int64)
    order = np.argsort([address for address, _ in regions], kind="stable")
    starts = np.array([regions[i][0] for i in order], dtype=np.uint64)
    ends = starts + np.array([regions[i][1] for i in order], dtype=np.uint64)
    where = np.searchsorted(starts, addresses, side="right") - 1
    fits = (where >= 0) & (addresses + lengths <= ends[np.maximum(where, 0)])
    return np.where(fits, order[np.maximum(where, 0)], -1)
