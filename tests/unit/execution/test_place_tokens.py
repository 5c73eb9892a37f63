"""`place_tokens` (a loader's answer written straight into a build group's block) and `pack_group` built on it.

Oracles: a per-row copy loop for `place_tokens`; `pack_step` (the per-step reference, which scatters answers
into manifest order and packs each micro-batch alone) for `pack_group`, on random groups with empty segments,
empty micro-batches, padding, a segment as long as the row, and answers interleaved row by row (the index-array
path) or in long runs (slice copies).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from loomdata.execution import _pack_group
from loomdata.execution._loader import SegmentData
from loomdata.execution._pack_group import place_tokens
from loomdata.execution._packing import PackRules, pack_step
from loomdata.schemas.errors import ExecutionError
from loomtest.manifest_rows import PackMeta, rows_of
from loomtest.pack_group import pack_group


def _reference(size: int, tokens: np.ndarray, dest: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    out = np.full(size, -7, dtype=np.int32)
    at = 0
    for d, n in zip(dest.tolist(), lengths.tolist(), strict=True):
        out[d : d + n] = tokens[at : at + n]
        at += n
    return out


@pytest.mark.parametrize("seed", range(40))
def test_place_tokens_equals_a_copy_per_row(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    lengths = rng.integers(0, 50, size=n).astype(np.int64)
    lengths[rng.random(n) < 0.2] = 0  # empty segments
    # rows laid out in some order with gaps (padding) between some of them, so some rows sit end to end (runs)
    order = rng.permutation(n) if rng.random() < 0.5 else np.arange(n)
    gaps = np.where(rng.random(n) < 0.3, rng.integers(1, 9, size=n), 0)
    place = np.zeros(n, dtype=np.int64)
    pos = 0
    for k in order.tolist():
        pos += int(gaps[k])
        place[k] = pos
        pos += int(lengths[k])
    tokens = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.int32)
    out = np.full(pos + 3, -7, dtype=np.int32)
    place_tokens(out, tokens, place, lengths)
    np.testing.assert_array_equal(out, _reference(pos + 3, tokens, place, lengths))


def test_both_paths_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 9, size=500).astype(np.int64)
    dest = np.cumsum(lengths + rng.integers(0, 2, size=500)) - lengths  # many runs
    tokens = rng.integers(0, 9, size=int(lengths.sum()), dtype=np.int32)
    size = int(dest[-1] + lengths[-1]) + 1
    want = _reference(size, tokens, dest, lengths)
    for runs in (0, 10**9):  # every answer by an index array; every answer by slices
        monkeypatch.setattr(_pack_group, "_RUN_COPIES", runs)
        out = np.full(size, -7, dtype=np.int32)
        place_tokens(out, tokens, dest, lengths)
        np.testing.assert_array_equal(out, want)


def test_an_answer_of_the_wrong_size_is_refused() -> None:
    out = np.zeros(10, dtype=np.int32)
    with pytest.raises(ExecutionError, match="answered 3 tokens for segments totalling 4"):
        place_tokens(out, np.arange(3, dtype=np.int32), np.array([0, 2]), np.array([2, 2]))


def _step(rng: np.random.Generator, meta: PackMeta, step: int, ranks: list[int], interleave: bool) -> tuple[Any, ...]:
    cols: dict[str, list[int]] = {c: [] for c in ("dp_rank", "micro_batch", "length", "lane")}
    for r in ranks:
        for mb in range(meta.micro_batches):
            lane = int(rng.integers(0, len(meta.lanes)))
            cap = meta.lanes[lane]
            kind = rng.random()
            if kind < 0.15:
                lens = []  # an empty micro-batch: all padding
            elif kind < 0.3:
                lens = [cap]  # one document (or the piece of a longer one) as long as the row
            else:
                lens, left = [], cap - int(rng.integers(0, cap // 3))  # some padding at the end
                while left > 0:
                    ln = min(left, int(rng.integers(0, cap // 3)))
                    lens.append(ln)  # 0: an empty segment
                    left -= max(ln, 1)
            for ln in lens:
                cols["dp_rank"].append(r)
                cols["micro_batch"].append(mb)
                cols["length"].append(ln)
                cols["lane"].append(lane)
    m = len(cols["length"])
    rows = rows_of(cols, step, rng)
    if interleave:  # loaders answer alternate rows: many runs, each answer by an index array
        groups = [np.arange(k, m, 3) for k in range(3)]
    else:  # each source's rows, as the constructor asks them
        groups = [np.flatnonzero(rows.source == s) for s in range(3)]
    groups = [g for g in groups if len(g)] or [np.zeros(0, dtype=np.int64)]
    answers = [
        SegmentData(tokens=rng.integers(1, 50_000, size=int(rows.length[g].sum()), dtype=np.int32)) for g in groups
    ]
    return rows, groups, answers


@pytest.mark.parametrize("seed", range(16))
def test_pack_group_equals_pack_step(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    meta = PackMeta(micro_batches=int(rng.integers(1, 4)), lanes=(64, 256) if seed % 2 else (128,))
    rules = PackRules(pad_token_id=3, image_token_id=7)
    work, rows, answers = [], [], []
    for step in range(10, 10 + int(rng.integers(1, 9))):
        ranks = sorted(rng.choice(4, size=int(rng.integers(1, 5)), replace=False).tolist())
        r, g, a = _step(rng, meta, step, ranks, interleave=seed % 4 == 0)
        work.append((step, ranks))
        rows.append(r)
        answers.append((g, a))
    got = pack_group(meta, rules, work, rows, answers)  # type: ignore[arg-type]
    for (step, ranks), rw, (g, a), packs in zip(work, rows, answers, got, strict=True):
        want = pack_step(meta, rules, step, ranks, rw, g, a)  # type: ignore[arg-type]
        assert sorted(packs) == ranks
        for r in ranks:
            for x, y in zip(packs[r].batches, want[r], strict=True):
                for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "segments", "image_positions"):
                    u, v = getattr(x, name), getattr(y, name)
                    assert u.dtype == v.dtype and np.array_equal(u, v), name
                assert (x.step, x.dp_rank, x.micro_batch, x.lane) == (y.step, y.dp_rank, y.micro_batch, y.lane)


def test_pack_group_refuses_an_answer_of_the_wrong_size_even_when_the_total_matches() -> None:
    rng = np.random.default_rng(9)
    meta = PackMeta(micro_batches=1, lanes=(64,))
    rows, groups, answers = _step(rng, meta, 0, [0, 1], interleave=True)
    groups, answers = groups[:2], answers[:2]
    if len(answers) < 2 or len(answers[0].tokens) == 0:
        pytest.skip("this seed gives fewer than two non-empty answers")
    moved = answers[0].tokens[-1:]  # one token moved from the first answer to the second: same total
    answers = [
        SegmentData(tokens=answers[0].tokens[:-1]),
        SegmentData(tokens=np.concatenate([moved, answers[1].tokens])),
    ]
    keep = np.sort(np.concatenate(groups))
    rows = rows.take(keep)
    groups = [np.searchsorted(keep, g) for g in groups]
    with pytest.raises(ExecutionError, match="a loader answered"):
        pack_group(meta, PackRules(pad_token_id=0, image_token_id=7), [(0, [0, 1])], [rows], [(groups, answers)])  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(30))
def test_join_equals_a_copy_per_piece_with_runs_and_empty_pieces(seed: int) -> None:
    """`_join` merges pieces that continue one another in a source and drops empty ones: the same bytes."""
    rng = np.random.default_rng(seed)
    sources = [rng.integers(0, 50_000, size=int(rng.integers(0, 200)), dtype=np.int32) for _ in range(4)]
    src, lo, hi = [], [], []
    for _ in range(int(rng.integers(0, 120))):
        s = int(rng.integers(0, len(sources)))
        n = len(sources[s])
        run = bool(src) and rng.random() < 0.5 and src[-1] == s and hi[-1] < n  # continue the piece before
        a = hi[-1] if run else int(rng.integers(0, n + 1))
        b = a if rng.random() < 0.15 else int(rng.integers(a, n + 1))  # some empty
        src.append(s)
        lo.append(a)
        hi.append(b)
    want = np.concatenate([sources[s][a:b] for s, a, b in zip(src, lo, hi, strict=True)] or [np.zeros(0, np.int32)])
    arrays = [np.asarray(x, dtype=np.int64) for x in (src, lo, hi)]
    np.testing.assert_array_equal(_pack_group._join(sources, *arrays, len(want)), want)
    merged = _pack_group._runs(*arrays)
    assert len(merged[0]) <= len(src)
    assert bool((merged[2] > merged[1]).all())  # no empty piece left


def test_join_of_only_empty_pieces_is_empty() -> None:
    """A group whose every piece is empty (padding only) joins to an empty array, not numpy's 'need at least one'."""
    src, lo, hi = (np.asarray(x, dtype=np.int64) for x in ([0, 1], [3, 0], [3, 0]))
    out = _pack_group._join([np.arange(10, dtype=np.int32), np.arange(4, dtype=np.int32)], src, lo, hi, 0)
    assert out.dtype == np.int32 and len(out) == 0


def test_join_refuses_a_size_that_only_empty_pieces_were_given_for() -> None:
    """A positive size with nothing to copy is a packing bug, not an uninitialised array handed on."""
    from loomdata.schemas.errors import ExecutionError

    src, lo, hi = (np.asarray(x, dtype=np.int64) for x in ([0], [3], [3]))
    with pytest.raises(ExecutionError, match="only empty pieces"):
        _pack_group._join([np.arange(10, dtype=np.int32)], src, lo, hi, 5)
