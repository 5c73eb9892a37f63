"""The look-ahead's compact forms give what the plain ones give: block cumulative sums, natural ranges."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from loomdata.planning import _lookahead as lookahead_module
from loomdata.planning._lookahead import _Cum, assign_steps, natural_positions, natural_ranges, stable_order
from loomdata.planning._mixture import build_stream, give_back_room, membership, step_weights
from loomdata.planning._packing import Lanes
from loomdata.schemas.spec import Spec


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 12_291])
@pytest.mark.parametrize("sum_blocks", [_Cum.SUM_BLOCKS, 3])  # 3: the block sums taken in many chunks
def test_block_cumulative_sums_index_and_search_like_the_full_array(
    n: int, sum_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Cum, "SUM_BLOCKS", sum_blocks)
    rng = np.random.default_rng(n)
    lengths = rng.integers(0, 50, n).astype(np.uint32)
    lengths[rng.random(n) < 0.3] = 0  # runs of equal sums: searchsorted sides differ there
    c = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=c[1:])
    buf = _Cum.buffer(n)
    buf[:n] = lengths
    cum = _Cum(buf, n)
    assert cum.pad.base is buf or cum.pad.base is buf.base  # kept, not copied
    idx = rng.integers(0, n + 1, 3000)
    np.testing.assert_array_equal(cum[idx], c[idx])
    assert [cum[int(i)] for i in idx[:50]] == c[idx[:50]].tolist()
    v = np.concatenate([rng.integers(-5, int(c[-1]) + 5, 3000), c[idx[:200]]])
    for side in ("left", "right"):
        np.testing.assert_array_equal(cum.searchsorted(v, side), np.searchsorted(c, v, side=side))


def test_block_cumulative_sums_refuse_a_buffer_of_another_size() -> None:
    with pytest.raises(ValueError, match="wants a buffer of 128"):
        _Cum(np.zeros(64, dtype=np.uint32), 70)


def test_natural_ranges_assign_as_natural_position_arrays(
    tmp_path: Path, spec_of: Callable[..., Spec], index_of: Callable[..., pa.Table], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(5)
    seq = 256
    spec = spec_of(tmp_path, ["web", "book"], steps=30, dp=4, seq_len=seq)
    lengths = [rng.integers(20, 300, 3000), rng.integers(150, 900, 600)]  # books: heavy and split pieces
    index = [index_of(ln) for ln in lengths]
    lanes = Lanes.of(spec)
    n_steps = spec.training.steps
    slots = np.full(n_steps, 4 * spec.training.micro_batches, dtype=np.int64)
    budget = slots * seq * spec.planning.fill
    targets = np.cumsum(step_weights(spec).grid() * budget[:, None], axis=0)
    cols = [t.column("num_tokens").to_numpy() for t in index]
    streams = [build_stream(n, 7, c, lanes, 3) for n, c in zip(spec.source_names, cols, strict=True)]
    dp = np.full(n_steps, 4)
    ptr = membership(targets, streams, lanes, slots, give_back_room(dp, budget))
    pos, nat = natural_positions(ptr, 0, n_steps)
    a = assign_steps(pos, nat, list(streams), lanes, slots, dp, 2, 0, n_steps)
    kept = list(streams)
    trims: list[int] = []
    monkeypatch.setattr(lookahead_module, "trim_arenas", lambda: trims.append(1))
    monkeypatch.setattr(lookahead_module, "TRIM_BYTES", streams[0].cum.nbytes)  # given back after each source
    b = assign_steps(
        natural_ranges(ptr, 0, n_steps), None, kept, lanes, slots, dp, 2, 0, n_steps, ptr=ptr, drop_counts=True
    )
    assert all(len(st.cum) == 0 for st in kept)  # the counts were dropped from the caller's list
    assert len(trims) == 2  # and the allocator's free memory given back as they went
    # the general path (positions not in stream order: one lexsort) gives the same steps too
    rev = [p[::-1].copy() for p in pos]
    c_ = assign_steps(rev, [x[::-1].copy() for x in nat], list(streams), lanes, slots, dp, 2, 0, n_steps)
    for k in range(2):
        np.testing.assert_array_equal(a.pos[k], b.pos[k])
        np.testing.assert_array_equal(a.step[k], b.step[k])
        moved = {int(p): int(s) for p, s in zip(a.pos[k], a.step[k], strict=True)}
        assert moved == {int(p): int(s) for p, s in zip(c_.pos[k], c_.step[k], strict=True)}
    assert (
        sum(
            int((np.asarray(s) != np.searchsorted(ptr.column(k), p, side="right") - 1).sum())
            for k, (p, s) in enumerate(zip(a.pos, a.step, strict=True))
        )
        > 0
    )  # the look-ahead moved some


def test_sorted_pieces_sort_as_one_stable_sort() -> None:
    from loomdata.planning._lookahead import CHUNK, _sorted_pieces

    rng = np.random.default_rng(2)
    n = 3 * CHUNK + 17
    key = (np.arange(n) // 50).astype(np.int32)  # steps of 50 segments, in order
    moved = rng.integers(0, n, 400)
    key[moved] += rng.integers(-3, 4, 400).astype(np.int32)  # local moves, as the look-ahead makes
    key[CHUNK + 5] = key[-1] + 1  # one far move: no cut between it and the end
    pieces = _sorted_pieces(key)
    assert pieces[0][0] == 0 and pieces[-1][1] == n and 2 <= len(pieces) < 4
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(pieces))
    got = np.concatenate([a + np.argsort(key[a:b], kind="stable") for a, b in pieces])
    np.testing.assert_array_equal(got, np.argsort(key, kind="stable"))


@pytest.mark.parametrize("width", [1, 700, 1 << 16, (1 << 16) + 1, 1 << 20])
def test_stable_order_is_the_stable_argsort(width: int) -> None:
    rng = np.random.default_rng(width)
    lo = 12_345
    runs = [np.sort(rng.integers(lo, lo + width, 500)) for _ in range(7)]  # a chunk's sorted runs, as merged
    for dtype in (np.int32, np.int64):
        key = np.concatenate(runs).astype(dtype)
        np.testing.assert_array_equal(stable_order(key, lo, lo + width), np.argsort(key, kind="stable"))
