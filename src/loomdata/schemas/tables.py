"""Arrow schemas of the stored tables (index, shards, errors, manifest, a plan's report), versioned.

Every table loomdata writes carries `loomdata.kind` and `loomdata.version` in its Parquet
key-value metadata; `read_table` rejects a wrong kind, version or schema with a message that
names the file and what differs.

Index version 2 adds `checksum` (per-sample, see sources/_integrity), which the index job always
writes and loaders verify against. It is optional in the schema (checked for its type when present):
the planner never reads it, and hand-made index tables (tests, tools) may leave it out.

Tables sorted by `step` (manifests, a plan's report tables) are read by step range: `iter_steps` /
`read_steps` open only the row groups whose step statistics overlap the range, with column projection
(`ReadCount` tallies what was read); `open_table` checks a file once and hands out its footer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loomdata.schemas.errors import ContractError

__all__ = [
    "CHECKSUM_FIELD",
    "ERRORS_SCHEMA",
    "INDEX_COLUMNS",
    "INDEX_SCHEMA",
    "LAYOUTS_SCHEMA",
    "MANIFEST_SCHEMA",
    "PLAN_RANKS_SCHEMA",
    "PLAN_SOURCES_SCHEMA",
    "PLAN_STEPS_SCHEMA",
    "PLAN_WEIGHTS_SCHEMA",
    "SHARDS_SCHEMA",
    "ReadCount",
    "TableKind",
    "check_schema",
    "iter_steps",
    "open_table",
    "read_filtered",
    "read_steps",
    "read_table",
    "stamped_metadata",
    "step_span",
    "synthetic_index",
    "synthetic_shards",
    "table_metadata",
    "write_table",
    "write_table_parts",
]


class TableKind(str, enum.Enum):
    """The kinds of stored table; each has a schema and a format version."""

    INDEX = "index"
    SHARDS = "shards"
    ERRORS = "errors"
    MANIFEST = "manifest"
    PLAN_STEPS = "plan_steps"
    PLAN_RANKS = "plan_ranks"
    PLAN_SOURCES = "plan_sources"
    PLAN_WEIGHTS = "plan_weights"
    LAYOUTS = "layouts"


INDEX_SCHEMA = pa.schema(
    [
        pa.field("sample", pa.uint64(), nullable=False),  # dense 0..n-1 in (shard, row) order
        pa.field("shard", pa.uint32(), nullable=False),  # into shards.parquet
        pa.field("row", pa.uint64(), nullable=False),  # row, record or byte offset inside the shard
        # Length of the sample's token stream: text tokens plus image placeholder tokens.
        pa.field("num_tokens", pa.uint32(), nullable=False),
        pa.field("num_image_tokens", pa.uint32(), nullable=False),  # of num_tokens, how many are image tokens
    ]
)
"""Required columns of an index table; carried metadata columns follow them."""

CHECKSUM_FIELD = pa.field("checksum", pa.uint32(), nullable=False)
"""Per-sample checksum of the token stream; follows INDEX_SCHEMA's columns in every stored index."""

INDEX_COLUMNS: tuple[str, ...] = (*INDEX_SCHEMA.names, CHECKSUM_FIELD.name)
"""Every column name an index itself owns (metadata columns may not take these names)."""

SHARDS_SCHEMA = pa.schema(
    [
        pa.field("shard", pa.uint32(), nullable=False),
        pa.field("path", pa.string(), nullable=False),
        pa.field("size_bytes", pa.uint64(), nullable=False),
        pa.field("mtime_ns", pa.int64(), nullable=False),
        pa.field("fingerprint", pa.string(), nullable=False),
        pa.field("num_rows", pa.uint64(), nullable=False),
    ]
)


def synthetic_index(lengths: np.ndarray | Sequence[int], images: np.ndarray | Sequence[int] | None = None) -> pa.Table:
    """An index table (INDEX_SCHEMA's columns) of samples with these token counts (and image tokens), all in shard 0,
    rows 0..n-1: what the planner reads of an index, for a plan with no data files behind it (its workers' warm-up,
    tests, benchmarks)."""
    n = len(lengths)
    img = np.zeros(n, dtype=np.uint32) if images is None else np.asarray(images, dtype=np.uint32)
    return pa.table(
        {
            "sample": pa.array(np.arange(n, dtype=np.uint64)),
            "shard": pa.array(np.zeros(n, dtype=np.uint32)),
            "row": pa.array(np.arange(n, dtype=np.uint64)),
            "num_tokens": pa.array(np.asarray(lengths, dtype=np.uint32)),
            "num_image_tokens": pa.array(img),
        }
    )


