"""The seeded permutation is a permutation, exactly uniform, and defined by its own arithmetic (a pure-Python
rendering of the same algorithm gives the same order)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from loomdata.planning import _permute
from loomdata.planning._permute import (
    BUCKET_ITEMS,
    PrefixPermutation,
    bucket_bits,
    uniform_permutation,
    uniform_permutation_with_values,
)
from loomdata.planning._permute_kernel import permute_into

_M64 = (1 << 64) - 1


def _next(s: list[int]) -> int:
    """xoshiro256** in Python integers (the reference for the compiled generator)."""
    x = (s[1] * 5) & _M64
    result = ((((x << 7) | (x >> 57)) & _M64) * 9) & _M64
    t = (s[1] << 17) & _M64
    s[2] ^= s[0]
    s[3] ^= s[1]
    s[1] ^= s[2]
    s[0] ^= s[3]
    s[2] ^= t
    s[3] = ((s[3] << 45) | (s[3] >> 19)) & _M64
    return result


def _below(s: list[int], m: int) -> int:
    """Lemire's bounded draw on 32 random bits, with rejection."""
    prod = (_next(s) >> 32) * m
    floor = (1 << 32) % m
    while prod & 0xFFFFFFFF < floor:
        prod = (_next(s) >> 32) * m
    return prod >> 32


def _reference(src: list[int], state: list[int], bits: int) -> list[int]:
    """Rao-Sandelius with the generator above: buckets from the top bits, in item order, then Fisher-Yates."""
    s = list(state)
    buckets: list[list[int]] = [[] for _ in range(1 << bits)]
    for v in src:
        buckets[_next(s) >> (64 - bits) if bits else 0].append(v)
    out: list[int] = []
    for b in buckets:
        for j in range(len(b) - 1, 0, -1):
            k = _below(s, j + 1)
            b[j], b[k] = b[k], b[j]
        out.extend(b)
    return out


@pytest.mark.parametrize("bits", [0, 1, 3, 6])
@pytest.mark.parametrize("dense", [True, False])
def test_the_compiled_permutation_is_the_reference_algorithm(bits: int, dense: bool) -> None:
    rng = np.random.default_rng(bits)
    n = 2_000
    src = np.sort(rng.choice(10 * n, n, replace=False)).astype(np.uint32)
    state = rng.integers(1, 2**63, 4, dtype=np.uint64)
    out = np.empty(n, dtype=np.uint32)
    permute_into(np.zeros(1, np.uint32) if dense else src, dense, out, state.copy(), bits)
    values = list(range(n)) if dense else [int(v) for v in src]
    assert out.tolist() == _reference(values, [int(v) for v in state], bits)


@pytest.mark.parametrize("n", [0, 1, 7, BUCKET_ITEMS + 1, 5 * BUCKET_ITEMS + 3])
def test_every_item_appears_once(n: int) -> None:
    out = uniform_permutation(np.random.default_rng(n), n)
    assert out.dtype == np.uint32
    assert np.array_equal(np.sort(out), np.arange(n))
    src = np.arange(n, dtype=np.int64) * 3 + 1
    out = uniform_permutation(np.random.default_rng(n), n, src=src)
    assert out.dtype == np.int64 and np.array_equal(np.sort(out), src)


def test_the_same_generator_state_gives_the_same_order_and_another_does_not() -> None:
    n = 3 * BUCKET_ITEMS
    a = uniform_permutation(np.random.default_rng([7, 1]), n)
    assert np.array_equal(a, uniform_permutation(np.random.default_rng([7, 1]), n))
    assert not np.array_equal(a, uniform_permutation(np.random.default_rng([7, 2]), n))


@pytest.mark.parametrize("bits", [0, 2])
def test_all_orders_of_five_items_are_equally_likely(bits: int) -> None:
    """Chi-square over the 120 orders of 5 items (with 4 buckets: most buckets hold 0-2 items, the bucketing
    itself must not favour an order)."""
    draws = 36_000
    seeds = np.random.default_rng(bits).integers(1, 2**63, (draws, 4), dtype=np.uint64)
    index = {p: i for i, p in enumerate(itertools.permutations(range(5)))}
    counts = np.zeros(120)
    out = np.empty(5, dtype=np.uint32)
    src = np.zeros(1, np.uint32)
    for s in seeds:
        permute_into(src, True, out, s, bits)
        counts[index[tuple(out.tolist())]] += 1
    expected = draws / 120
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 119 degrees of freedom: mean 119, sd ~15.4; 119 + 6 sd has p < 1e-7
    assert chi2 < 119 + 6 * math.sqrt(2 * 119), chi2


