"""Whether a Source Loader's warm-up makes s3fs's client (`_plan_ahead._needs_fsspec`), told from held footers.

No store is reached: the objects' footers are held as the index keeps them (`hold_layouts`), so telling their row
groups' sizes makes no request.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.execution._plan_ahead import _needs_fsspec
from loomdata.execution._verify import ShardCheck, Verifier
from loomdata.schemas.spec import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec, VerifyMode
from loomdata.sources import make_reader
from loomdata.storage import request_stats, reset_request_stats
from loomdata.storage._arrow import ARROW_MIN_READ


def _file(path: Path, small_tail: bool) -> tuple[int, bytes]:
    """A Parquet file of row groups over `ARROW_MIN_READ` each (`small_tail`: and a last one far under it); its size
    and footer as the index keeps it (a Parquet metadata file)."""
    rng = np.random.default_rng(5)
    rows = 96 + (4 if small_tail else 0)
    docs = [rng.integers(1, 1 << 30, size=4000, dtype=np.int32) for _ in range(rows)]
    table = pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))})
    pq.write_table(table, path, row_group_size=48, use_dictionary=False, compression="none")
    md = pq.read_metadata(path)
    sizes = [md.row_group(g).column(0).total_compressed_size for g in range(md.num_row_groups)]
    assert min(sizes[:2]) >= ARROW_MIN_READ and (not small_tail or sizes[-1] < ARROW_MIN_READ), sizes
    sink = pa.BufferOutputStream()
    md.write_metadata_file(sink)
    return path.stat().st_size, sink.getvalue().to_pybytes()


@pytest.mark.parametrize("small_tail", [False, True])
def test_a_row_group_under_the_pyarrow_bar_makes_the_warm_up_make_s3fs_client(tmp_path: Path, small_tail: bool) -> None:
    """Every object checked by its HEAD and its footer held: s3fs's client is made at warm-up only where some row group
    of an object is under `ARROW_MIN_READ` (its GET goes through fsspec, which would make the client mid-run)."""
    url = "s3://bkt/part-0.parquet"
    size, footer = _file(tmp_path / "part-0.parquet", small_tail)
    source = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=[url], tokens_field="tokens")
    reader = make_reader(source, TokenizerSpec(), ImageSpec())
    reader.hold_layouts({url: (size, footer)})
    verifier = Verifier("s", VerifyMode.SHARD, SourceFormat.PARQUET, {0: ShardCheck(size, 7, "fp")}, versions={0: "e"})
    assert verifier.opens_handle(0, url)
    loader = SimpleNamespace(
        _paths={0: url}, _held_layouts=frozenset([url]), _verifier=verifier, _reader=reader, _source=source
    )
    reset_request_stats()
    assert _needs_fsspec(loader) is small_tail
    assert request_stats() == {}  # told from the held footer: no request