def synthetic_shards(rows: int) -> pa.Table:
    """The shards table (SHARDS_SCHEMA) of synthetic_index's one shard of `rows` rows."""
    return pa.table(
        {
            "shard": pa.array([0], pa.uint32()),
            "path": pa.array(["synthetic"]),
            "size_bytes": pa.array([0], pa.uint64()),
            "mtime_ns": pa.array([0], pa.int64()),
            "fingerprint": pa.array(["synthetic"]),
            "num_rows": pa.array([rows], pa.uint64()),
        },
        schema=SHARDS_SCHEMA,
    )


LAYOUTS_SCHEMA = pa.schema(
    [
        pa.field("shard", pa.uint32(), nullable=False),  # into shards.parquet
        pa.field("fingerprint", pa.string(), nullable=False),  # the shard's, as shards.parquet holds it when indexed
        pa.field("layout", pa.binary(), nullable=False),  # the format's layout (Parquet: the footer, serialized)
    ]
)
"""layouts.parquet, beside an index of object shards: what a reader learns from a shard's footer, so a loader opens
the object with no footer read (shards the index job saw a layout of; a shard without a row reads its footer)."""

ERRORS_SCHEMA = pa.schema(
    [
        pa.field("path", pa.string(), nullable=False),
        pa.field("row", pa.int64(), nullable=True),  # null: the whole shard was skipped
        pa.field("message", pa.string(), nullable=False),
    ]
)

MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("step", pa.uint32(), nullable=False),
        pa.field("dp_rank", pa.uint32(), nullable=False),
        pa.field("micro_batch", pa.uint32(), nullable=False),
        pa.field("source", pa.uint16(), nullable=False),  # id into plan.json `sources`
        pa.field("sample", pa.uint64(), nullable=False),
        pa.field("offset", pa.uint32(), nullable=False),  # first token of the sample used
        pa.field("length", pa.uint32(), nullable=False),  # tokens placed
        pa.field("lane", pa.uint8(), nullable=False),  # 0: short context, 1: long context
    ]
)
"""One row per document segment placed in a packed sequence, sorted by (step, dp_rank, micro_batch)."""

PLAN_STEPS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.uint32(), nullable=False),
        pa.field("tokens", pa.int64(), nullable=False),  # placed in the step
        pa.field("lb", pa.float64(), nullable=False),  # lower bound max(total cost / dp, largest segment)
        pa.field("loom_max", pa.float64(), nullable=False),  # most loaded rank's cost, loomdata
        pa.field("loom_mean", pa.float64(), nullable=False),
        pa.field("concat_max", pa.float64(), nullable=False),  # the same for the concat-and-chunk baseline
        pa.field("concat_mean", pa.float64(), nullable=False),
        pa.field("packed_max", pa.float64(), nullable=False),  # the same for the packed baseline
        pa.field("packed_mean", pa.float64(), nullable=False),
        pa.field("base_max", pa.float64(), nullable=False),  # the stronger baseline: min(concat_max, packed_max)
        pa.field("mb_spread", pa.float64(), nullable=False),  # micro-batch spread (1.0: as even as possible)
        pa.field("pp_time", pa.float64(), nullable=False),  # 1F1B step time with loomdata's micro-batches
        pa.field("pp_time_even", pa.float64(), nullable=False),  # the same with even micro-batches per rank
        pa.field("packed_waiting_tokens", pa.float64(), nullable=False),  # left by the packed baseline
        pa.field("deferred_tokens", pa.float64(), nullable=False),  # into the next step
    ]
)
"""report/steps.parquet, one row per step; `budget` (int64, the step's token budget) follows in re-plans. Plans of
planner version 8 and earlier also hold per source `tokens__<name>` (int64) and `weight__<name>` (float64) here;
version 9 keeps them in report/sources.parquet and report/weights.parquet."""

