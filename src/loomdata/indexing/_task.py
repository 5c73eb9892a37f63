"""The scan task that runs on Dask workers: scan one part of one shard with a reader of its own.

Failures travel back as data (`Failure`), not as raised exceptions, so the client decides between
stopping (`on_error: error`) and skipping. Bad input travels as the reader's `SourceDataError`
itself: it pickles by its constructor arguments, so the client raises it with its path, row and hint.
The reader lives exactly as long as the task: it is made at the start and closed at the end, so no
file state outlives a scan (the next task may see a changed file at the same path) and no two tasks
in one worker process share a reader.
"""

from __future__ import annotations

import enum
import traceback
from dataclasses import dataclass, field

import pyarrow as pa

from loomdata.indexing._cache import tag_checksum_dtype, tag_layout
from loomdata.schemas.errors import SourceDataError
from loomdata.schemas.spec import ImageSpec, SourceSpec, TokenizerSpec
from loomdata.sources import make_reader
from loomdata.storage import Location

__all__ = ["Failure", "FailureKind", "PartOutcome", "ScanJob", "run_scan"]


class FailureKind(str, enum.Enum):
    """Bad input (a SourceDataError or OSError) or a bug in a reader (any other exception)."""

    SOURCE = "source"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a part could not be scanned: bad input (`error`, the reader's SourceDataError) or a reader bug."""

    kind: FailureKind
    path: str
    message: str  # str() of the original exception (with its type name for an internal error)
    error: SourceDataError | None = None  # set exactly when kind is SOURCE
    detail: str = ""  # traceback of an internal error

    @property
    def row(self) -> int | None:
        """The bad row the reader named, if any."""
        return None if self.error is None else self.error.row

    @property
    def reason(self) -> str:
        """What is wrong, without the file and row (they are `path` and `row`)."""
        return self.message if self.error is None else self.error.reason


@dataclass(frozen=True, slots=True)
class ScanJob:
    """What a task needs to scan one shard of one source; small and picklable."""

    source_idx: int
    shard_idx: int
    path: Location
    source: SourceSpec
    tokenizer: TokenizerSpec
    images: ImageSpec
    target_bytes: int


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


def run_scan(job: ScanJob, part: int | None, num_parts: int | None) -> PartOutcome:
    """Scan part `part` of `num_parts`; `part=None` first splits the shard and scans part 0."""
    n = num_parts or 1
    p = part or 0
    try:
        reader = make_reader(job.source, job.tokenizer, job.images)
        try:
            if part is None:
                n = max(int(reader.num_parts(job.path, job.target_bytes)), 1)
            result = reader.scan(job.path, p, n)
            rows = tag_checksum_dtype(result.rows, reader.checksum_dtype(job.path))
            if p == 0:  # an object's footer, for the index's layouts table (read already: no request)
                rows = tag_layout(rows, reader.layout_of(job.path))
        finally:
            reader.close()
        return PartOutcome(job.source_idx, job.shard_idx, p, n, rows=rows, errors=list(result.errors))
    except SourceDataError as e:
        failure = Failure(FailureKind.SOURCE, e.path, str(e), error=e)
    except OSError as e:
        err = SourceDataError(str(job.path), f"cannot read the file ({e})")
        failure = Failure(FailureKind.SOURCE, err.path, str(err), error=err)
    except Exception as e:
        failure = Failure(
            FailureKind.INTERNAL, str(job.path), f"{type(e).__name__}: {e}", detail=traceback.format_exc()
        )
    return PartOutcome(job.source_idx, job.shard_idx, p, n, failure=failure)
