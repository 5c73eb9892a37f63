"""StepItems gathering look-ahead blocks straight into step-major columns (`_placed`, _items_kernel) against the
argsort of `_assigned`'s columns, through the public `step`/`span` reads: a re-plan's window (step0 > 0), many
blocks and the last one, sources absent from blocks, steps drawn from one source, the long lane's split pieces,
uint64 ids near 2^64 and a window's row ids of narrow dtypes (review29)."""

from __future__ import annotations

import numpy as np
import pytest

from loomdata.planning import _items
from loomdata.planning._items import StepItems
from loomdata.planning._lookahead import StepAssignment
from loomdata.planning._mixture import build_stream
from loomdata.planning._packing import Lanes
from loomdata.planning._pointers import Pointers
from loomdata.planning._segments import DenseIds, RowIds
from loomdata.schemas.spec import CostSpec

TOP = np.uint64(2**64 - 1)


def _ids(kind: str, n: int, rng: np.random.Generator) -> np.ndarray | DenseIds | RowIds:
    if kind == "high":  # stored ids near the top of uint64 (above 2^63: negative as int64, inexact as float)
        return TOP - np.arange(n, dtype=np.uint64) * np.uint64(7)
    if kind == "dense":
        return DenseIds(n)
    rows = np.sort(rng.choice(1 << 16, n, replace=False))
    return RowIds(rows.astype(np.dtype(kind)))  # a window's rows in the stream's doc dtype


def _plan(
    rng: np.random.Generator, lanes: Lanes, step0: int, steps: int, kinds: list[str]
) -> tuple[list, list, list, list, StepAssignment]:
    """Sources of `kinds` ids with a random assignment over steps step0..step0+steps-1 (absolute steps, as a
    window's): source 0 draws in every step, source 1 only in the last few, source 2 only in step step0 + 3 (a
    step of the others too), the rest anywhere; each source's positions shuffled (look-ahead moves them)."""
    samples, tokens, images, streams, pos, at = [], [], [], [], [], []
    for k, kind in enumerate(kinds):
        n = 3 if k == 2 else int(rng.integers(20, 200))
        lengths = rng.integers(1, 5000, n).astype(np.uint32)
        st = build_stream(f"s{k}", k, lengths, lanes, 2)
        m = len(st.doc)
        if k == 0:
            step = np.sort(np.concatenate([np.arange(steps), rng.integers(0, steps, max(m - steps, 0))]))[:m]
        elif k == 1:
            step = np.sort(rng.integers(steps - 3, steps, m))
        elif k == 2:
            step = np.full(m, 3)
        else:
            step = np.sort(rng.integers(0, steps, m))
        samples.append(_ids(kind, n, rng))
        tokens.append(lengths)
        images.append(np.broadcast_to(np.zeros(1, np.uint32), (n,)))
        streams.append(st)
        pos.append(rng.permutation(m).astype(np.uint32))
        at.append((step + step0).astype(np.int32))
    assert all(len(p) >= 1 for p in pos) and len(pos[0]) >= steps
    return samples, tokens, images, streams, StepAssignment(pos, at)


def _items_of(parts: tuple, lanes: Lanes, step0: int, steps: int) -> StepItems:
    samples, tokens, images, streams, asg = parts
    ptr = Pointers.from_dense(np.zeros((steps + 1, len(streams)), dtype=np.int64))
    return StepItems(samples, tokens, images, streams, ptr, lanes, CostSpec(), asg, step0)