def test_positions_are_uniform_across_buckets() -> None:
    """Where item 0 and the last item land over many draws of a bucketed permutation: uniform over all n places
    (chi-square over 16 bins), not confined to a bucket."""
    n = 4 * BUCKET_ITEMS
    assert bucket_bits(n) == 2
    draws = 4_000
    rng = np.random.default_rng(11)
    first, last = np.empty(draws, np.int64), np.empty(draws, np.int64)
    for d in range(draws):
        out = uniform_permutation(rng, n)
        inv = np.empty(n, np.int64)
        inv[out] = np.arange(n)
        first[d], last[d] = inv[0], inv[n - 1]
    for where in (first, last):
        counts = np.bincount(where * 16 // n, minlength=16)
        chi2 = float(((counts - draws / 16) ** 2 / (draws / 16)).sum())
        assert chi2 < 15 + 6 * math.sqrt(2 * 15), chi2


def test_bucket_bits_grow_with_n_and_stop_at_4096_buckets() -> None:
    assert bucket_bits(0) == bucket_bits(BUCKET_ITEMS) == 0
    assert bucket_bits(BUCKET_ITEMS + 1) == 1
    assert bucket_bits(10_000_000) == 10
    assert bucket_bits(10**9) == 12


@pytest.mark.parametrize("n", [0, 1, 7, BUCKET_ITEMS + 1, 5 * BUCKET_ITEMS + 3])
@pytest.mark.parametrize("with_src", [False, True])
def test_values_carried_through_the_permutation_are_the_values_at_its_items(n: int, with_src: bool) -> None:
    """uniform_permutation_with_values: the same order as uniform_permutation from the same generator state, and
    each position's value that of its item (what a gather would read)."""
    rng = np.random.default_rng(n)
    values = rng.integers(0, 2**32, 3 * n + 1, dtype=np.uint64).astype(np.uint32)
    src = np.sort(rng.choice(3 * n + 1, n, replace=False)).astype(np.uint32) if with_src else None
    want = uniform_permutation(np.random.default_rng([5, n]), n, src=src)
    got, moved = uniform_permutation_with_values(np.random.default_rng([5, n]), n, values, src=src)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    assert moved.dtype == np.uint32 and np.array_equal(moved, values[got])


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 1, 50, 3000])
def test_a_permutation_worked_out_a_prefix_at_a_time_is_the_whole_one(
    n: int, parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PrefixPermutation.extend in random steps: each ready prefix is that of the whole permutation (many buckets,
    empty ones among them), ready ends on a bucket bound at or past the position asked, and nothing past it; with
    parts, item ranges scattered and bucket ranges shuffled apart on threads give the same order."""
    monkeypatch.setattr(_permute, "BUCKET_ITEMS", 8)
    monkeypatch.setattr(_permute, "PART_ITEMS", 16)
    rng = np.random.default_rng(n)
    values = rng.integers(0, 1000, n + 5).astype(np.uint32)
    src = np.sort(rng.choice(n + 5, n, replace=False)).astype(np.uint32)
    want, moved = uniform_permutation_with_values(np.random.default_rng([1, n]), n, values, src=src)
    assert np.array_equal(want, uniform_permutation(np.random.default_rng([1, n]), n, src=src))
    perm = PrefixPermutation(np.random.default_rng([1, n]), n, values, src=src, parts=parts)
    ready = 0
    while ready < n:
        ask = min(n, ready + int(rng.integers(1, 200)))
        got = perm.extend(ask)
        assert got >= ask and (got == n or got < ask + 8 * 40)
        assert np.array_equal(perm.out[:got], want[:got]) and np.array_equal(perm.values[:got], moved[:got])
        assert perm.extend(int(rng.integers(0, got + 1))) == got  # asking less changes nothing
        ready = got
