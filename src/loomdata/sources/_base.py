"""The protocol every source format implements: list shards, scan lengths, read samples by location.

A format reader knows nothing of Dask, plans or ranks. The index job calls `num_parts` and `scan`
(one task per part of a shard); Source Loader actors call `read` with the `row` values the scan
produced; a path is a `Location` (a local `Path`, or an object URL string read through
`loomdata.storage`). One reader instance may keep file state (open handles, Parquet metadata, decompressed
blocks) between calls; it is created where it is used, never pickled with that state.

Threads: a reader whose `thread_safe` is False (the default) may be called from one thread at a time
only; whoever shares it across threads (a Source Loader reads small requests on its event loop and
large ones in a thread) must serialise its calls. A reader that sets `thread_safe = True` guards its
own state and may be called concurrently.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pyarrow as pa

from loomdata.schemas.formats import check_fields
from loomdata.schemas.spec import ImageSpec, SourceSpec, TokenizerSpec
from loomdata.sources._integrity import TOKEN_DTYPE
from loomdata.storage import Location

__all__ = ["FormatReader", "Sample", "ScanResult"]


@dataclass(frozen=True, slots=True)
class ScanResult:
    """Lengths of the samples of one part of one shard.

    `rows` has columns `row: uint64` (the location `read` takes), `num_tokens: uint32`,
    `num_image_tokens: uint32`, `checksum: uint32` (of the token stream `read` returns, hashed in
    `checksum_dtype(path)`, see `sources._integrity`), then the source's metadata columns, in shard order.
    `errors` lists skipped samples as (row or None, message); only non-empty with `on_error: skip`.
    """

    rows: pa.Table
    errors: list[tuple[int | None, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample's token stream (image placeholder tokens first, then text) and its decoded images."""

    tokens: np.ndarray  # int32, len == num_tokens of the index
    images: list[np.ndarray] = field(default_factory=list)  # HWC uint8, resized per ImageSpec


class FormatReader(abc.ABC):
    """Scans and reads one source's shards; subclasses implement one on-disk format."""

    thread_safe: ClassVar[bool] = False
    """Whether `scan`/`read`/`close` may run in several threads at once (else callers serialise them)."""

    def __init__(self, source: SourceSpec, tokenizer: TokenizerSpec, images: ImageSpec) -> None:
        check_fields(source)  # the format's field rules (`FIELD_RULES`), the same ones the spec is checked by
        self.source = source
        self.tokenizer_spec = tokenizer
        self.images = images

    @abc.abstractmethod
    def num_parts(self, path: Location, target_bytes: int) -> int:
        """How many independently scannable parts `path` splits into (row groups, byte ranges), >= 1."""

    @abc.abstractmethod
    def scan(self, path: Location, part: int, num_parts: int) -> ScanResult:
        """Lengths of the samples in part `part` of `num_parts` of `path`.

        Raises SourceDataError (naming file and row) on bad input when the source's on_error is
        `error`; with `skip`, bad samples are left out of `rows` and listed in `errors`.
        """

    @abc.abstractmethod
    def read(self, path: Location, rows: np.ndarray) -> list[Sample]:
        """The samples at `rows` (values of the scan's `row` column) of `path`, in the order given."""

    def checksum_dtype(self, path: Location) -> np.dtype:
        """The dtype `path`'s samples are checksummed in: how the shard stores its ids (default int32).

        The scan hashes the stored ids in it; verification casts the int32 tokens `read` returns to it.
        """
        return TOKEN_DTYPE

    def close(self) -> None:  # noqa: B027 - optional hook; readers without state have nothing to release
        """Release open files and caches."""