PLAN_SOURCES_SCHEMA = pa.schema(
    [
        pa.field("step", pa.uint32(), nullable=False),
        pa.field("source", pa.uint16(), nullable=False),  # id into plan.json `sources`
        pa.field("tokens", pa.int64(), nullable=False),  # the source's tokens placed in the step (never 0)
    ]
)
"""report/sources.parquet (planner version 9): one row per (step, source) that places tokens, sorted by (step,
source); a cell not listed placed none."""

PLAN_WEIGHTS_SCHEMA = pa.schema([pa.field("step", pa.uint32(), nullable=False)])
"""report/weights.parquet (planner version 9): per source `weight__<name>` (float64) follows; one row at the first
step and at every step whose target weights differ from the step before's (a step's weights are its row's, the
last at or before it): one row for a fixed mixture."""

PLAN_RANKS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.uint32(), nullable=False),
        pa.field("dp_rank", pa.uint32(), nullable=False),
        pa.field("loom_cost", pa.float64(), nullable=False),
        pa.field("concat_cost", pa.float64(), nullable=False),
        pa.field("packed_cost", pa.float64(), nullable=False),
    ]
)
"""report/ranks.parquet: the cost of every rank in a plan's first steps (the plot's heatmaps)."""

_SCHEMAS: dict[TableKind, pa.Schema] = {
    TableKind.INDEX: INDEX_SCHEMA,
    TableKind.SHARDS: SHARDS_SCHEMA,
    TableKind.ERRORS: ERRORS_SCHEMA,
    TableKind.MANIFEST: MANIFEST_SCHEMA,
    TableKind.PLAN_STEPS: PLAN_STEPS_SCHEMA,
    TableKind.PLAN_RANKS: PLAN_RANKS_SCHEMA,
    TableKind.PLAN_SOURCES: PLAN_SOURCES_SCHEMA,
    TableKind.PLAN_WEIGHTS: PLAN_WEIGHTS_SCHEMA,
    TableKind.LAYOUTS: LAYOUTS_SCHEMA,
}
VERSIONS: dict[TableKind, int] = {**{k: 1 for k in TableKind}, TableKind.INDEX: 2}
_OPTIONAL: dict[TableKind, list[pa.Field]] = {TableKind.INDEX: [CHECKSUM_FIELD]}
"""Columns a table of the kind may have, with this exact type when it does."""

_KIND = b"loomdata.kind"
_VERSION = b"loomdata.version"


def check_schema(table: pa.Table | pa.Schema, kind: TableKind, where: str) -> None:
    """Raise ContractError unless `table` has the required columns of `kind` with their exact types."""
    schema = table if isinstance(table, pa.Schema) else table.schema
    problems = []
    optional = {f.name for f in _OPTIONAL.get(kind, [])}
    for field in [*_SCHEMAS[kind], *_OPTIONAL.get(kind, [])]:
        idx = schema.get_field_index(field.name)
        if idx < 0 and field.name in optional:
            continue
        if idx < 0:
            problems.append(f"missing column {field.name!r} ({field.type})")
        elif schema.field(idx).type != field.type:
            problems.append(f"column {field.name!r} is {schema.field(idx).type}, expected {field.type}")
    if problems:
        raise ContractError(f"{where}: not a valid {kind.value} table: " + "; ".join(problems))


_SPLIT: frozenset[TableKind] = frozenset(
    {TableKind.MANIFEST, TableKind.PLAN_STEPS, TableKind.PLAN_SOURCES, TableKind.PLAN_WEIGHTS}
)
"""Kinds written without dictionaries, every integer and floating column BYTE_STREAM_SPLIT (each value's bytes
regrouped by position, then zstd): the planner's big tables (planner version 8; the report's sources and weights
tables of version 9 too). Their integers are small
(high bytes all zero) or repeat, so zstd squeezes the split streams as well as dictionaries did or better, in 0.4
to 0.7 of the time: a 262K-row manifest partition 26-28 -> 11.4 ms and 1.35-1.38 -> 1.25-1.32 MB, a 13,617-step
row group of the report's steps table with 300 sources (615 columns) 169 -> 113 ms and 4.2 -> 3.1 MB (pyarrow 26,
this machine; session 15 in docs/planning.md). Integer BYTE_STREAM_SPLIT needs pyarrow 16 or later to write and
read (hence the project's floor); other engines read it only where they implement it. The values are the same.
(Planner version 7 wrote the manifest with dictionaries for every column but `sample`.) Index tables
(_SPLIT_NUMBERS) split their number columns too but keep a dictionary for any other (a carried string column repeats);
other kinds keep a dictionary for every column."""

