"""A loader verifies samples only against checksums of this loomdata's definition, recorded in the index."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from loomdata.execution._verify import require_checksums
from loomdata.schemas import ContractError
from loomdata.schemas.tables import TableKind, write_table
from loomdata.sources._integrity import CHECKSUM


def _index(path: Path, checksum: bool, name: str | None) -> Path:
    cols = {
        "sample": pa.array([0], pa.uint64()),
        "shard": pa.array([0], pa.uint32()),
        "row": pa.array([0], pa.uint64()),
        "num_tokens": pa.array([3], pa.uint32()),
        "num_image_tokens": pa.array([0], pa.uint32()),
    }
    if checksum:
        cols["checksum"] = pa.array([7], pa.uint32())
    write_table(pa.table(cols), path, TableKind.INDEX, {"checksum": name} if name is not None else None)
    return path


def test_the_current_definition_passes(tmp_path: Path) -> None:
    require_checksums(_index(tmp_path / "s.parquet", True, CHECKSUM), "web")


@pytest.mark.parametrize(
    ("checksum", "name", "says"),
    [
        (True, "crc32-int32le", "'crc32-int32le'"),
        (True, None, "no recorded definition"),
        (False, None, "no per-sample checksums"),
    ],
)
def test_another_or_no_definition_is_refused_with_the_fix(
    tmp_path: Path, checksum: bool, name: str | None, says: str
) -> None:
    path = _index(tmp_path / "s.parquet", checksum, name)
    with pytest.raises(ContractError) as err:
        require_checksums(path, "web")
    msg = str(err.value)
    assert str(path) in msg and "'web'" in msg and says in msg and "re-run `loom index` and `loom plan`" in msg, msg
    assert "changed after indexing" not in msg
