"""Deterministic KV content: determinism, slicing by global coordinates, sensitivity, mismatch counting."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nixl_kv.harness import fill
from nixl_kv.harness.fill import Slice, count_mismatches, expected

FULL = Slice(
    layer_start=0, num_layers=4, head_start=0, num_heads=6, kv_factor=2, head_dim=32, token_start=0, num_tokens=40
)
ITEMSIZES = [1, 2, 4, 8]


def shape_of(where: Slice) -> tuple[int, ...]:
    return (where.num_layers, where.kv_factor, where.num_heads, where.num_tokens, where.head_dim)


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_expected_is_deterministic(itemsize: int) -> None:
    first = expected(1234, FULL, itemsize)
    second = expected(1234, FULL, itemsize)
    assert first.dtype == np.dtype(f"u{itemsize}")
    assert first.shape == (4, 2, 6, 40, 32)
    np.testing.assert_array_equal(first, second)
    assert len(np.unique(first)) >= min(first.size // 2, 250)  # not a constant or a short cycle


@pytest.mark.parametrize("rows_per_pass", [1, 2 * 6 * 40 * 3, 2 * 6 * 40 * 4 - 1])
def test_a_fill_in_several_passes_equals_one_pass(monkeypatch: pytest.MonkeyPatch, rows_per_pass: int) -> None:
    whole = expected(42, FULL, 2)  # 4 layers in one pass
    monkeypatch.setattr(fill, "ROWS_PER_PASS", rows_per_pass)  # a layer a pass; 3 then 1; 3 then 1 again
    np.testing.assert_array_equal(expected(42, FULL, 2), whole)


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_narrow_elements_are_the_low_bytes_of_the_wide_ones(itemsize: int) -> None:
    wide = expected(5, FULL, 8)
    narrow = expected(5, FULL, itemsize)
    np.testing.assert_array_equal(narrow, wide.astype(np.dtype(f"u{itemsize}")))


@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize(
    "layer_start,num_layers,head_start,num_heads,token_start,num_tokens",
    [
        (0, 4, 0, 6, 0, 40),
        (1, 2, 0, 6, 0, 40),
        (3, 1, 2, 3, 17, 1),
        (0, 4, 4, 2, 8, 16),
        (2, 2, 1, 1, 39, 1),
        (1, 3, 3, 3, 5, 35),
    ],
)
def test_sub_slice_equals_the_matching_part_of_the_full_slice(
    itemsize: int,
    layer_start: int,
    num_layers: int,
    head_start: int,
    num_heads: int,
    token_start: int,
    num_tokens: int,
) -> None:
    full = expected(77, FULL, itemsize)
    where = dataclasses.replace(
        FULL,
        layer_start=layer_start,
        num_layers=num_layers,
        head_start=head_start,
        num_heads=num_heads,
        token_start=token_start,
        num_tokens=num_tokens,
    )
    part = expected(77, where, itemsize)
    assert part.shape == shape_of(where)
    np.testing.assert_array_equal(
        part,
        full[
            layer_start : layer_start + num_layers,
            :,
            head_start : head_start + num_heads,
            token_start : token_start + num_tokens,
        ],
    )


def test_kv_factor_one_is_the_k_half_of_kv_factor_two() -> None:
    both = expected(3, FULL, 2)
    k_only = expected(3, dataclasses.replace(FULL, kv_factor=1), 2)
    np.testing.assert_array_equal(k_only, both[:, :1])


def fraction_differing(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    return float((a != b).mean())


# (itemsize, least fraction of elements that must differ): a 1-byte element matches by chance 1 time in 256
SENSITIVITY = [(1, 0.98), (2, 0.999), (4, 0.9999), (8, 1.0)]


@pytest.mark.parametrize("itemsize,least", SENSITIVITY)
def test_changing_the_request_seed_changes_the_values(itemsize: int, least: float) -> None:
    base = expected(1000, FULL, itemsize)
    for seed in (1001, 0, 999, 1 << 40, -1000):
        assert fraction_differing(expected(seed, FULL, itemsize), base) >= least


@pytest.mark.parametrize("itemsize,least", SENSITIVITY)
def test_changing_the_layer_changes_the_values(itemsize: int, least: float) -> None:
    """The same slice one layer further (global layer start shifted) must hold different values."""
    for shift in (1, 2, 100):
        base = expected(9, FULL, itemsize)
        moved = expected(9, dataclasses.replace(FULL, layer_start=shift), itemsize)
        assert fraction_differing(moved, base) >= least
    full = expected(9, FULL, itemsize)
    for a, b in ((0, 1), (1, 2), (0, 3)):
        assert fraction_differing(full[a], full[b]) >= least


@pytest.mark.parametrize("itemsize,least", SENSITIVITY)
def test_changing_kv_changes_the_values(itemsize: int, least: float) -> None:
    full = expected(9, FULL, itemsize)
    assert fraction_differing(full[:, 0], full[:, 1]) >= least


@pytest.mark.parametrize("itemsize,least", SENSITIVITY)
def test_changing_the_head_changes_the_values(itemsize: int, least: float) -> None:
    full = expected(9, FULL, itemsize)
    for a, b in ((0, 1), (2, 5), (4, 3)):
        assert fraction_differing(full[:, :, a], full[:, :, b]) >= least
    moved = expected(9, dataclasses.replace(FULL, head_start=1), itemsize)
    assert fraction_differing(moved, full) >= least


@pytest.mark.parametrize("itemsize,least", SENSITIVITY)
def test_changing_the_token_changes_the_values(itemsize: int, least: float) -> None:
    full = expected(9, FULL, itemsize)
    for a, b in ((0, 1), (7, 8), (0, 39)):
        assert fraction_differing(full[:, :, :, a], full[:, :, :, b]) >= least
    moved = expected(9, dataclasses.replace(FULL, token_start=1), itemsize)
    assert fraction_differing(moved, full) >= least


@pytest.mark.parametrize("itemsize,least", [(2, 0.999), (4, 0.9999), (8, 1.0)])
def test_changing_the_dim_changes_the_values(itemsize: int, least: float) -> None:
    full = expected(9, dataclasses.replace(FULL, head_dim=128), itemsize)
    for a in range(128):
        for b in range(a + 1, 128):
            assert fraction_differing(full[..., a], full[..., b]) >= least, (a, b)


def test_changing_the_dim_changes_the_values_for_one_byte_elements() -> None:
    full = expected(9, dataclasses.replace(FULL, head_dim=64), 1)
    identical = [
        (a, b) for a in range(64) for b in range(a + 1, 64) if fraction_differing(full[..., a], full[..., b]) < 0.98
    ]
    assert identical == []


@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("count", [0, 1, 2, 17, 500])
def test_count_mismatches_counts_exactly_the_corrupted_elements(itemsize: int, count: int) -> None:
    actual = expected(42, FULL, itemsize)
    assert count_mismatches(actual, 42, FULL) == 0
    rng = np.random.default_rng(count * 10 + itemsize)
    flat_positions = rng.choice(actual.size, size=count, replace=False)
    flat = actual.reshape(-1)
    flat[flat_positions] ^= np.array(1 << (8 * itemsize - 1), dtype=actual.dtype)  # flip the top bit
    assert count_mismatches(actual, 42, FULL) == count


def test_count_mismatches_of_a_sub_slice_and_of_another_request() -> None:
    where = dataclasses.replace(FULL, layer_start=1, num_layers=2, head_start=3, num_heads=2, token_start=5)
    actual = expected(8, where, 2)
    assert count_mismatches(actual, 8, where) == 0
    actual[1, 0, 1, 3, 7] += 1
    actual[0, 1, 0, 0, 0] -= 1
    assert count_mismatches(actual, 8, where) == 2
    other = expected(9, where, 2)
    assert count_mismatches(other, 8, where) == int((other != expected(8, where, 2)).sum())
    assert count_mismatches(np.zeros(shape_of(where), dtype=np.uint16), 8, where) == int(
        (expected(8, where, 2) != 0).sum()
    )
