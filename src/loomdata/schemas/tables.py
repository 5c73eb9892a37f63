"""Arrow schemas of the stored tables (index, shards, errors, manifest, a plan's report), versioned.

Every table loomdata writes carries `loomdata.kind` and `loomdata.version` in its Parquet
key-value metadata; `read_table` rejects a wrong kind, version or schema with a message that
names the file and what differs.

Index version 2 adds `checksum` (per-sample, see sources/_integrity), which the index job always
writes and loaders verify against. It is optional in the schema (checked for its type when present):
the planner never reads it, and hand-made index tables (tests, tools) may leave it out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from loomdata.schemas.errors import ContractError

__all__ = [
    "CHECKSUM_FIELD",
    "ERRORS_SCHEMA",
    "INDEX_COLUMNS",
    "INDEX_SCHEMA",
    "MANIFEST_SCHEMA",
    "PLAN_RANKS_SCHEMA",
    "PLAN_STEPS_SCHEMA",
    "SHARDS_SCHEMA",
    "TableKind",
    "check_schema",
    "read_table",
    "table_metadata",
    "write_table",
]


class TableKind(str, enum.Enum):
    """The kinds of stored table; each has a schema and a format version."""

    INDEX = "index"
    SHARDS = "shards"
    ERRORS = "errors"
    MANIFEST = "manifest"
    PLAN_STEPS = "plan_steps"
    PLAN_RANKS = "plan_ranks"


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
"""report/steps.parquet, one row per step; per source `tokens__<name>` (int64) and `weight__<name>` (float64)
follow, and `budget` (int64, the step's token budget) in re-plans."""

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


def write_table(
    table: pa.Table,
    path: str | Path,
    kind: TableKind,
    extra_metadata: Mapping[str, str] | None = None,
    row_group_size: int | None = None,
) -> None:
    """Write `table` as Parquet (zstd) with its kind and version stamped in the metadata."""
    check_schema(table, kind, str(path))
    meta = dict(table.schema.metadata or {})
    meta[_KIND] = kind.value.encode()
    meta[_VERSION] = str(VERSIONS[kind]).encode()
    for k, v in (extra_metadata or {}).items():
        meta[f"loomdata.{k}".encode()] = v.encode()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        table.replace_schema_metadata(meta),
        str(path),
        compression="zstd",
        row_group_size=row_group_size,
        write_statistics=True,
        store_schema=True,
    )


def table_metadata(path: str | Path) -> dict[str, str]:
    """The `loomdata.*` key-value metadata of a stored table (keys without the prefix)."""
    meta = pq.read_schema(str(path)).metadata or {}
    return {k.decode()[len("loomdata.") :]: v.decode() for k, v in meta.items() if k.startswith(b"loomdata.")}


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
    return pq.read_table(str(p), columns=columns, filters=filters)
