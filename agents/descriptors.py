"""Descriptor rows as flat entries, for agents whose transport takes (address, length) lists rather than NIXL's
prepared lists: the Mooncake and MPI agents. Pure numpy; a bad table raises ValueError, which each agent turns
into its AgentError."""

from __future__ import annotations

import numpy as np


def table(descriptors: np.ndarray, width: tuple[int, ...]) -> np.ndarray:
    """``descriptors`` as a uint64 table of one of the row widths ``width``."""
    try:
        rows = np.asarray(descriptors, dtype=np.uint64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc
    if rows.ndim != 2 or rows.shape[1] not in width:
        raise ValueError(f"rows of shape {rows.shape}, expected Nx{'/'.join(map(str, width))}")
    return rows


def expand(descriptors: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nx3 (address, length, device) or strided Nx5 (.., stride, count) rows as one entry per unit:
    (addresses, lengths, the row of each entry)."""
    rows = table(descriptors, (3, 5))
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


def inside(addresses: np.ndarray, lengths: np.ndarray, regions: list[tuple[int, int]]) -> np.ndarray:
    """Whether each entry lies inside one of the (sorted, disjoint) (address, nbytes) regions."""
    if not regions:
        return np.zeros(len(addresses), dtype=bool)
    starts, sizes = (np.array(column, dtype=np.uint64) for column in zip(*regions, strict=True))
    where = np.searchsorted(starts, addresses, side="right") - 1
    return (where >= 0) & (addresses + lengths <= (starts + sizes)[np.maximum(where, 0)])


def picked(indices: np.ndarray, count: int) -> np.ndarray:
    """``indices`` into a list of ``count`` entries, checked."""
    chosen = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(chosen) and (chosen.min() < 0 or chosen.max() >= count):
        raise ValueError(f"an index is outside the {count} entries")
    return chosen
