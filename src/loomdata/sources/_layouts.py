"""The index's side table of object shards' layouts (`layouts.parquet`): a loader opens an object with no footer read.

Opening a Parquet object costs a range GET of its footer before its first row group can be asked for: one round
trip at the head of every serve's first read (session 23, 100 ms a request: planning the first chunk waited 180 ms
for the footers, 44 ms with them held; docs/object-storage.md). The index job
has read every footer already; it keeps each object shard's (`FormatReader.layout_of`, serialized: a few KB) in
`index/<source>/layouts.parquet` (LAYOUTS_SCHEMA), with the shard's fingerprint. A loader hands the layouts of its
object shards whose fingerprint is still the one shards.parquet holds to its reader (`hold_layouts`): an object
whose layout is held is opened with no request, its first row-group GET issued at once.

The layout is a hint, never trusted over the object: a shard rewritten after indexing is refused by the shard
check (size, ETag and content fingerprint), which every read waits for before it uses any byte. An index without
the table (older loomdata, local files, an unreadable table) reads footers as before. Only object shards have rows;
an index of local files writes none (a local footer read is a page-cache read).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from loomdata.schemas.errors import ContractError
from loomdata.schemas.tables import LAYOUTS_SCHEMA, TableKind, read_table, write_table
from loomdata.storage import Location, is_url

__all__ = ["LAYOUTS_FILE", "index_layouts", "layouts_table", "write_layouts"]

LAYOUTS_FILE = "layouts.parquet"
"""The side table's name in a source's index folder."""


def layouts_table(shards: list[int], fingerprints: list[str], layouts: list[bytes | None]) -> pa.Table | None:
    """The side table of the shards that have a layout (None: none has, as for local files)."""
    keep = [i for i, b in enumerate(layouts) if b is not None]
    if not keep:
        return None
    return pa.Table.from_arrays(
        [
            pa.array([shards[i] for i in keep], pa.uint32()),
            pa.array([fingerprints[i] for i in keep], pa.string()),
            pa.array([layouts[i] for i in keep], pa.binary()),
        ],
        schema=LAYOUTS_SCHEMA,
    )


def write_layouts(root: Path, table: pa.Table | None) -> None:
    """Write (atomically) or remove `root`'s side table; an unchanged one is left as it is."""
    path = Path(root) / LAYOUTS_FILE
    if table is None:
        path.unlink(missing_ok=True)
        return
    try:
        if read_table(path, TableKind.LAYOUTS).equals(table):
            return
    except (ContractError, OSError, pa.ArrowException):
        pass  # missing or unreadable: written below
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write_table(table, tmp, TableKind.LAYOUTS)
    os.replace(tmp, path)


def index_layouts(root: Path, shards: pa.Table, paths: Mapping[int, Location]) -> dict[str, tuple[int, bytes]]:
    """URL -> (indexed size, layout) of the object shards among `paths` (shard -> location) whose layout the index
    kept for the fingerprint shards.parquet (`shards`) holds now. Empty without object shards (no file is read), or
    without a readable table: their footers are read from the objects, as before the table."""
    if not any(is_url(p) for p in paths.values()):
        return {}
    try:
        table = read_table(Path(root) / LAYOUTS_FILE, TableKind.LAYOUTS)
    except (ContractError, OSError, pa.ArrowException):
        return {}
    want = {
        int(s): (str(fp), int(n))
        for s, fp, n in zip(
            shards.column("shard").to_pylist(),
            shards.column("fingerprint").to_pylist(),
            shards.column("size_bytes").to_pylist(),
            strict=True,
        )
        if is_url(paths.get(int(s), ""))
    }
    # this loader's object shards' rows only, before any layout becomes Python bytes (the table holds every shard's)
    table = table.filter(pc.is_in(table.column("shard"), value_set=pa.array(sorted(want), pa.uint32())))
    out: dict[str, tuple[int, bytes]] = {}
    for s, fp, layout in zip(
        table.column("shard").to_pylist(),
        table.column("fingerprint").to_pylist(),
        table.column("layout").to_pylist(),
        strict=True,
    ):
        got = want[int(s)]
        if got[0] == fp:
            out[str(paths[int(s)])] = (got[1], layout)
    return out
