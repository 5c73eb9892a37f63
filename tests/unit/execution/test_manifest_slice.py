"""ManifestSlice: a constructor's ranks' rows per step, in (dp_rank, micro_batch) order, chunk by chunk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loomdata.execution._manifest import ManifestSlice
from loomdata.schemas import MANIFEST_SCHEMA, ManifestFile, PlanMeta, TableKind, write_table
from loomtest.plancheck import plan_meta


def _plan(tmp: Path, steps: int = 10, ranks: int = 3, mbs: int = 2) -> PlanMeta:
    rows: dict[str, list[int]] = {c: [] for c in MANIFEST_SCHEMA.names}
    sample = 0
    for step in range(steps):
        for r in range(ranks):
            for mb in range(mbs):
                for k in range(1 + (step + r + mb) % 3):  # 1-3 segments, in sequence order
                    for c, v in zip(MANIFEST_SCHEMA.names, (step, r, mb, k % 2, sample, 0, 5, 0), strict=True):
                        rows[c].append(v)
                    sample += 1
    table = pa.table({c: pa.array(rows[c], MANIFEST_SCHEMA.field(c).type) for c in MANIFEST_SCHEMA.names})
    files = []
    for first in range(0, steps, 4):  # several manifest files, step ranges not aligned with chunks
        last = min(first + 3, steps - 1)
        part = table.filter(pc.and_(pc.greater_equal(table["step"], first), pc.less_equal(table["step"], last)))
        rel = f"manifest/steps-{first}-{last}.parquet"
        write_table(part, tmp / rel, TableKind.MANIFEST)
        files.append(ManifestFile(path=rel, first_step=first, last_step=last, rows=part.num_rows))
    return plan_meta(
        sources=["a", "b"],
        index_fingerprints={},
        seed=0,
        steps=steps,
        dp_size=ranks,
        micro_batches=mbs,
        seq_len=64,
        manifest=files,
    )


def test_rows_of_a_step_for_the_slice_ranks(tmp_path: Path) -> None:
    meta = _plan(tmp_path)
    sl = ManifestSlice(tmp_path, meta, [2, 1], chunk_steps=3, keep=1)
    for step in range(meta.steps):
        rows = sl.rows(step)
        assert (rows.step == step).all()
        assert set(rows.dp_rank.tolist()) == {1, 2}
        key = rows.dp_rank.astype(int) * 10 + rows.micro_batch.astype(int)
        assert (np.diff(key) >= 0).all()
        assert (np.diff(rows.sample.astype(np.int64)) > 0).all()  # stored sequence order kept
        assert len(rows) == sum(1 + (step + r + mb) % 3 for r in (1, 2) for mb in range(2))
    only = sl.rows(4, [1])
    assert set(only.dp_rank.tolist()) == {1} and sl.cached(4) and not sl.cached(0)


def test_rows_of_some_ranks_are_the_filtered_rows_of_all(tmp_path: Path) -> None:
    meta = _plan(tmp_path, ranks=4)
    sl = ManifestSlice(tmp_path, meta, [0, 1, 2, 3], chunk_steps=2, keep=2, chunk_rows=50)
    for step in range(meta.steps):
        whole = sl.rows(step)
        for ranks in ([0], [3], [1, 2], [3, 0], [0, 2, 3]):
            got = sl.rows(step, ranks)
            keep = np.isin(whole.dp_rank, ranks)
            for c in MANIFEST_SCHEMA.names:
                assert np.array_equal(getattr(got, c), getattr(whole, c)[keep]), (step, ranks, c)


def test_chunk_rows_widens_the_chunk_to_hold_that_many_rows(tmp_path: Path) -> None:
    meta = _plan(tmp_path, steps=10, ranks=3)  # 10 steps, about 12 rows per step
    sl = ManifestSlice(tmp_path, meta, [0, 1, 2], chunk_steps=2, keep=1, chunk_rows=60)
    sl.rows(0)
    assert sl.cached(4) and not sl.cached(6)  # ~60 rows: 5 steps per chunk (not 2)


def test_keep_steps_keeps_the_chunks_a_window_spans_counted_in_chunks_read(tmp_path: Path) -> None:
    """A window of 8 steps over chunks widened to 5 steps spans 2 chunks: 4 kept, not 2 + 8 // 2 = 6."""
    meta = _plan(tmp_path, steps=30, ranks=3)
    sl = ManifestSlice(tmp_path, meta, [0, 1, 2], chunk_steps=2, chunk_rows=60, keep_steps=8)
    for step in range(0, 30, 5):
        sl.rows(step)
    assert [sl.cached(s) for s in range(0, 30, 5)] == [False, False, True, True, True, True]
    narrow = ManifestSlice(tmp_path, meta, [0, 1, 2], chunk_steps=2, keep_steps=8)  # 2-step chunks: 2 + 4 kept
    for step in range(0, 30, 2):
        narrow.rows(step)
    assert sum(narrow.cached(s) for s in range(0, 30, 2)) == 6


