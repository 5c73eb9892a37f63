"""A scan task's bad-input error crosses processes intact: the client raises the reader's own error."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
from distributed.protocol import pickle as dask_pickle

from loomdata.indexing._task import FailureKind, PartOutcome, ScanJob, run_scan
from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import ImageSpec, SourceFormat, SourceSpec, TokenizerSpec
from loomdata.sources.megatron import IDX_HEADER
from loomdata.testing import write_megatron


def _corrupt_pointer(prefix: Path, n: int, seq: int) -> None:
    """Point sequence `seq` of an `n`-sequence dataset at byte 2: the scan names that row, with a hint."""
    idx = Path(f"{prefix}.idx")
    raw = bytearray(idx.read_bytes())
    at = IDX_HEADER.size + 4 * n + 8 * seq
    raw[at : at + 8] = struct.pack("<q", 2)
    idx.write_bytes(bytes(raw))


def test_a_scan_tasks_source_error_keeps_path_row_and_hint_through_pickling(tmp_path: Path) -> None:
    prefix = tmp_path / "ds"
    write_megatron(prefix, [np.arange(1, 6) for _ in range(10)])
    _corrupt_pointer(prefix, 10, 3)
    source = SourceSpec(name="mg", format=SourceFormat.MEGATRON, paths=["ds"])
    out = run_scan(ScanJob(0, 0, prefix, source, TokenizerSpec(), ImageSpec(), 1 << 20), None, None)
    failure = out.failure
    assert failure is not None and failure.kind is FailureKind.SOURCE and failure.error is not None
    raised = failure.error
    assert (raised.path, raised.row) == (f"{prefix}.idx", 3)
    assert raised.hint is not None and "preprocess_data.py" in raised.hint
    for dumps, loads in [(pickle.dumps, pickle.loads), (dask_pickle.dumps, dask_pickle.loads)]:
        back = loads(dumps(out))  # what a Dask task's result goes through
        assert isinstance(back, PartOutcome) and back.failure is not None
        err = back.failure.error
        assert type(err) is SourceDataError
        assert (err.path, err.row, err.reason, err.hint, str(err)) == (
            raised.path,
            raised.row,
            raised.reason,
            raised.hint,
            str(raised),
        )
        assert (back.failure.row, back.failure.reason) == (3, raised.reason)


def test_a_reader_bug_is_internal_and_carries_no_source_error(tmp_path: Path) -> None:
    prefix = tmp_path / "ds"
    write_megatron(prefix, [np.arange(4)])
    source = SourceSpec(name="mg", format=SourceFormat.MEGATRON, paths=["ds"])
    out = pickle.loads(pickle.dumps(run_scan(ScanJob(0, 0, prefix, source, TokenizerSpec(), ImageSpec(), 1), 4, 2)))
    assert out.failure is not None and out.failure.kind is FailureKind.INTERNAL and out.failure.error is None
    assert out.failure.message.startswith("ValueError: part 4 out of range") and out.failure.row is None
    assert "Traceback" in out.failure.detail
