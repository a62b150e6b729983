"""Descriptor rows as flat entries, for agents whose transport takes (address, length) lists rather than NIXL's
prepared lists: the Mooncake, MPI and UCX agents. Pure numpy; a bad table raises ValueError, which ``checked``
turns into the agent's AgentError (``located`` raises the AgentError itself)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nixl_kv.errors import AgentError


def checked(function: Callable[..., Any], what: str, *args: Any) -> Any:
    """``function(*args)`` (a helper of this module), its ValueError as the AgentError ``what: reason``."""
    try:
        return function(*args)
    except ValueError as exc:
        raise AgentError(f"{what}: {exc}") from None


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


def region_of(addresses: np.ndarray, lengths: np.ndarray, regions: Sequence[tuple[int, int]]) -> np.ndarray:
    """For each entry, the index (into ``regions``, disjoint (address, nbytes) pairs in any order) of the region
    holding it whole, or -1."""
    if not len(regions) or not len(addresses):
        return np.full(len(addresses), -1, dtype=np.int64)
    order = np.argsort([address for address, _ in regions], kind="stable")
    starts = np.array([regions[i][0] for i in order], dtype=np.uint64)
    ends = starts + np.array([regions[i][1] for i in order], dtype=np.uint64)
    where = np.searchsorted(starts, addresses, side="right") - 1
    fits = (where >= 0) & (addresses + lengths <= ends[np.maximum(where, 0)])
    return np.where(fits, order[np.maximum(where, 0)], -1)


def located(
    what: str, addresses: np.ndarray, lengths: np.ndarray, regions: Sequence[tuple[int, int]], where: str
) -> np.ndarray:
    """``region_of`` each entry; for the first entry outside every region, the AgentError ``what: entry i (address,
    n bytes) is not inside where``."""
    found = region_of(addresses, lengths, regions)
    if len(outside := np.flatnonzero(found < 0)):
        first = int(outside[0])
        raise AgentError(
            f"{what}: entry {first} ({int(addresses[first]):#x}, {int(lengths[first])} bytes) is not inside {where}"
        )
    return found


def runs(
    local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, same: Sequence[np.ndarray] = (), max_bytes: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Paired entries merged where each continues the last on both sides (and every array of ``same`` agrees), then,
    with ``max_bytes``, runs cut into pieces of at most that (an empty run stays one empty piece): (local addresses,
    remote addresses, lengths, the first entry of each run or piece)."""
    if not len(lengths):
        return local, remote, lengths, np.zeros(0, dtype=np.int64)
    joins = (local[:-1] + lengths[:-1] == local[1:]) & (remote[:-1] + lengths[:-1] == remote[1:])
    for key in same:
        joins &= key[:-1] == key[1:]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = np.add.reduceat(lengths, starts)
    if not max_bytes:
        return local[starts], remote[starts], merged, starts
    entry, piece = repeats(np.maximum(1, (merged + (max_bytes - 1)) // max_bytes))
    offset = piece * np.uint64(max_bytes)
    cut = np.minimum(merged[entry] - offset, max_bytes)
    return local[starts][entry] + offset, remote[starts][entry] + offset, cut, starts[entry]


def picked(indices: np.ndarray, count: int) -> np.ndarray:
    """``indices`` into a list of ``count`` entries, checked."""
    chosen = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(chosen) and (chosen.min() < 0 or chosen.max() >= count):
        raise ValueError(f"an index is outside the {count} entries")
    return chosen