_SPLIT_NUMBERS: frozenset[TableKind] = frozenset({TableKind.INDEX})
"""Kinds whose integer and floating columns are written BYTE_STREAM_SPLIT, their other columns with a dictionary:
an index's numbers barely repeat (`sample` and `row` count up, `num_tokens` and `checksum` vary), so dictionaries
failed over to plain pages after building a dictionary for nothing. A 10M-row index table (500 shards, lognormal
lengths, checksums) wrote in 0.43 instead of 0.95 CPU-s, took 58 instead of 94 MB, and the planner's four columns
read in 0.10 instead of 0.21 CPU-s (`sample` 0.13 -> 0.03; pyarrow 26, this machine, session 27). Indexes written
before are read as they are (encodings are the reader's business)."""


def write_table(
    table: pa.Table,
    path: str | Path,
    kind: TableKind,
    extra_metadata: Mapping[str, str] | None = None,
    row_group_size: int | None = None,
) -> None:
    """Write `table` as Parquet (zstd) with its kind and version stamped in the metadata, encoded as `_options`
    says for its kind."""
    check_schema(table, kind, str(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        _stamped(table, kind, extra_metadata), str(path), row_group_size=row_group_size, **_options(table, kind)
    )


def write_table_parts(
    parts: Iterable[pa.Table], path: str | Path, kind: TableKind, extra_metadata: Mapping[str, str] | None = None
) -> None:
    """write_table of the parts laid end to end, a row group each, without the whole table ever in memory (one
    part: the same bytes as write_table)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    writer: pq.ParquetWriter | None = None
    try:
        for part in parts:
            check_schema(part, kind, str(path))
            stamped = _stamped(part, kind, extra_metadata)
            if writer is None:
                writer = pq.ParquetWriter(str(path), stamped.schema, **_options(part, kind))
            writer.write_table(stamped)
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise ValueError(f"no rows to write to {path}: write_table_parts needs at least one part")


def _stamped(table: pa.Table, kind: TableKind, extra_metadata: Mapping[str, str] | None) -> pa.Table:
    """`table` with its kind and version (and `extra_metadata` under loomdata.*) in its schema's metadata."""
    meta = dict(table.schema.metadata or {})
    meta[_KIND] = kind.value.encode()
    meta[_VERSION] = str(VERSIONS[kind]).encode()
    for k, v in (extra_metadata or {}).items():
        meta[f"loomdata.{k}".encode()] = v.encode()
    return table.replace_schema_metadata(meta)


def _options(table: pa.Table, kind: TableKind) -> dict[str, Any]:
    """The Parquet writer options of every loomdata table: zstd, statistics, the Arrow schema stored; for the
    kinds in _SPLIT no dictionaries and their integer and floating columns BYTE_STREAM_SPLIT (any other column,
    an extra one a table may carry, plain), for _SPLIT_NUMBERS the same numbers split and a dictionary for any
    other column, for the others a dictionary for every column."""
    if kind in _SPLIT or kind in _SPLIT_NUMBERS:
        split = {f.name: "BYTE_STREAM_SPLIT" for f in table.schema if _splittable(f.type)}
        return {
            "compression": "zstd",
            "use_dictionary": False if kind in _SPLIT else [f.name for f in table.schema if f.name not in split],
            "column_encoding": split,
            "write_statistics": True,
            "store_schema": True,
        }
    return {
        "compression": "zstd",
        "use_dictionary": list(table.column_names),
        "write_statistics": True,
        "store_schema": True,
    }


def _splittable(t: pa.DataType) -> bool:
    """Whether a column of Arrow type `t` is written BYTE_STREAM_SPLIT: numbers only (pyarrow refuses bool, strings
    and dictionaries; any other type is written plain)."""
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def stamped_metadata(schema: pa.Schema) -> dict[str, str]:
    """The `loomdata.*` key-value metadata of a table's schema (keys without the prefix)."""
    meta = schema.metadata or {}
    return {k.decode()[len("loomdata.") :]: v.decode() for k, v in meta.items() if k.startswith(b"loomdata.")}


def table_metadata(path: str | Path) -> dict[str, str]:
    """The `loomdata.*` key-value metadata of a stored table (keys without the prefix)."""
    return stamped_metadata(pq.read_schema(str(path)))


def _check_stamp(schema: pa.Schema, kind: TableKind, p: Path) -> None:
    """ContractError unless `schema` (a stored table's) is stamped `kind` at the supported version, with its columns."""
    meta = schema.metadata or {}
    got_kind = meta.get(_KIND, b"").decode()
    got_version = meta.get(_VERSION, b"").decode()
    if got_kind != kind.value:
        raise ContractError(f"{p}: expected a loomdata {kind.value} table, found kind {got_kind or 'none'!r}")
    if got_version != str(VERSIONS[kind]):
        raise ContractError(
            f"{p}: {kind.value} table format version {got_version or 'none'} is not supported "
            f"(this loomdata reads version {VERSIONS[kind]}); rebuild it with this version of loomdata"
        )
    check_schema(schema, kind, str(p))


def open_table(path: str | Path, kind: TableKind) -> pq.ParquetFile:
    """A stored table opened once (its footer read once), its kind, version and schema checked: for readers
    that take columns, row groups or metadata from one file without reading its footer again."""
    p = Path(path)
    if not p.exists():
        raise ContractError(f"{p}: no such {kind.value} table")
    try:
        pf = pq.ParquetFile(str(p), memory_map=False, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as e:
        raise ContractError(f"{p}: not a readable Parquet file ({e})") from None
    try:
        _check_stamp(pf.schema_arrow, kind, p)
    except BaseException:
        pf.close()  # (refused: the caller never sees the handle to close it)
        raise
    return pf


def read_table(
    path: str | Path,
    kind: TableKind,
    columns: list[str] | None = None,
    filters: list[tuple[str, str, object]] | None = None,
) -> pa.Table:
    """Read a stored table (its `columns`, rows passing `filters`), rejecting a wrong kind, version or schema."""
    p = Path(path)
    if not p.exists():
        raise ContractError(f"{p}: no such {kind.value} table")
    try:
        schema = pq.read_schema(str(p))
    except (pa.ArrowInvalid, OSError) as e:
        raise ContractError(f"{p}: not a readable Parquet file ({e})") from None
    _check_stamp(schema, kind, p)
    if filters is not None and any(op not in _COMPARE for _, op, _ in filters):
        return pq.read_table(str(p), columns=columns, filters=filters)
    return read_filtered(pq.ParquetFile(str(p), memory_map=False, pre_buffer=False), str(p), columns, filters or [])


_COMPARE: dict[str, Callable[[np.ndarray, Any], np.ndarray]] = {
    "==": lambda a, v: a == v,
    "=": lambda a, v: a == v,
    "!=": lambda a, v: a != v,
    "<": lambda a, v: a < v,
    "<=": lambda a, v: a <= v,
    ">": lambda a, v: a > v,
    ">=": lambda a, v: a >= v,
}
"""The filter operators `read_table` applies itself (others go through `pyarrow.parquet.read_table`)."""


def _may_match(st: Any, op: str, v: Any) -> bool:
    """Whether a row group with column statistics `st` may hold a row passing (op, v)."""
    if st is None or not st.has_min_max:
        return True
    lo, hi = st.min, st.max
    if op in ("==", "="):
        return bool(lo <= v <= hi)
    if op in ("<", "<="):
        return bool(lo < v if op == "<" else lo <= v)
    if op in (">", ">="):
        return bool(hi > v if op == ">" else hi >= v)
    return True


def read_filtered(
    pf: pq.ParquetFile, path: str, columns: list[str] | None, filters: list[tuple[str, str, object]]
) -> pa.Table:
    """`columns` of the rows of table `pf` (opened from `path`: its footer is not read again) passing every
    (column, op, value) of `filters` (`_COMPARE`'s operators), in stored order.

    With `pyarrow.parquet.ParquetFile` and NumPy masks rather than `pyarrow.parquet.read_table`, which goes through
    `pyarrow.dataset` (its import and its scan threads, in every serving worker that reads an index).
    Row groups whose statistics exclude a filter are not read; a filtered column holding nulls, or one NumPy cannot
    compare, is read through `pyarrow.parquet.read_table` instead (its rules for nulls).
    """
    if not filters:
        return pf.read(columns=columns, use_threads=False)
    want = pf.schema_arrow.names if columns is None else columns
    idx = {c: pf.schema_arrow.get_field_index(c) for c, _, _ in filters}
    if any(i < 0 for i in idx.values()):  # pyarrow's own message for an unknown column
        return pq.read_table(path, columns=columns, filters=filters)
    md = pf.metadata
    groups = [
        g
        for g in range(pf.num_row_groups)
        if all(_may_match(md.row_group(g).column(idx[c]).statistics, op, v) for c, op, v in filters)
    ]
    read = list(dict.fromkeys([*want, *idx]))
    parts = []
    for g in groups:
        t = pf.read_row_group(g, columns=read, use_threads=False)
        keep = np.ones(t.num_rows, dtype=bool)
        for c, op, v in filters:
            col = t.column(c)
            if col.null_count or not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
                return pq.read_table(path, columns=columns, filters=filters)
            keep &= _COMPARE[op](col.to_numpy(), v)
        if not keep.all():
            t = t.filter(pa.array(keep))
        parts.append(t.select(want))
    if not parts:
        return pf.schema_arrow.empty_table().select(want)
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


@dataclass
class ReadCount:
    """What step-range readers read: row groups and rows (a caller's tally, for reports and tests)."""

    row_groups: int = 0
    rows: int = 0


def _step_groups(pf: pq.ParquetFile, first: int, last: int) -> list[int]:
    """Row groups of a table sorted by `step` whose step statistics overlap [first, last] (all without them)."""
    col = pf.schema_arrow.get_field_index("step")
    out = []
    for i in range(pf.num_row_groups):
        st = pf.metadata.row_group(i).column(col).statistics
        if st is None or not st.has_min_max or (int(st.max) >= first and int(st.min) <= last):
            out.append(i)
    return out


def step_span(path: str | Path, kind: TableKind) -> tuple[int, int]:
    """(first, last) step of a stored table sorted by `step`, from its footer (last < first: no rows)."""
    pf = open_table(path, kind)
    col = pf.schema_arrow.get_field_index("step")
    lo, hi = None, None
    for i in range(pf.num_row_groups):
        st = pf.metadata.row_group(i).column(col).statistics
        if pf.metadata.row_group(i).num_rows == 0:
            continue
        if st is None or not st.has_min_max:  # no statistics: read the step column (the one way to know)
            steps = pf.read_row_group(i, columns=["step"]).column("step").to_numpy()
            a, b = int(steps.min()), int(steps.max())
        else:
            a, b = int(st.min), int(st.max)
        lo, hi = (a, b) if lo is None or hi is None else (min(lo, a), max(hi, b))
    return (0, -1) if lo is None or hi is None else (lo, hi)


def iter_steps(
    path: str | Path,
    kind: TableKind,
    first: int = 0,
    last: int | None = None,
    columns: list[str] | None = None,
    count: ReadCount | None = None,
    use_threads: bool = True,
) -> Iterator[pa.Table]:
    """The rows with first <= step <= last of a stored table sorted by `step`, one row group at a time:
    only row groups whose step statistics overlap the range are read, and only `columns` (plus `step`).
    `use_threads`: decode a row group's columns on Arrow's CPU threads (off in serving processes)."""
    pf = open_table(path, kind)
    hi = np.iinfo(np.int64).max if last is None else last
    cols = None if columns is None else list(dict.fromkeys(["step", *columns]))
    for i in _step_groups(pf, first, hi):
        t = pf.read_row_group(i, columns=cols, use_threads=use_threads)
        if count is not None:
            count.row_groups += 1
            count.rows += t.num_rows
        step = t.column("step").to_numpy()
        keep = (step >= first) & (step <= hi)
        if not keep.all():
            t = t.filter(pa.array(keep))
        yield t if columns is None else t.select(columns)


def read_steps(
    path: str | Path,
    kind: TableKind,
    first: int = 0,
    last: int | None = None,
    columns: list[str] | None = None,
    count: ReadCount | None = None,
) -> pa.Table:
    """`iter_steps` as one table (the range's rows only: never the whole table for a short range)."""
    parts = list(iter_steps(path, kind, first, last, columns, count))
    if parts:
        return pa.concat_tables(parts)
    schema = open_table(path, kind).schema_arrow
    names = schema.names if columns is None else columns
    return pa.schema([schema.field(n) for n in names]).empty_table()