def test_source_span_rows_match_the_manifest_and_are_read_once_per_process(tmp_path: Path) -> None:
    from loomdata.execution import _manifest
    from loomdata.schemas import read_manifest

    meta = _plan(tmp_path)
    _manifest.clear_spans()
    whole = read_manifest(tmp_path, meta, 2, 8)
    for source in (0, 1):
        step, sample = _manifest.source_span(tmp_path, meta, 2, 8, source)
        mine = whole.filter(pc.equal(whole["source"], source))
        want = sorted(
            zip(mine["step"].to_pylist(), range(mine.num_rows), mine["sample"].to_pylist(), strict=True)
        )  # step order, stored order within a step
        assert step.tolist() == [w[0] for w in want]
        assert sample.tolist() == [w[2] for w in want]
        assert sample.dtype == np.uint64 and not sample.flags.writeable  # shared: read-only views
    assert len(_manifest._SPANS) == 1  # both sources came from one read
    a = _manifest.source_span(tmp_path, meta, 2, 8, 0)[1]
    assert np.shares_memory(a, _manifest._SPANS[next(iter(_manifest._SPANS))].rows.sample)  # type: ignore[union-attr]
    step, sample = _manifest.source_span(tmp_path, meta, 2, 8, 5)  # a source id with no rows
    assert len(step) == len(sample) == 0
    for first in range(0, 40, 10):  # at most _SPAN_KEEP spans kept
        _manifest.source_span(tmp_path, meta, first, first + 9, 0)
    assert len(_manifest._SPANS) == _manifest._SPAN_KEEP
    _manifest.clear_spans()


def test_a_failed_span_read_raises_for_every_caller_and_is_read_again(tmp_path: Path) -> None:
    from loomdata.execution import _manifest
    from loomdata.schemas import ContractError

    meta = _plan(tmp_path)
    _manifest.clear_spans()
    moved = tmp_path / "manifest" / "steps-0-3.parquet"
    moved.rename(tmp_path / "aside.parquet")
    for _ in range(2):
        try:
            _manifest.source_span(tmp_path, meta, 0, 3, 0)
        except ContractError as e:
            assert "steps-0-3.parquet: no such manifest table" in str(e)
        else:
            raise AssertionError("a missing manifest partition was not reported")
    assert not _manifest._SPANS  # the failure is not kept
    (tmp_path / "aside.parquet").rename(moved)
    step, _ = _manifest.source_span(tmp_path, meta, 0, 3, 1)
    assert len(step) and set(step.tolist()) <= {0, 1, 2, 3}
    _manifest.clear_spans()


def test_read_manifest_selects_steps_ranks_and_columns_across_partitions(tmp_path: Path) -> None:
    from loomdata.schemas import read_manifest

    meta = _plan(tmp_path)
    whole = pa.concat_tables(pq.read_table(tmp_path / f.path) for f in meta.manifest)
    for first, last, ranks, cols in [(0, None, None, None), (2, 6, [2, 0], None), (3, 3, [1], ["sample", "lane"])]:
        got = read_manifest(tmp_path, meta, first, last, dp_ranks=ranks, columns=cols)
        hi = meta.steps - 1 if last is None else last
        keep = pc.and_(pc.greater_equal(whole["step"], first), pc.less_equal(whole["step"], hi))
        if ranks is not None:
            keep = pc.and_(keep, pc.is_in(whole["dp_rank"], pa.array(ranks, pa.uint32())))
        want = whole.filter(keep).select(cols or MANIFEST_SCHEMA.names)
        assert got.to_pydict() == want.to_pydict() and got.schema.types == want.schema.types
    assert read_manifest(tmp_path, meta, 100, 120).num_rows == 0
    assert read_manifest(tmp_path, meta, 0, 9, dp_ranks=[7], columns=["step"]).column_names == ["step"]


def test_rows_of_a_build_group_are_each_steps_rows_end_to_end(tmp_path: Path) -> None:
    """`rows_of` (a build group's rows as one slice of a chunk where it can) gives `rows` of every (step, ranks) laid
    end to end, and where each starts: runs across chunk boundaries, gaps, repeated steps and rank subsets."""
    from loomdata.execution._manifest import ManifestRows

    meta = _plan(tmp_path, steps=14, ranks=3)
    sl = ManifestSlice(tmp_path, meta, [0, 1, 2], chunk_steps=3, keep=2)
    rng = np.random.default_rng(0)
    for _ in range(40):
        work: list[tuple[int, list[int]]] = []
        step = int(rng.integers(0, meta.steps))
        for _ in range(int(rng.integers(1, 9))):
            all_ranks = rng.random() < 0.7
            ranks = (
                [0, 1, 2] if all_ranks else sorted(rng.choice(3, size=int(rng.integers(1, 3)), replace=False).tolist())
            )
            work.append((step, ranks if rng.random() < 0.8 else ranks[::-1]))
            step = min(meta.steps - 1, step + int(rng.choice([0, 1, 1, 1, 2])))
        got, bounds = sl.rows_of(work)
        want = [sl.rows(st, rk) for st, rk in work]
        assert bounds.tolist() == np.concatenate([[0], np.cumsum([len(w) for w in want])]).tolist()
        both = ManifestRows.concat(want)
        for c in MANIFEST_SCHEMA.names:
            assert np.array_equal(getattr(got, c), getattr(both, c)), c
