"""A seeded uniform permutation of a source's documents, cache-friendly at a billion items (planning._permute_kernel).

A stream's permutation is drawn once an epoch (planning._mixture.build_stream). NumPy's Generator.shuffle of
10M 4-byte ids takes ~1.4 s here, bound by its random swaps over the whole array; this one buckets first and
shuffles each bucket in cache, ~10x faster, and is defined by its own integer arithmetic alone: the generator's
seed material goes through NumPy's SeedSequence and PCG64 (whose streams NumPy keeps stable) for the four
words of a xoshiro256** state, and nothing else of NumPy's sampling code can change the order.
`uniform_permutation_with_values` moves a value with each item (a stream's document lengths): the same order, and
the caller reads no value at random afterwards (40M documents: 0.48 -> 0.65 s for the permutation, against ~0.4 s
of random reads saved).
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._permute_kernel import permute_into, permute_with_values_into

__all__ = ["BUCKET_ITEMS", "bucket_bits", "uniform_permutation", "uniform_permutation_with_values"]

BUCKET_ITEMS = 1 << 14
"""Items a bucket holds on average (64 KiB of 4-byte ids: shuffled within a core's L2 cache)."""
MAX_BUCKET_BITS = 12
"""At most 4,096 buckets: the scatter's write streams stay within the L1/L2 caches."""


def bucket_bits(n: int) -> int:
    """log2 of the buckets for n items: about BUCKET_ITEMS each, at most 2^MAX_BUCKET_BITS."""
    return min(MAX_BUCKET_BITS, max(0, (max(n, 1) - 1) // BUCKET_ITEMS).bit_length())


def uniform_permutation(
    rng: np.random.Generator, n: int, *, src: np.ndarray | None = None, dtype: type[np.integer] = np.uint32
) -> np.ndarray:
    """A uniform permutation of 0..n-1 as `dtype` (of `src`'s n values, in src's dtype, when given), from `rng`'s
    next four raw 64-bit outputs."""
    out, _ = _permutation(rng, n, src, dtype, None)
    return out


def uniform_permutation_with_values(
    rng: np.random.Generator,
    n: int,
    values: np.ndarray,
    *,
    src: np.ndarray | None = None,
    dtype: type[np.integer] = np.uint32,
) -> tuple[np.ndarray, np.ndarray]:
    """(uniform_permutation(rng, n, src=src, dtype=dtype), values at its items) in one pass: each item's value
    travels with it through the bucketing and the shuffles, so a stream needs no random gather of its documents'
    lengths (40M documents: ~0.4 s of random reads at the memory's limit)."""
    out, moved = _permutation(rng, n, src, dtype, values)
    assert moved is not None
    return out, moved


def _permutation(
    rng: np.random.Generator, n: int, src: np.ndarray | None, dtype: type[np.integer], values: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    if src is not None and len(src) != n:
        raise ValueError(f"src holds {len(src)} values, not n={n}")
    state = np.asarray(rng.bit_generator.random_raw(4), dtype=np.uint64)
    if not state.any():  # xoshiro's one bad state (probability 2^-256)
        state[0] = 1
    out = np.empty(n, dtype=dtype if src is None else src.dtype)
    items = np.zeros(1, dtype=out.dtype) if src is None else src
    if values is None:
        permute_into(items, src is None, out, state, bucket_bits(n))
        return out, None
    moved = np.empty(n, dtype=values.dtype)
    permute_with_values_into(items, src is None, out, values, moved, state, bucket_bits(n))
    return out, moved
