"""A seeded uniform permutation of a source's documents, cache-friendly at a billion items (planning._permute_kernel).

A stream's permutation is drawn once an epoch (planning._mixture.build_stream). NumPy's Generator.shuffle of
10M 4-byte ids takes ~1.4 s here, bound by its random swaps over the whole array; this one buckets first and
shuffles each bucket in cache, ~10x faster, and is defined by its own integer arithmetic alone: the generator's
seed material goes through NumPy's SeedSequence and PCG64 (whose streams NumPy keeps stable) for the four
words of a xoshiro256** state, and nothing else of NumPy's sampling code can change the order.
"""

from __future__ import annotations

import numpy as np

from loomdata.planning._permute_kernel import permute_into

__all__ = ["BUCKET_ITEMS", "bucket_bits", "uniform_permutation"]

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
    if src is not None and len(src) != n:
        raise ValueError(f"src holds {len(src)} values, not n={n}")
    state = np.asarray(rng.bit_generator.random_raw(4), dtype=np.uint64)
    if not state.any():  # xoshiro's one bad state (probability 2^-256)
        state[0] = 1
    out = np.empty(n, dtype=dtype if src is None else src.dtype)
    permute_into(np.zeros(1, dtype=out.dtype) if src is None else src, src is None, out, state, bucket_bits(n))
    return out
