"""The I/O-aware block shuffle: once per epoch, deterministic, local in storage, reported, resumable; spec rules."""

from __future__ import annotations

import itertools
import shutil
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.planning import PlanResume, _shuffle, make_plan
from loomdata.planning._mixture import build_stream, source_key
from loomdata.planning._packing import Lanes
from loomdata.planning._shuffle import BlockLayout, storage_runs
from loomdata.planning._shuffle_kernel import stable_ranks
from loomdata.schemas.errors import PlanError, SpecError
from loomdata.schemas.plan import read_manifest, read_plan
from loomdata.schemas.spec import Spec, parse_spec
from loomtest import plancheck as pc


def _table(lengths: np.ndarray, shards: int, *, shuffled_rows: bool = False) -> pa.Table:
    """An index over `shards` shards in (shard, row) order, or with its rows in a random order."""
    n = len(lengths)
    shard = (np.arange(n) * shards // n).astype(np.uint32)
    row = (np.arange(n) - np.searchsorted(shard, shard)).astype(np.uint64)
    order = np.random.default_rng(1).permutation(n) if shuffled_rows else np.arange(n)
    return pa.table(
        {
            "sample": pa.array(np.arange(n, dtype=np.uint64)),
            "shard": pa.array(shard[order]),
            "row": pa.array(row[order]),
            "num_tokens": pa.array(np.asarray(lengths, dtype=np.uint32)),
            "num_image_tokens": pa.array(np.zeros(n, dtype=np.uint32)),
        }
    )


def _with_shuffle(spec: Spec, **fields: Any) -> Spec:
    raw = spec.model_dump(mode="json")
    for s in raw["sources"]:
        s.update(fields)
    return parse_spec(raw, spec.base_dir, check_paths=False)


def _lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(4.5, 1.0, n), 1, 900).astype(np.int64)


def _layout(table: pa.Table, block_size: int, window: int) -> BlockLayout:
    runs, order = storage_runs(table["shard"].to_numpy(), table["row"].to_numpy())
    return BlockLayout.of(runs, order, block_size, window)


