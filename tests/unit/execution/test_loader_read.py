"""A loader's read path with the real Parquet reader (no cluster): segments cut from the right samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loomdata.execution._loader import REQUEST_DTYPE, read_segments
from loomdata.execution._partition import LoaderPartition
from loomdata.execution._sample_index import SampleIndex
from loomdata.schemas import ExecutionError, ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources import make_reader


@pytest.fixture
def setup(tmp_path: Path) -> tuple[object, dict[int, Path], list[list[int]]]:
    docs = [[list(range(100 * (f * 10 + i), 100 * (f * 10 + i) + 5 + i)) for i in range(10)] for f in range(2)]
    paths = {}
    for f in range(2):
        p = tmp_path / f"s{f}.parquet"
        pq.write_table(pa.table({"ids": pa.array(docs[f], pa.list_(pa.int32()))}), p, row_group_size=3)
        paths[f + 3] = p  # shard ids 3 and 4 (a partition that does not start at shard 0)
    src = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["*.parquet"], tokens_field="ids")
    return make_reader(src, TokenizerSpec(), ImageSpec()), paths, docs[0] + docs[1]


def test_segments_come_back_in_request_order(setup: tuple[object, dict[int, Path], list[list[int]]]) -> None:
    reader, paths, flat_docs = setup
    part = LoaderPartition(
        source_id=0, source="s", part=1, first_shard=3, stop_shard=5, first_sample=30, stop_sample=50
    )
    index = SampleIndex.of(np.arange(30, 50, dtype=np.uint64), np.repeat([3, 4], 10), np.tile(np.arange(10), 2))
    req = np.zeros(4, dtype=REQUEST_DTYPE)
    req["sample"] = [45, 31, 45, 30]  # unsorted, across shards, one sample twice
    req["offset"] = [2, 0, 0, 4]
    req["length"] = [3, 6, 2, 1]
    out = read_segments(reader, req, index, paths, 14, part)  # type: ignore[arg-type]
    want = np.concatenate([flat_docs[15][2:5], flat_docs[1][0:6], flat_docs[15][0:2], flat_docs[0][4:5]]).astype(
        np.int32
    )
    np.testing.assert_array_equal(out.tokens, want)
    assert out.images == []


def test_bad_requests_are_named(setup: tuple[object, dict[int, Path], list[list[int]]]) -> None:
    reader, paths, _ = setup
    part = LoaderPartition(
        source_id=0, source="s", part=1, first_shard=3, stop_shard=5, first_sample=30, stop_sample=50
    )
    index = SampleIndex.of(np.arange(30, 50, dtype=np.uint64), np.repeat([3, 4], 10), np.tile(np.arange(10), 2))
    args = (index, paths, 14, part)
    req = np.zeros(1, dtype=REQUEST_DTYPE)
    req["sample"], req["length"] = 12, 1
    with pytest.raises(ExecutionError, match="sample 12 is not in loader part 1"):
        read_segments(reader, req, *args)  # type: ignore[arg-type]
    req["sample"], req["offset"], req["length"] = 30, 3, 3  # sample 30 has 5 tokens
    with pytest.raises(ExecutionError, match=r"row 0: sample 30 .* has 5 tokens but the plan uses tokens 3..5"):
        read_segments(reader, req, *args)  # type: ignore[arg-type]


def test_a_data_error_names_file_and_row_and_survives_pickling(tmp_path: Path) -> None:
    import pickle

    from loomdata.schemas import SourceDataError

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"ids": pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))}), bad)
    src = SourceSpec(name="s", format=SourceFormat.PARQUET, paths=["*.parquet"], tokens_field="ids")
    reader = make_reader(src, TokenizerSpec(), ImageSpec())
    part = LoaderPartition(source_id=0, source="s", part=0, first_shard=0, stop_shard=1, first_sample=0, stop_sample=3)
    req = np.zeros(1, dtype=REQUEST_DTYPE)
    req["sample"], req["length"] = 1, 1
    with pytest.raises(SourceDataError) as e:
        index = SampleIndex.of(np.arange(3, dtype=np.uint64), np.zeros(3, np.int64), np.arange(3))
        read_segments(reader, req, index, {0: bad}, 14, part)  # type: ignore[arg-type]
    back = pickle.loads(pickle.dumps(e.value))  # how it crosses from a loader actor to the client
    assert type(back) is SourceDataError and str(back) == str(e.value)
    assert (back.path, back.row, back.reason) == (str(bad), 1, "column 'ids': null value")
