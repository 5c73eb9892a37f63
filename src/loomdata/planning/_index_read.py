"""Reading one source's index table for planning: compact arrays, columns proven constant not decoded, a large
table's row groups read in parts on threads.

A plan keeps 4 bytes a sample of an index (num_tokens): a dense `sample` column (0..n-1, as `loom index` writes
it) and an all-zero `num_image_tokens` are checked batch by batch and not stored, and columns a row group's
statistics prove constant (its one shard; no image tokens) are not decoded there. Reading is Arrow's decoding,
which releases the GIL: a large table's row groups are cut into `parts` runs of about equal rows, each read on a
thread of its own (planning._threads.parallel) from its own handle on the file, and the parts' findings joined
(40M rows: the larger of two sources' reads is the serial part's longest index term on a cluster, issue 11).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loomdata.planning import _threads
from loomdata.planning._allocator import trim_arenas
from loomdata.schemas.layout import IndexFiles

__all__ = ["READ_PART_ROWS", "IndexColumns", "read_index"]

BATCH = 1 << 16
"""Rows read at a time from an index table."""

READ_PART_ROWS = 1 << 22
"""Rows a part of an index read on threads holds at least (a smaller table is read on the calling thread)."""


@dataclass(frozen=True)
class IndexColumns:
    """What a plan keeps of one source's index: num_tokens; the sample ids (None: dense, 0..n-1); the image tokens
    (None: none); the starts of its runs of one shard in row order, n appended (planning._shuffle)."""

    num_tokens: np.ndarray
    sample: np.ndarray | None
    images: np.ndarray | None
    runs: np.ndarray
    fingerprint: str


class _Group(NamedTuple):
    """A row group: its number, first row, rows, its one shard where statistics prove it (else None), and whether
    they prove it holds no image tokens."""

    number: int
    first: int
    rows: int
    shard: int | None
    no_images: bool


@dataclass
class _Part:
    """One part's findings from its first row `start` on: its rows' ids where they are not dense (else None), image
    tokens where it has any, the shards its first and last rows hold, and where its shard changes (global rows)."""

    start: int
    sample: np.ndarray | None
    images: np.ndarray | None
    first_shard: int | None
    last_shard: int | None
    changes: list[np.ndarray]


def read_index(workdir: Path, name: str, parts: int = 1) -> IndexColumns:
    """Source `name`'s index under `workdir`, its row groups read in up to `parts` parts on threads (at least
    READ_PART_ROWS rows a part): the same arrays whatever the parts."""
    files = IndexFiles.of(workdir, name)
    pf, fp = files.open_samples()  # checks the tables' kind, version and schema, once
    with contextlib.ExitStack() as handles:  # every handle closed once its part is read (or a part failed)
        handles.enter_context(pf)
        n = pf.metadata.num_rows
        groups = _groups(pf)
        in_groups = sum(g.rows for g in groups)
        if in_groups != n:
            raise AssertionError(f"index of source {name!r}: {in_groups} rows in its row groups, the footer says {n}")
        tokens = np.empty(n, dtype=np.uint32)
        cuts = _cut(groups, max(1, min(parts, n // READ_PART_ROWS)))
        tasks = []
        for t, g in enumerate(cuts):
            handle = pf if t == 0 else handles.enter_context(pq.ParquetFile(str(files.samples), metadata=pf.metadata))
            tasks.append(functools.partial(_read_part, handle, g, tokens, name))
        found: list[_Part] = _threads.parallel(tasks)
    if len(tasks) > 1:  # what the parts' threads freed, given back (kept, it raised a 10M-row plan's peak by 25 MB)
        pa.default_memory_pool().release_unused()
        trim_arenas()
    return IndexColumns(tokens, *_joined(found, cuts, n), runs=_runs(found, n), fingerprint=fp)


def _groups(pf: pq.ParquetFile) -> list[_Group]:
    """Every row group with what its statistics prove. Proof: no nulls and min == max (== 0 for images: min too,
    so statistics of unsigned values kept in signed order, where a large value reads negative, never pass).
    Decoding those two columns is about a third of reading an index table."""
    md = pf.metadata
    names = md.schema.names
    shard_col, image_col = names.index("shard"), names.index("num_image_tokens")
    out: list[_Group] = []
    at = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        shard, zero = _constant(rg.column(shard_col).statistics), _constant(rg.column(image_col).statistics)
        out.append(_Group(g, at, rg.num_rows, shard, zero == 0))
        at += rg.num_rows
    return out


def _constant(st: pq.Statistics | None) -> int | None:
    """The one value of a column chunk whose statistics prove it holds one non-null integer, else None."""
    if st is None or not st.has_min_max or not st.has_null_count or st.null_count != 0:
        return None
    lo, hi = st.min, st.max
    return int(lo) if isinstance(lo, int) and lo == hi else None


def _cut(groups: list[_Group], parts: int) -> list[list[_Group]]:
    """`groups` as up to `parts` runs of consecutive groups of about equal rows: a group goes to the part its middle
    row falls in, and no part holds no rows (0-row groups go with the rows beside them; a table of no rows is one
    part; none for no groups)."""
    if not groups:
        return []
    rows = np.array([g.rows for g in groups], dtype=np.int64)
    total = int(rows.sum())
    if parts <= 1 or len(groups) <= 1 or total == 0:
        return [groups]
    starts = np.concatenate([[0], np.cumsum(rows)])
    twice_middles = starts[:-1] + starts[1:]  # nondecreasing, as the goals are
    goals = 2 * (total * np.arange(1, parts, dtype=np.int64) // parts)
    bounds = [0]
    for b in np.searchsorted(twice_middles, goals, side="left").tolist():
        if starts[bounds[-1]] < starts[b] < total:  # rows before it in this part, and rows after it
            bounds.append(b)
    bounds.append(len(groups))
    return [groups[a:b] for a, b in itertools.pairwise(bounds)]


def _read_part(pf: pq.ParquetFile, groups: list[_Group], tokens: np.ndarray, name: str) -> _Part:
    """Read `groups` (consecutive) into tokens at their rows; runs of groups read alike (the same columns proven
    constant) go through one iter_batches. Rows read other than the groups' (the footer's) raise AssertionError,
    and none is written past its run's rows (another part's are written on another thread)."""
    first_row = groups[0].first
    part = _Part(first_row, None, None, None, None, [])
    rows = sum(g.rows for g in groups)
    last: int | None = None
    runs: list[list[_Group]] = []
    for g in groups:
        if runs and (runs[-1][-1].shard is None) == (g.shard is None) and runs[-1][-1].no_images == g.no_images:
            runs[-1].append(g)
        else:
            runs.append([g])
    for run in runs:
        at = run[0].first
        proven, no_images = run[0].shard is not None, run[0].no_images
        cols = ["sample", "num_tokens", *([] if proven else ["shard"]), *([] if no_images else ["num_image_tokens"])]
        if proven:  # each group's one shard, from its statistics
            for g in run:
                if g.rows == 0:
                    continue
                if last is not None and g.shard != last:
                    part.changes.append(np.array([g.first], dtype=np.int64))
                if part.first_shard is None:
                    part.first_shard = g.shard
                last = g.shard
        groups_of_run = [g.number for g in run]
        end = run[-1].first + run[-1].rows
        for batch in pf.iter_batches(batch_size=BATCH, row_groups=groups_of_run, columns=cols, use_threads=False):
            b = at + batch.num_rows
            if b > end:  # more rows than the footer says: raised below, none written past the run's
                at = b
                break
            tokens[at:b] = batch.column("num_tokens").to_numpy()
            ids = batch.column("sample").to_numpy()
            if (
                part.sample is None
                and len(ids)
                and not (ids[0] == at and ids[-1] == b - 1 and (np.diff(ids) == 1).all())
            ):
                part.sample = np.empty(rows, dtype=np.uint64)
                part.sample[: at - first_row] = np.arange(first_row, at, dtype=np.uint64)
            if part.sample is not None:
                part.sample[at - first_row : b - first_row] = ids
            if not proven:
                sh = batch.column("shard").to_numpy()
                if len(sh):
                    if last is not None and int(sh[0]) != last:
                        part.changes.append(np.array([at], dtype=np.int64))
                    if part.first_shard is None:
                        part.first_shard = int(sh[0])
                    part.changes.append(np.flatnonzero(sh[1:] != sh[:-1]).astype(np.int64) + at + 1)
                    last = int(sh[-1])
            if not no_images:
                img = batch.column("num_image_tokens").to_numpy()
                if part.images is None and img.any():
                    part.images = np.zeros(rows, dtype=np.uint32)
                if part.images is not None:
                    part.images[at - first_row : b - first_row] = img
            at = b
        if at != end:
            raise AssertionError(
                f"index of source {name!r}: {at - run[0].first} rows read in row groups {run[0].number}.."
                f"{run[-1].number}, the footer says {end - run[0].first}"
            )
    part.last_shard = last
    return part


def _joined(found: list[_Part], cuts: list[list[_Group]], n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The whole table's sample ids (None: dense throughout) and image tokens (None: none) from its parts'."""
    spans = [(c[0].first, c[-1].first + c[-1].rows) for c in cuts]
    sample = images = None
    if any(p.sample is not None for p in found):
        sample = np.empty(n, dtype=np.uint64)
        for p, (a, b) in zip(found, spans, strict=True):
            sample[a:b] = np.arange(a, b, dtype=np.uint64) if p.sample is None else p.sample
    if any(p.images is not None for p in found):
        images = np.zeros(n, dtype=np.uint32)
        for p, (a, b) in zip(found, spans, strict=True):
            if p.images is not None:
                images[a:b] = p.images
    return sample, images


def _runs(found: list[_Part], n: int) -> np.ndarray:
    """Starts of the runs of one shard (rows are in (shard, row) order), n appended: each part's changes, and one
    where a part's first shard differs from the part's before."""
    changes: list[np.ndarray] = []
    last: int | None = None
    for p in found:
        if p.first_shard is None:  # (a part of empty groups only)
            continue
        if last is not None and p.first_shard != last:
            changes.append(np.array([p.start], dtype=np.int64))
        changes.extend(p.changes)
        last = p.last_shard
    return np.concatenate([[0], *changes, [n]]).astype(np.int64) if n else np.zeros(1, dtype=np.int64)