@pytest.mark.parametrize("step0", [0, 13])
@pytest.mark.parametrize("kinds", [["high", "uint32", "high", "dense"], ["int32", "dense", "uint16", "int64", "high"]])
@pytest.mark.parametrize("lanes", [Lanes(seq_len=256), Lanes(seq_len=512, long_seq_len=4096, threshold=1024)])
def test_placed_steps_are_the_sorted_assigned_ones(
    step0: int, kinds: list[str], lanes: Lanes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step (and a span of steps) read with `_placed` is the one read through `_assigned` and the stable
    argsort: value, type and bounds, over blocks of ~64 segments (many blocks, the last one short)."""
    monkeypatch.setattr(_items, "BLOCK_SEGMENTS", 64)
    monkeypatch.setattr(_items, "SEGMENTS_PER_SOURCE", 1)
    steps = 37
    parts = _plan(np.random.default_rng(step0 + len(kinds)), lanes, step0, steps, kinds)
    placed, sorted_ = _items_of(parts, lanes, step0, steps), _items_of(parts, lanes, step0, steps)
    assert placed._placing
    sorted_._placing = False
    blocks = set()
    for t in range(step0, step0 + steps):
        blocks.add(placed.block(t).start)
        (a, ca), (b, cb) = placed.step(t), sorted_.step(t)
        assert len(a.source) > 0
        for name in ("source", "sample", "offset", "length", "lane", "image_tokens"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype, (t, name)
            np.testing.assert_array_equal(x, y, err_msg=f"step {t} {name}")
        assert ca.dtype == cb.dtype
        np.testing.assert_array_equal(ca, cb)
    assert len(blocks) > 3  # several blocks gathered, the last one included
    assert placed.block(step0 + steps - 1).stop == step0 + steps
    high = [k for k, kind in enumerate(kinds) if kind == "high"]
    got = np.concatenate([placed.step(t)[0].sample for t in range(step0 + steps - 3, step0 + steps)])
    assert high and got.max() > np.uint64(2**63)  # the ids above 2^63 came through whole
    assert set(np.unique(placed.step(step0 + 3)[0].source)) >= {0, 2}


def test_a_step_of_one_source_and_a_source_in_one_step() -> None:
    """Steps drawn from source 0 only, source 1 in one step of a window (step0 60): each placed step is that
    source's segments in the order the assignment lists them."""
    lanes = Lanes(seq_len=128)
    st0 = build_stream("a", 0, np.full(6, 100, np.uint32), lanes, 1)
    st1 = build_stream("b", 1, np.full(2, 50, np.uint32), lanes, 1)
    asg = StepAssignment(
        [np.array([5, 3, 1, 0, 2, 4], np.uint32), np.array([1, 0], np.uint32)],
        [np.array([60, 60, 61, 61, 62, 62], np.int32), np.array([61, 61], np.int32)],
    )
    ids0 = TOP - np.arange(6, dtype=np.uint64)
    parts = ([ids0, RowIds(np.array([7, 9], np.int32))], [np.full(6, 100, np.uint32), np.full(2, 50, np.uint32)],
             [np.broadcast_to(np.zeros(1, np.uint16), (6,)), np.broadcast_to(np.zeros(1, np.uint16), (2,))],
             [st0, st1], asg)  # fmt: skip
    items = _items_of(parts, lanes, 60, 3)
    assert items._placing
    seg, _ = items.step(60)
    np.testing.assert_array_equal(seg.source, [0, 0])
    np.testing.assert_array_equal(seg.sample, ids0[st0.doc[[5, 3]]])
    seg, _ = items.step(61)
    np.testing.assert_array_equal(seg.source, [0, 0, 1, 1])
    np.testing.assert_array_equal(
        seg.sample, np.concatenate([ids0[st0.doc[[1, 0]]], np.array([7, 9])[st1.doc[[1, 0]]]])
    )
    assert seg.sample.dtype == np.uint64 and seg.image_tokens.dtype == np.uint16
    seg, _ = items.step(62)
    np.testing.assert_array_equal(seg.source, [0, 0])


def test_zero_image_columns_of_two_types_are_not_placed() -> None:
    """Sources without images whose zero columns differ in type keep `_assigned`'s concatenation (its image
    tokens take the wider type; `_placed` would give the first source's)."""
    lanes = Lanes(seq_len=256)
    samples, tokens, _, streams, asg = _plan(np.random.default_rng(5), lanes, 0, 12, ["high", "dense", "uint32"])
    dtypes: list[type[np.unsignedinteger]] = [np.uint16, np.uint32, np.uint16]
    images = [np.broadcast_to(np.zeros(1, dt), (len(x),)) for dt, x in zip(dtypes, tokens, strict=True)]
    items = _items_of((samples, tokens, images, streams, asg), lanes, 0, 12)
    assert not items._placing
    assert items.step(3)[0].image_tokens.dtype == np.uint32


def test_segments_past_the_counts_are_refused_before_any_write() -> None:
    """A source with more segments in the block than the counts leave room for is refused (-1) before a column
    is written: the compiled writes are unchecked, so placing them would write past the block's columns (here
    into a guard the columns are views of) before `_placed`'s count check could see it."""
    from loomdata.planning._items_kernel import place_assigned

    lanes = Lanes(seq_len=128)
    st = build_stream("a", 0, np.full(6, 100, np.uint32), lanes, 1)
    pos, at = np.arange(6, dtype=np.uint32), np.array([0, 0, 1, 1, 1, 1], np.int32)
    n, guard = 4, 8  # the counts say 2 + 2; step 1 has 4
    cols = [np.full(n + guard, 99, dt) for dt in (np.uint16, np.uint64, np.uint32, np.int64, np.uint8)]
    nxt = np.array([0, 2], np.int64)
    none = np.zeros(0, np.int64)
    got = place_assigned(
        st.doc, pos, at, 0, 2, np.full(6, 100, np.uint32), none, none.astype(np.uint32), none.astype(np.uint32),
        -1, np.zeros(0, np.uint64), True, 3, nxt, *(c[:n] for c in cols),
    )  # fmt: skip
    assert got == -1
    for c in cols:
        assert (c[n:] == 99).all()  # nothing past the columns


def test_placed_raises_where_a_step_holds_more_than_its_count() -> None:
    items = _items_of(
        _plan(np.random.default_rng(6), Lanes(seq_len=256), 0, 12, ["dense", "high"]), Lanes(seq_len=256), 0, 12
    )
    items._seg_end = items._seg_end.copy()
    items._seg_end[-1] -= 3  # the last step said to hold 3 fewer than assigned: they would land past the columns
    with pytest.raises(AssertionError, match="do not match the assignment's counts"):
        items._placed(0, 12)