@pytest.mark.parametrize("shuffled_rows", [False, True])
def test_blocks_are_runs_of_one_shard_and_windows_draw_from_few_blocks(shuffled_rows: bool) -> None:
    t = _table(_lengths(10_000), shards=7, shuffled_rows=shuffled_rows)
    lay = _layout(t, block_size=100, window=4)
    shard, row = t["shard"].to_numpy().astype(np.int64), t["row"].to_numpy().astype(np.int64)
    # storage order is (shard, row); a block is <= block_size consecutive rows of one shard
    pos_rows = np.arange(len(t)) if lay.order is None else lay.order
    assert (np.diff(shard[pos_rows] * 10**9 + row[pos_rows]) > 0).all()
    sizes = np.diff(lay.starts)
    per_shard = np.bincount(shard, minlength=7)
    assert sizes.max() == 100 and sizes.min() > 0 and lay.num_blocks == int((-(-per_shard // 100)).sum())
    for a, b in zip(lay.starts[:-1], lay.starts[1:], strict=True):
        assert len(set(shard[pos_rows[a:b]].tolist())) == 1
    rows = lay.permutation(np.random.default_rng(3))
    assert np.array_equal(np.sort(rows), np.arange(len(t)))  # every document exactly once
    blk = np.searchsorted(lay.starts, lay.positions(rows), side="right") - 1
    # cut the plan order at block-set changes: consecutive windows of 4 blocks, each drawn whole
    bounds = np.concatenate([[0], np.cumsum([int(sizes[w].sum()) for w in _window_blocks(blk, 4)])])
    for a, b in itertools.pairwise(bounds):
        assert len(np.unique(blk[a:b])) <= 4
    # inside a window the documents are shuffled, not read block after block
    assert (np.diff(blk[: bounds[1]]) != 0).mean() > 0.5


@pytest.mark.parametrize(("block_size", "window"), [(1, 1), (1, 7), (5000, 1), (37, 1000), (64, 3)])
def test_block_permutation_covers_every_document_at_any_block_and_window_size(block_size: int, window: int) -> None:
    """Degenerate sizes too: one-document blocks, blocks larger than a shard, one window over everything."""
    t = _table(_lengths(3001), shards=5)
    lay = _layout(t, block_size, window)
    rows = lay.permutation(np.random.default_rng(block_size * 31 + window))
    assert np.array_equal(np.sort(rows), np.arange(3001))
    blk = np.searchsorted(lay.starts, rows, side="right") - 1
    first_seen = np.unique(blk, return_index=True)[1]
    order = blk[np.sort(first_seen)]  # blocks in the order the plan opens them
    win_of = np.empty(lay.num_blocks, dtype=np.int64)
    win_of[order] = np.arange(lay.num_blocks) // window
    assert (np.diff(win_of[blk]) >= 0).all()  # a window's documents are all drawn before the next window's


def _window_blocks(blk: np.ndarray, window: int) -> list[list[int]]:
    """The blocks of each window, in plan order (a window is `window` blocks drawn completely)."""
    out: list[list[int]] = []
    seen: list[int] = []
    for b in dict.fromkeys(blk.tolist()):  # first appearance order of blocks
        seen.append(b)
        if len(seen) == window:
            out.append(seen)
            seen = []
    if seen:
        out.append(seen)
    return [[int(x) for x in w] for w in out]


def test_block_stream_is_once_per_epoch_and_deterministic() -> None:
    lengths = _lengths(5000)
    lengths[::37] = 0  # empty documents are never drawn
    lengths[5] = 3000  # a document longer than seq_len becomes consecutive segments
    lay = _layout(_table(np.maximum(lengths, 1), shards=3), block_size=64, window=8)
    lanes = Lanes(seq_len=1024)
    st = build_stream("web", 7, lengths, lanes, 3, lay)
    again = build_stream("web", 7, lengths, lanes, 3, lay)
    assert np.array_equal(st.doc, again.doc) and np.array_equal(st.cum, again.cum)
    per_epoch = int((lengths > 0).sum()) + 2  # document 5 is three segments
    assert len(st.doc) == 3 * per_epoch
    epochs = st.doc.reshape(3, per_epoch)
    for e in range(3):
        d, c = np.unique(epochs[e], return_counts=True)
        assert np.array_equal(d, np.flatnonzero(lengths > 0)) and c[d == 5][0] == 3 and (c[d != 5] == 1).all()
    assert not np.array_equal(epochs[0], epochs[1])  # a fresh order every epoch
    assert not np.array_equal(build_stream("web", 8, lengths, lanes, 1, lay).doc, epochs[0])
    # the epoch's generator is the global shuffle's: (seed, crc32(name), epoch); split pieces stay together
    rows = lay.permutation(np.random.default_rng([*source_key(7, "web"), 1]))
    drawn = epochs[1][np.concatenate([[True], np.diff(epochs[1]) != 0])]
    assert np.array_equal(rows[lengths[rows] > 0], drawn)


def test_default_shuffle_keeps_the_plan_id_and_block_settings_enter_it(
    tmp_path: Path, spec_of: Callable[..., Spec]
) -> None:
    spec = spec_of(tmp_path, ["web"])
    assert "shuffle" not in spec.content_json() and "window" not in spec.content_json()
    block = _with_shuffle(spec, shuffle="block")
    explicit = _with_shuffle(spec, shuffle="block", block_size=1024, window=16)
    other = _with_shuffle(spec, shuffle="block", window=4)
    assert block.content_json() == explicit.content_json() != other.content_json() != spec.content_json()
    with pytest.raises(SpecError, match=r"sources\[0\]: .*window set, but they shape only shuffle: block"):
        _with_shuffle(spec, window=4)
    with pytest.raises(SpecError, match=r"sources\[0\]\.block_size"):
        _with_shuffle(spec, shuffle="block", block_size=0)
    with pytest.raises(SpecError, match=r"sources\[0\]\.shuffle: Input should be 'global' or 'block'"):
        _with_shuffle(spec, shuffle="blocks")


def test_plan_reports_shuffle_quality_and_read_amplification(tmp_path: Path, spec_of: Callable[..., Spec]) -> None:
    index = {"web": _table(_lengths(60_000), shards=6)}
    spec = spec_of(tmp_path, ["web"], seq_len=1024, steps=240, dp=8, micro_batches=4)
    glob = make_plan(spec, index=index)
    block_spec = _with_shuffle(spec, shuffle="block", block_size=256, window=8)
    block = make_plan(block_spec, index=index)
    assert block.meta.plan_id != glob.meta.plan_id
    g, b = glob.meta.summary["shuffle"]["web"], block.meta.summary["shuffle"]["web"]
    assert g["mode"] == "global" and (g["block_size"], g["window"]) == (1024, 16)
    assert b["mode"] == "block" and (b["block_size"], b["window"]) == (256, 8)
    assert g["segments"] > 45_000 and b["segments"] > 45_000
    # neither order trends with file order (the block order's correlation is that of a random order of its
    # 235 blocks: a standard deviation of about 1/sqrt(235)); the global one jumps a third of the source
    assert abs(g["spearman"]) < 0.02 and abs(b["spearman"]) < 3 / np.sqrt(235)
    assert 0.3 < g["mean_jump_share"] < 0.37
    # whole-block reads into an LRU of `window` blocks: the block shuffle fetches each block about once per
    # epoch; the global one fetches a 1024-document block for nearly every document
    assert 1.0 <= b["read_amplification"] < 1.1 and b["fetches_per_segment"] < 1.1 / 256
    assert g["read_amplification"] > 500 and g["fetches_per_segment"] > 0.5
    # the plan is still balanced and on mixture; the same inputs give the same bytes
    assert block.meta.summary["imbalance"]["loomdata"]["mean"] <= 1.03
    first = pc.files_of(block.plan_dir)
    shutil.rmtree(block.plan_dir)
    assert pc.files_of(make_plan(block_spec, index=index).plan_dir) == first


def test_block_shuffle_plans_every_token_once_per_epoch(tmp_path: Path, spec_of: Callable[..., Spec]) -> None:
    lengths = {"web": _lengths(3000, 1), "code": _lengths(800, 2)}
    index = {n: _table(ln, shards=3) for n, ln in lengths.items()}
    spec = _with_shuffle(
        spec_of(tmp_path, ["web", "code"], seq_len=512, steps=60, dp=4), shuffle="block", block_size=32, window=4
    )
    res = make_plan(spec, index=index)
    m = read_manifest(res.plan_dir, res.meta)
    images = {n: np.zeros_like(ln) for n, ln in lengths.items()}
    deferred = pq.read_table(res.plan_dir / "report" / "steps.parquet")["deferred_tokens"].to_numpy() > 0
    assert m["step"].to_numpy().max() == 59 and int(m["length"].to_numpy().sum()) > 2 * lengths["code"].sum()
    pc.check_coverage(res.meta, m, lengths, images, deferred)


def test_block_shuffle_replan_continues_the_stream(tmp_path: Path, spec_of: Callable[..., Spec]) -> None:
    """dp 4 -> 2 at step 15: steps before are the base's, the stream goes on, every token once per epoch.

    Look-ahead off: only then does a same-shape re-plan reproduce the base's bytes (look-ahead restarts at S)."""
    lengths = {"web": _lengths(3000, 3), "code": _lengths(900, 4)}
    index = {n: _table(ln, shards=4) for n, ln in lengths.items()}
    shuffle = {"shuffle": "block", "block_size": 50, "window": 3}

    def no_lookahead(s: Spec) -> Spec:
        return s.model_copy(update={"planning": s.planning.model_copy(update={"lookahead": 0})})

    base = make_plan(
        no_lookahead(_with_shuffle(spec_of(tmp_path, ["web", "code"], seq_len=512, steps=40, dp=4), **shuffle)),
        index=index,
    )
    same = no_lookahead(_with_shuffle(spec_of(tmp_path, ["web", "code"], seq_len=512, steps=40, dp=4), **shuffle))
    ext = make_plan(same, index=index, resume_from=PlanResume(plan_dir=base.plan_dir, at_step=15))
    assert read_manifest(ext.plan_dir, ext.meta).equals(read_manifest(base.plan_dir, base.meta))
    spec = no_lookahead(_with_shuffle(spec_of(tmp_path, ["web", "code"], seq_len=512, steps=44, dp=2), **shuffle))
    res = make_plan(spec, index=index, resume_from=PlanResume(plan_dir=base.plan_dir, at_step=15))
    meta = read_plan(res.plan_dir)
    assert read_manifest(res.plan_dir, meta, 0, 14).equals(read_manifest(base.plan_dir, base.meta, 0, 14))
    m = read_manifest(res.plan_dir, meta)
    deferred = pq.read_table(res.plan_dir / "report" / "steps.parquet")["deferred_tokens"].to_numpy() > 0
    pc.check_coverage(meta, m, lengths, {n: np.zeros_like(v) for n, v in lengths.items()}, deferred)
    # (a plan of ~300 web documents ends inside a window of 3 blocks, whose unused documents count)
    assert meta.summary["shuffle"]["web"]["read_amplification"] < 1.5
    # a different shuffle cannot continue the base's streams
    other = no_lookahead(
        _with_shuffle(spec_of(tmp_path, ["web", "code"], seq_len=512, steps=44, dp=2), shuffle="block")
    )
    with pytest.raises(PlanError, match="shuffle differs"):
        make_plan(other, index=index, resume_from=PlanResume(plan_dir=base.plan_dir, at_step=15))


@pytest.mark.parametrize("hi", [1, 2, 50, 5000])
def test_stable_ranks_are_the_inverse_of_a_stable_argsort(hi: int) -> None:
    """The Spearman ranks' counting sort (_shuffle_kernel.stable_ranks) against NumPy's stable argsort, the code it
    replaces where the positions' range is small: ties (repeated documents) keep their order."""
    rng = np.random.default_rng(hi)
    for m in [0, 1, 3, 1000]:
        p = rng.integers(0, hi, m).astype(np.int64)
        want = np.empty(m, dtype=np.float64)
        want[np.argsort(p, kind="stable")] = np.arange(m, dtype=np.float64)
        assert stable_ranks(p, hi).tobytes() == want.tobytes()


def _lru_misses(keys: np.ndarray, cap: int) -> np.ndarray:
    """Where a plain LRU cache of `cap` keys misses on the accesses `keys` (the reference)."""
    cache: OrderedDict[int, None] = OrderedDict()
    miss = []
    for key in keys.tolist():
        miss.append(key not in cache)
        cache[key] = None
        cache.move_to_end(key)
        if len(cache) > cap:
            cache.popitem(last=False)
    return np.array(miss, dtype=bool)


def _figures_before(layout: BlockLayout, doc: np.ndarray, length: np.ndarray, lengths: np.ndarray) -> tuple:
    """The read figures as shuffle_figures worked them out before session 14: NumPy (float64 block sums, summed
    in fetch order), with a plain LRU cache for the hits."""
    m = min(len(doc), _shuffle.FIGURE_SEGMENTS)
    p = layout.positions(doc[:m])
    seg_len = np.asarray(length[:m], dtype=np.float64)
    jump = float(np.abs(np.diff(p)).mean()) if m > 1 else 0.0
    amp = fetch = 0.0
    if m:
        blk = np.searchsorted(layout.starts, p, side="right") - 1
        miss = _lru_misses(blk, layout.window)
        stored = lengths if layout.order is None else lengths[layout.order]
        every = np.add.reduceat(stored.astype(np.float64), layout.starts[:-1])
        amp = float(every[blk[miss]].sum() / max(seg_len.sum(), 1.0))
        fetch = int(miss.sum()) / m
    return jump, jump / max(layout.num_docs, 1), amp, fetch


@pytest.mark.parametrize("shuffled_rows", [False, True])
@pytest.mark.parametrize(("block_size", "window"), [(1, 1), (3, 4), (64, 2), (1000, 16)])
def test_one_pass_read_figures_equal_the_numpy_ones_bit_for_bit(
    shuffled_rows: bool, block_size: int, window: int
) -> None:
    """shuffle_figures' compiled pass (block_reads) gives the very floats of the NumPy + Fenwick code it replaced,
    over stream-like draws (each document once, then again) and random ones with repeats, in shards of uneven runs."""
    from loomdata.schemas.spec import SourceSpec

    rng = np.random.default_rng(block_size * 7 + window)
    src = SourceSpec.model_validate({"name": "s", "format": "parquet", "paths": ["x"], "tokens_field": "t"})
    for n, shards in ((1, 1), (5, 2), (3000, 7), (20_000, 3)):
        lengths = rng.integers(1, 100_000, n).astype(np.uint32)
        table = _table(lengths, shards, shuffled_rows=shuffled_rows)
        layout = _layout(table, block_size, window)
        for doc in (
            rng.permutation(n),
            np.concatenate([rng.permutation(n), rng.permutation(n)]),
            rng.integers(0, n, 999),
        ):
            length = rng.integers(1, 5000, len(doc)).astype(np.uint32)
            got = _shuffle.shuffle_figures(src, layout, doc, length, lengths)
            want = _figures_before(layout, doc, length, lengths)
            assert (got.mean_jump_docs, got.mean_jump_share, got.read_amplification, got.fetches_per_segment) == want
            assert got.segments == min(len(doc), _shuffle.FIGURE_SEGMENTS)
            # the planner's form: the measured segments' tokens summed (a stream's count), no lengths
            tokens = int(length[: got.segments].sum(dtype=np.int64))
            assert _shuffle.shuffle_figures(src, layout, doc, None, lengths, tokens=tokens) == got


def test_block_reads_counts_an_lru_cache_and_sums_on_past_2_53() -> None:
    """block_reads' misses are a plain LRU cache's and its fetched tokens the fetched blocks' sums; past 2**53 it
    sums on in float64 (the figure then as the float64 code of before gave it)."""
    from loomdata.planning._shuffle_kernel import block_reads
    from loomdata.schemas.spec import SourceSpec

    rng = np.random.default_rng(5)
    starts = np.array([0, 2, 5, 6, 10], dtype=np.int64)
    none = np.zeros(0, dtype=np.int64)
    lengths = np.arange(1, 11, dtype=np.int64)
    for cap in (1, 2, 3, 5):
        p = rng.integers(0, 10, 500).astype(np.int64)
        blk = np.searchsorted(starts, p, side="right") - 1
        miss = _lru_misses(blk, cap)
        want = sum(int(lengths[starts[b] : starts[b + 1]].sum()) for b in blk[miss])
        for block in (1, 4, 9):  # 1: the guess overshoots (blocks larger than it said); 4 is right, 9 loose
            got = block_reads(p, starts, block, cap, lengths, none)
            assert got == (int(miss.sum()), float(want), int(np.abs(np.diff(p)).sum()))
    huge = np.full(10, 1 << 51, dtype=np.int64)
    p = np.arange(10, dtype=np.int64)
    assert block_reads(p, starts, 4, 1, huge, none)[1] == 10 * 2.0**51  # past 2**53 from the third block on
    layout = BlockLayout(starts, None, 4, 1)
    src = SourceSpec.model_validate({"name": "s", "format": "parquet", "paths": ["x"], "tokens_field": "t"})
    length = np.full(10, 7, dtype=np.uint32)
    got = _shuffle.shuffle_figures(src, layout, p, length, huge)
    assert got.read_amplification == _figures_before(layout, p, length, huge)[2] > 1e13
