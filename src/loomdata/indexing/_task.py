"""The scan task that runs on Dask workers: scan one part of one shard with a per-process reader.

Failures travel back as data (`Failure`), not as raised exceptions: `SourceDataError` does not
survive pickling, and the client decides between stopping (`on_error: error`) and skipping.
"""

from __future__ import annotations

import enum
import json
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import ImageSpec, SourceSpec, TokenizerSpec
from loomdata.sources import FormatReader, make_reader

__all__ = ["Failure", "FailureKind", "PartOutcome", "ScanJob", "rebuild_source_error", "run_scan"]

_READERS: dict[str, FormatReader] = {}
"""Readers of this worker process, keyed by the JSON of (source, tokenizer, images)."""


class FailureKind(str, enum.Enum):
    """Bad input (a SourceDataError or OSError) or a bug in a reader (any other exception)."""

    SOURCE = "source"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a part could not be scanned; enough to rebuild the original error in the client."""

    kind: FailureKind
    message: str  # str() of the original exception
    path: str
    reason: str
    row: int | None = None
    detail: str = ""  # traceback of an internal error


@dataclass(frozen=True, slots=True)
class ScanJob:
    """What a task needs to scan one shard of one source; small and picklable."""

    source_idx: int
    shard_idx: int
    path: Path
    source: SourceSpec
    tokenizer: TokenizerSpec
    images: ImageSpec
    target_bytes: int

    def reader_key(self) -> str:
        return json.dumps(
            [
                self.source.model_dump(mode="json"),
                self.tokenizer.model_dump(mode="json"),
                self.images.model_dump(mode="json"),
            ],
            sort_keys=True,
        )


@dataclass(frozen=True, slots=True)
class PartOutcome:
    """The scan of one part: rows and skipped samples, or a failure; `num_parts` of the whole shard."""

    source_idx: int
    shard_idx: int
    part: int
    num_parts: int
    rows: pa.Table | None = None
    errors: list[tuple[int | None, str]] = field(default_factory=list)
    failure: Failure | None = None


def _reader(job: ScanJob) -> FormatReader:
    key = job.reader_key()
    reader = _READERS.get(key)
    if reader is None:
        reader = make_reader(job.source, job.tokenizer, job.images)
        _READERS[key] = reader
    return reader


def run_scan(job: ScanJob, part: int | None, num_parts: int | None) -> PartOutcome:
    """Scan part `part` of `num_parts`; `part=None` first splits the shard and scans part 0."""
    n = num_parts or 1
    p = part or 0
    reader: FormatReader | None = None
    try:
        reader = _reader(job)
        if part is None:
            n = max(int(reader.num_parts(job.path, job.target_bytes)), 1)
        result = reader.scan(job.path, p, n)
        return PartOutcome(job.source_idx, job.shard_idx, p, n, rows=result.rows, errors=list(result.errors))
    except SourceDataError as e:
        failure = Failure(FailureKind.SOURCE, str(e), e.path, e.reason, e.row)
    except OSError as e:
        err = SourceDataError(str(job.path), f"cannot read the file ({e})")
        failure = Failure(FailureKind.SOURCE, str(err), err.path, err.reason)
    except Exception as e:
        failure = Failure(
            FailureKind.INTERNAL, f"{type(e).__name__}: {e}", str(job.path), str(e), detail=traceback.format_exc()
        )
    finally:
        if reader is not None:
            reader.close()  # drop file state: the next run may see a changed file at the same path
    return PartOutcome(job.source_idx, job.shard_idx, p, n, failure=failure)


def rebuild_source_error(f: Failure) -> SourceDataError:
    """The SourceDataError a task caught, with its attributes and message exactly as raised."""
    err = SourceDataError.__new__(SourceDataError)
    Exception.__init__(err, f.message)
    err.path, err.row, err.reason = f.path, f.row, f.reason
    return err
