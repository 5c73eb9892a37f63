"""Where each stage's files live under the spec's workdir, and typed readers for them.

workdir/index/<source>/samples.parquet   index table (INDEX_SCHEMA + metadata columns);
                                         metadata `fingerprint` = content hash of the index
workdir/index/<source>/shards.parquet    shards table (SHARDS_SCHEMA)
workdir/index/<source>/errors.parquet    skipped shards/samples (ERRORS_SCHEMA), when any
workdir/plans/<plan_id>/plan.json        PlanMeta
workdir/plans/<plan_id>/manifest/steps-<first>-<last>.parquet   MANIFEST_SCHEMA
workdir/plans/<plan_id>/serve.json       ServeInfo, while an executor serves the plan
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from loomdata.schemas.errors import IndexBuildError
from loomdata.schemas.tables import TableKind, open_table, read_filtered, read_table, stamped_metadata

__all__ = ["IndexFiles", "ObjectMemo", "load_objects", "objects_file", "read_index", "store_objects"]


@dataclass(frozen=True, slots=True)
class IndexFiles:
    """Paths of one source's index tables."""

    root: Path

    @classmethod
    def of(cls, workdir: Path, source: str) -> IndexFiles:
        return cls(Path(workdir) / "index" / source)

    @property
    def samples(self) -> Path:
        return self.root / "samples.parquet"

    @property
    def shards(self) -> Path:
        return self.root / "shards.parquet"

    @property
    def errors(self) -> Path:
        return self.root / "errors.parquet"

    def fingerprint(self) -> str:
        """The index's content fingerprint (changes whenever its content does)."""
        self._require()
        return self.fingerprint_of(open_table(self.samples, TableKind.INDEX))

    def fingerprint_of(self, samples: pq.ParquetFile) -> str:
        """The fingerprint in the already opened samples table (no second read of its footer)."""
        fp = stamped_metadata(samples.schema_arrow).get("fingerprint")
        if not fp:
            raise IndexBuildError(f"{self.samples}: has no fingerprint; rebuild the index with `loom index`")
        return fp

    def open_samples(self) -> tuple[pq.ParquetFile, str]:
        """The samples table opened once (kind, version and schema checked) and its fingerprint; the shards
        table's footer checked too."""
        self._require()
        open_table(self.shards, TableKind.SHARDS).close()  # (its footer checked; nothing more read of it here)
        pf = open_table(self.samples, TableKind.INDEX)
        return pf, self.fingerprint_of(pf)

    def sample_shards(self) -> pa.Table:
        """The `shard` column of the index (samples are in shard order): what loader partitioning needs."""
        self._require()
        return read_table(self.samples, TableKind.INDEX, columns=["shard"])

    def samples_of_shards(self, first: int, stop: int, columns: list[str]) -> pa.Table:
        """`columns` of the samples in shards [first, stop): one loader partition's part of the index."""
        return self.shard_samples(first, stop, columns)[0]

    def shard_samples(self, first: int, stop: int, columns: list[str]) -> tuple[pa.Table, str]:
        """(`samples_of_shards`, the fingerprint of the index they were read from): one open of the file, so the
        rows are those of the index the fingerprint names (a reader comparing it with a plan's)."""
        self._require()
        pf = open_table(self.samples, TableKind.INDEX)
        table = read_filtered(pf, str(self.samples), columns, [("shard", ">=", first), ("shard", "<", stop)])
        return table, self.fingerprint_of(pf)

    def shard_table(self) -> pa.Table:
        """The shards table (SHARDS_SCHEMA)."""
        self._require()
        return read_table(self.shards, TableKind.SHARDS)

    def _require(self) -> None:
        if not self.samples.exists() or not self.shards.exists():
            raise IndexBuildError(f"{self.root}: no index for source {self.root.name!r}; run `loom index SPEC` first")


def read_index(workdir: Path, source: str, columns: list[str] | None = None) -> tuple[pa.Table, pa.Table, str]:
    """(samples, shards, fingerprint) of one source's index; each table's footer is read once."""
    files = IndexFiles.of(workdir, source)
    files._require()
    pf = open_table(files.samples, TableKind.INDEX)
    samples = pf.read(columns=columns)
    shards = open_table(files.shards, TableKind.SHARDS).read()
    return samples, shards, files.fingerprint_of(pf)


_OBJECTS_VERSION = 1
"""The format of a source's `_objects.json` (the indexer writes it; a loader reads its objects' whole ETags)."""


@dataclass(frozen=True, slots=True)
class ObjectMemo:
    """What an object was when last indexed: its version (ETag/version id), size and content fingerprint."""

    version: str
    size: int
    fingerprint: str


def objects_file(root: Path) -> Path:
    """The memo of a source's indexed objects."""
    return root / "_objects.json"


def load_objects(root: Path) -> dict[str, ObjectMemo]:
    """The memo of a source's objects (empty when missing, unreadable or of another version)."""
    try:
        data = json.loads(objects_file(root).read_text())
        if data.get("version") != _OBJECTS_VERSION:
            return {}
        return {u: ObjectMemo(str(v), int(n), str(f)) for u, (v, n, f) in data["objects"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def store_objects(root: Path, memo: Mapping[str, ObjectMemo]) -> None:
    """Write the memo atomically (or remove it when no shard is an object)."""
    path = objects_file(root)
    if not memo:
        path.unlink(missing_ok=True)
        return
    body = {
        "version": _OBJECTS_VERSION,
        "objects": {u: [m.version, m.size, m.fingerprint] for u, m in sorted(memo.items())},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body, indent=1))
    os.replace(tmp, path)
